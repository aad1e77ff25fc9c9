"""`specdec train-heads`: train an EAGLE draft head (models/eagle.py) for a target.

Terms (models/eagle.py, docs/architecture.md): the target's feature f_t is its final normed hidden state
at position t, what its output layer reads to score token t+1. The head reads the embedding of
token t+1 (the target's own, frozen) with f_t and predicts the next feature f^_{t+1}; the
target's own output layer turns f^_{t+1} into draft_probs (q) for token t+2, the
distribution to compare with target_probs (p), the target's own there (softmax of its logits
at the true f_{t+1}). The target stays frozen: only the head is trained and checkpointed.

A micro-batch is token ids [B, T] (T = context). The target gives their features F [B, T, H];
the head reads the embeddings of tokens 1..T-1 with the features F[:, :T-1] at positions
0..T-2 and predicts F^ [B, T-1, H], aimed at F[:, 1:]. The loss (EAGLE-1, Li et al. 2024):

    feature_weight · smooth_L1(F^, F[:, 1:]) + token_weight · KL(p ‖ q)

The feature loss regresses the next feature itself, which the head reads back at its next
drafting step; the token loss (forward KL, the cross-entropy against the target's soft labels,
as distill.py's) weighs the feature's errors by what they do to the next token's distribution.
EAGLE weights them 1.0 and 0.1, the defaults.

Noise: during training (not in evaluation) the features the head reads carry uniform noise
U(−a, a), EAGLE's augmentation: from its second drafting step on, the head reads its own
predicted features, which are off by its error. Here a = feature_noise × the root mean square
of the micro-batch's features, so that one default suits targets whose final norm scales
features differently; on features of unit scale the default 0.1 is EAGLE's U(−0.1, 0.1). The
noise is drawn from a seed the data generator draws with the micro-batch, so a resumed run adds
the same noise.

Data: text the target writes, the text the head meets when drafting. A fraction
on_policy_fraction (default 1) of micro-batches is the target's own continuation of the first
prompt_tokens tokens of a corpus window (distill.sample_from_target), each at one of
sample_temperatures chosen at random (default greedy or 0.8: the text greedy decoding
verifies, and sampled text); the others are plain corpus windows. The corpus is --corpus (the
standard library by default), with its held-out documents never trained on.

Evaluation, teacher-forced on held-out corpus windows (the head reads the target's true
features and the true next tokens, as for the first draft token of a round):
held_out_greedy_agreement (argmax q = argmax p: the first draft token's greedy acceptance),
held_out_alpha (1 − TV(p, q) at temperature 1: its acceptance rate when sampling), held_out_tv
and held_out_feature_loss (the smooth L1), before training (the initial head) and after.

Output: a head directory (head.json and head.safetensors, models/eagle.save_head; head.json
names the target and summarises the training), training_log.json and a model card, README.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.config import check, is_int, is_real
from specdec.models.eagle import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    EagleHead,
    head_config,
    is_head_directory,
    load_head,
    save_head,
)
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.loader import LoadedModel, load_pretrained
from specdec.output_dir import open_output_dir
from specdec.platform import cpu_model
from specdec.tools.training.corpus import check_stream_length, evaluation_windows, sample_windows, stdlib_path
from specdec.tools.training.distill import (
    acceptance_metrics,
    divergence_loss,
    frequent_share,
    frequent_tokens,
    sample_from_target,
    scored_divergence_loss,
    target_streams,
    weights_fingerprint,
)
from specdec.tools.training.loop import RunState, Task, TrainConfig, log, train_loop
from specdec.tools.training.model_card import command_line, some_names
from specdec.tools.training.train import (
    CHECKPOINT_DIR,
    RUN_OUTPUT_ENTRIES,
    SAVE_DTYPES,
    TrainResult,
    check_save_dtype,
    corpus_record,
    finish_run,
    initialise,
    open_run_output,
    resume_checkpoint,
    run_identity,
    training_positions,
)

KIND = "train-heads"
# what a train-heads run writes in its output directory: the head, its log and card, its checkpoint
HEAD_RUN_ENTRIES = (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    "README.md",
    "training_log.json",
    *(name for name in RUN_OUTPUT_ENTRIES if name.startswith(CHECKPOINT_DIR + "/")),
)


@dataclass(frozen=True)
class HeadsConfig:
    """What the head is taught (see the module docstring).

    context: tokens per training window, T (cut to the target's context if longer).
    feature_weight, token_weight: the weights of the feature loss and of the token loss (>= 0,
        not both 0).
    feature_noise: the half-width of the uniform noise on the features the head reads in
        training, relative to their root mean square (>= 0; 0: none).
    on_policy_fraction: the fraction of micro-batches sampled from the target, in [0, 1].
    sample_temperatures: the temperatures on-policy text is sampled at, one chosen at random per
        micro-batch (each >= 0; 0 is greedy).
    prompt_tokens: corpus tokens an on-policy sample continues from.
    target_dtype: the target's weights: "auto" (as saved), "float32" or "bfloat16".
    output_vocab: > 0: the head scores only the output_vocab tokens most frequent in the
        training text (and the end-of-text tokens), FR-Spec style, through those rows of the
        target's output layer; its token loss is over those (distill.scored_divergence_loss).
        0: the whole vocabulary.
    """

    context: int = 512
    feature_weight: float = 1.0
    token_weight: float = 0.1
    feature_noise: float = 0.1
    on_policy_fraction: float = 1.0
    sample_temperatures: tuple[float, ...] = (0.0, 0.8)
    prompt_tokens: int = 32
    target_dtype: str = "auto"
    output_vocab: int = 0

    def __post_init__(self) -> None:
        check(
            is_int(self.context) and self.context >= 2,
            f"context must be an integer >= 2 (a feature and the one after it), got {self.context!r}",
        )
        for name in ("feature_weight", "token_weight", "feature_noise"):
            value = getattr(self, name)
            check(is_real(value) and value >= 0, f"{name} must be a number >= 0, got {value!r}")
        check(
            self.feature_weight > 0 or self.token_weight > 0,
            "feature_weight and token_weight are both 0: the loss would be 0 and the head learn nothing",
        )
        check(
            is_real(self.on_policy_fraction) and 0 <= self.on_policy_fraction <= 1,
            f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction!r}",
        )
        temperatures = self.sample_temperatures
        check(
            isinstance(temperatures, (tuple, list))
            and len(temperatures) >= 1
            and all(is_real(t) and t >= 0 for t in temperatures),
            f"sample_temperatures must be one or more numbers >= 0 (0 is greedy), got {temperatures!r}",
        )
        object.__setattr__(self, "sample_temperatures", tuple(float(t) for t in temperatures))
        check(
            is_int(self.prompt_tokens) and self.prompt_tokens >= 1,
            f"prompt_tokens must be an integer >= 1, got {self.prompt_tokens!r}",
        )
        if self.target_dtype not in ("auto", *SAVE_DTYPES):
            raise ValueError(f"target_dtype must be auto, float32 or bfloat16, got {self.target_dtype!r}")
        check(
            is_int(self.output_vocab) and self.output_vocab >= 0,
            f"output_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.output_vocab!r}",
        )

    def identity(self) -> dict:
        """What a resumed run must share (output_vocab only where set: a run from before it existed
        resumes)."""
        fields = _plain(dataclasses.asdict(self))
        if not self.output_vocab:
            del fields["output_vocab"]
        return fields


@dataclass(frozen=True)
class MicroBatch:
    """What the head trains on in one micro-batch: token_ids [B, T] (on the device) and the seed
    of the noise on their features."""

    token_ids: torch.Tensor
    noise_seed: int


def output_layer_words(config) -> str:
    """The tokens a target's output layer scores (config: its ModelConfig), in words."""
    reduced = f" of its {config.vocab_size:,} (output_vocab_size)" if config.output_vocab_size else ""
    return f"the target's output layer scores {config.head_size:,} tokens{reduced}"


def check_output_vocab(asked: int, target: LoadedModel) -> int:
    """asked (--output-vocab: the tokens a head scores; 0: every token the target scores), refused
    where a head of target cannot have it: no fewer than the tokens the target's output layer
    scores (a head scores at most those), or part of a reduced output layer's tokens (a head reads
    the target's rows by token id, which such a layer's rows are not)."""
    config = target.model.config
    if asked and asked >= config.head_size:
        raise ValueError(
            f"--output-vocab {asked:,}: {output_layer_words(config)}, and a head scores at most those; leave "
            "--output-vocab out (or give 0) for a head scoring all of them, or give fewer"
        )
    if asked and config.output_vocab_size:
        raise ValueError(
            f"--output-vocab {asked:,}: {output_layer_words(config)}, and a head scoring only part of a reduced "
            "output layer is not supported; leave --output-vocab out (or give 0): the head then scores all of them"
        )
    return asked


def train_heads(
    target_path: str | Path,
    out: str | Path,
    config: TrainConfig,
    heads_config: HeadsConfig = HeadsConfig(),
    corpus_path: str | Path | None = None,
    save_dtype: str = "bfloat16",
    restart: bool = False,
    require_checkpoint: bool = False,
    arguments: dict | None = None,
    force: bool = False,
) -> TrainResult:
    """Train (or resume training) an EAGLE head for the target at target_path and write it to
    `out` (see output_dir.py: out must not be an input, nor a directory of other files unless force)."""
    target_path, started = Path(target_path), time.perf_counter()
    check_save_dtype(save_dtype)
    inputs = {"TARGET": target_path, "--corpus": corpus_path}
    with open_run_output(out, KIND, inputs, force, HEAD_RUN_ENTRIES) as output:
        target = load_pretrained(target_path, heads_config.target_dtype, config.device, what="the target")
        if target.tokenizer is None or not target.eos_token_ids:
            raise ValueError(
                f"the target {target_path} needs a tokenizer.json and an eos_token_id to train a head on text"
            )
        check_output_vocab(heads_config.output_vocab, target)
        checkpoint = resume_checkpoint(output, restart, require_checkpoint)
        corpus, train_stream, held_out_stream = target_streams(target, corpus_path)
        tokenizer = target.tokenizer.backend
        context = fit_context(heads_config.context, target.model.config.max_position_embeddings)
        check_stream_length(train_stream, context, "training", config.batch_size)
        if len(held_out_stream) < 3:
            raise ValueError(
                f"the held-out text is only {len(held_out_stream)} tokens; evaluating a head needs at "
                "least 3 (a feature, the next and the token between): give a larger corpus"
            )
        check_prompt_tokens(heads_config, context)
        head = new_head(head_config(target.model.config, heads_config.output_vocab), config.seed).to(config.device)
        if heads_config.output_vocab:
            ids = frequent_tokens(
                train_stream,
                target.model.config.vocab_size,
                heads_config.output_vocab,
                always=tuple(target.eos_token_ids),
            )
            head.output_token_ids.copy_(ids)
            log(
                f"the head scores the {len(ids):,} most frequent tokens of the training text: they are "
                f"{frequent_share(train_stream, ids):.1%} of its tokens"
            )
        target_sha256 = weights_fingerprint(target_path) if target_path.is_dir() else None
        log(
            f"target {target.model.config.num_parameters / 1e6:.2f}M parameters, head "
            f"{head.num_parameters / 1e6:.2f}M; {len(train_stream):,} training tokens; ready in "
            f"{time.perf_counter() - started:.1f}s"
        )
        identity = run_identity(
            KIND,
            head.config,
            tokenizer,
            corpus,
            target=str(target_path.resolve()),
            target_sha256=target_sha256,
            heads=heads_config.identity(),
        )
        task = head_task(head, target.model, train_stream, held_out_stream, context, config, heads_config, identity)
        state = train_loop(task, config, output.staging / CHECKPOINT_DIR, checkpoint)
        settings = {
            "target": str(target_path),
            "target_sha256": target_sha256,
            "heads": dataclasses.asdict(heads_config),
            "context": context,
            "model": dataclasses.asdict(head.config),
            "head_parameters": head.num_parameters,
            **corpus_record(corpus),
        }

        def save(directory: Path) -> None:
            save_head(
                head,
                directory,
                SAVE_DTYPES[save_dtype],
                target=str(target_path.resolve()),
                extra={"target_sha256": target_sha256, "training": training_summary(state)},
            )

        return finish_run(output, KIND, config, settings, state, arguments, save, write_head_card)


def fit_context(context: int, target_context: int) -> int:
    """The window length: --context, at most the target's (the features at every position must be its own)."""
    if context > target_context:
        log(f"note: --context {context} is cut to the target's context, {target_context} tokens")
    return min(context, target_context)


def check_prompt_tokens(heads_config: HeadsConfig, context: int) -> None:
    """On-policy samples continue at most context - 1 corpus tokens (the target writes at least
    one): say so when --prompt-tokens leaves the target little or nothing of its own to write."""
    if heads_config.on_policy_fraction > 0 and heads_config.prompt_tokens >= context - 1:
        log(
            f"note: --prompt-tokens {heads_config.prompt_tokens} is not below the context ({context} tokens) less "
            f"one: on-policy samples continue the first {context - 1} corpus tokens of a window by one token the "
            f"target writes; give --prompt-tokens below {context - 1} for more of the target's own text"
        )


def new_head(config: ModelConfig, seed: int) -> EagleHead:
    """An EagleHead in float32 initialised as train.new_model initialises a model (fc's bias at 0)."""
    return initialise(EagleHead(config), config.num_layers, seed)


def head_task(
    head: EagleHead,
    target: LlamaModel,
    train_stream: torch.Tensor,
    held_out_stream: torch.Tensor,
    context: int,
    config: TrainConfig,
    heads_config: HeadsConfig,
    identity: dict,
) -> Task:
    """The head's Task for the shared loop: micro-batches of the target's text (or the corpus),
    the EAGLE loss with noisy features, the teacher-forced held-out evaluation."""
    device = torch.device(config.device)
    held_out = evaluation_windows(held_out_stream, context - 1, config.eval_tokens)  # [N, T]
    prompt_tokens = min(heads_config.prompt_tokens, context - 1)  # the target writes at least one token
    temperatures = heads_config.sample_temperatures

    def next_batch(generator: torch.Generator) -> MicroBatch:
        token_ids = sample_windows(train_stream, config.batch_size, context - 1, generator).to(device)  # [B, T]
        if float(torch.rand((), generator=generator)) < heads_config.on_policy_fraction:
            temperature = temperatures[int(torch.randint(len(temperatures), (), generator=generator))]
            prompt = token_ids[:, :prompt_tokens]  # [B, P]
            token_ids = sample_from_target(target, prompt, context, temperature, generator)  # [B, T]
        return MicroBatch(token_ids, int(torch.randint(2**62, (), generator=generator)))

    def loss(head: EagleHead, batch: MicroBatch) -> torch.Tensor:
        features = target_features(target, batch.token_ids)  # [B, T, H]
        read = add_noise(features[:, :-1], heads_config.feature_noise, batch.noise_seed)  # [B, T-1, H]: f_0..f_{T-2}
        predicted = predict_features(head, target, batch.token_ids, read)  # [B, T-1, H]: f^_1..f^_{T-1}
        return head_loss(predicted, features[:, 1:], target, heads_config, head)

    def evaluate(head: EagleHead) -> dict[str, float]:
        totals: dict[str, float] = {}
        for windows in held_out.split(config.batch_size):
            token_ids = windows.to(device)  # [b, T]
            features = target_features(target, token_ids)  # [b, T, H]
            predicted = predict_features(head, target, token_ids, features[:, :-1])  # [b, T-1, H]
            for name, value in held_out_metrics(predicted, features[:, 1:], target, head).items():
                totals[name] = totals.get(name, 0.0) + value * len(windows)
        return {name: total / len(held_out) for name, total in totals.items()}

    return Task(head, next_batch, loss, evaluate, config.batch_size * context, identity)


@torch.no_grad()
def target_features(target: LlamaModel, token_ids: torch.Tensor) -> torch.Tensor:
    """The frozen target's features f_t of token_ids [B, T] at positions 0..T-1: [B, T, H]."""
    return target.hidden_states(token_ids, training_positions(token_ids), None)


def add_noise(features: torch.Tensor, feature_noise: float, seed: int) -> torch.Tensor:
    """features [..., H] plus uniform noise U(-a, a), a = feature_noise × their root mean square,
    drawn on their device from `seed`."""
    if feature_noise == 0:
        return features
    generator = torch.Generator(features.device).manual_seed(seed)
    unit = torch.rand(features.shape, generator=generator, device=features.device) * 2 - 1  # [..., H], U(-1, 1)
    half_width = feature_noise * features.float().pow(2).mean().sqrt()  # a scalar
    return features + (unit * half_width).to(features.dtype)


def predict_features(
    head: EagleHead, target: LlamaModel, token_ids: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """The head's predictions f^_{t+1} for t = 0..T-2, from the embeddings of tokens 1..T-1 of
    token_ids [B, T] and the features f_0..f_{T-2} [B, T-1, H] at positions 0..T-2: [B, T-1, H]."""
    next_ids = token_ids[:, 1:]  # [B, T-1]: token t+1 beside feature t
    with torch.no_grad():
        token_embeddings = target.embed_tokens(next_ids)  # [B, T-1, H]
    return head(token_embeddings.to(head.dtype), features.to(head.dtype), training_positions(next_ids))


def head_loss(
    predicted: torch.Tensor,
    next_features: torch.Tensor,
    target: LlamaModel,
    heads_config: HeadsConfig,
    head: EagleHead | None = None,
) -> torch.Tensor:
    """feature_weight · smooth L1(f^, f) + token_weight · KL(p ‖ q), means over positions, for
    predicted and true next features [B, T-1, H]; p from the true features through the target's
    output layer, q from the predicted through the head's (the target's, or its rows of the
    tokens the head scores)."""
    loss = heads_config.feature_weight * feature_loss(predicted, next_features)
    if heads_config.token_weight == 0:
        return loss
    if head is not None and head.config.output_vocab_size:  # over the scored tokens: no [B, T-1, V] of the head's
        with torch.no_grad():
            target_logits = target.logits(next_features)  # [B, T-1, V]
        return loss + heads_config.token_weight * scored_divergence_loss(
            scored_head_scores(predicted, target, head), target_logits, head.output_token_ids, 1.0, "fkl"
        )
    head_logits, target_logits = both_logits(predicted, next_features, target)  # [B, T-1, V] each
    return loss + heads_config.token_weight * divergence_loss(head_logits, target_logits, 1.0, "fkl")


def feature_loss(predicted: torch.Tensor, next_features: torch.Tensor) -> torch.Tensor:
    """The mean smooth L1 (beta 1, EAGLE's) between predicted and true features [B, T-1, H], in float32."""
    return F.smooth_l1_loss(predicted.float(), next_features.float())


def both_logits(
    predicted: torch.Tensor, next_features: torch.Tensor, target: LlamaModel, head: EagleHead | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits over the predicted features (with gradients to them: the target's output
    layer, or for a head scoring part of the vocabulary its rows, -inf elsewhere) and the
    target's over the true ones (without): [B, T-1, V] each, float32."""
    with torch.no_grad():
        target_logits = target.logits(next_features)  # [B, T-1, V]
    if head is not None and head.config.output_vocab_size:
        return head.logits(scored_head_scores(predicted, target, head)), target_logits
    return target.logits(predicted.to(target.dtype)), target_logits


def scored_head_scores(predicted: torch.Tensor, target: LlamaModel, head: EagleHead) -> torch.Tensor:
    """A head over part of the vocabulary: its scores of the tokens it scores, [..., S] float32,
    for predicted features [..., H] (with gradients to them), through its rows of the target's
    output layer (EagleHead.output_layer, as drafting uses)."""
    output_layer = head.output_layer(target.lm_head)
    return output_layer(predicted.to(output_layer.weight.dtype)).float()


def held_out_metrics(
    predicted: torch.Tensor, next_features: torch.Tensor, target: LlamaModel, head: EagleHead | None = None
) -> dict[str, float]:
    """Greedy agreement, α = 1 − TV and TV at temperature 1 (distill.acceptance_metrics), and the
    feature loss, means over positions; features [B, T-1, H]."""
    head_logits, target_logits = both_logits(predicted, next_features, target, head)  # [B, T-1, V] each
    acceptance = acceptance_metrics(head_logits, target_logits, 1.0)
    return {
        "held_out_greedy_agreement": acceptance["held_out_greedy_agreement"],
        "held_out_alpha": acceptance["held_out_alpha"],
        "held_out_tv": acceptance["held_out_tv"],
        "held_out_feature_loss": float(feature_loss(predicted, next_features)),
    }


def training_summary(state: RunState) -> dict:
    """What head.json keeps of the training: steps, tokens, time, the first and last held-out evaluations."""
    return {
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "seconds": round(state.seconds, 1),
        "first_evaluation": state.evaluations[0],
        "last_evaluation": state.evaluations[-1],
    }


def _plain(value):
    """value as JSON reads it back (tuples as lists): a run identity compares equal after a checkpoint's round trip."""
    return json.loads(json.dumps(value))


def write_head_card(directory: Path, record: dict, name: str) -> None:
    """README.md beside a finished head, for train.write_log (model_card.py's card reads a
    model's config.json, which a head directory does not hold)."""
    head = json.loads((directory / HEAD_CONFIG).read_text())
    (directory / "README.md").write_text(head_card(name, record, head, (directory / HEAD_WEIGHTS).stat().st_size))


def head_card(name: str, log: dict, head: dict, weight_bytes: int) -> str:
    """The head's model card (Markdown): what it is, how to use it, how it was made, how it did."""
    model, train, heads = head["model"], log["train_config"], log["heads"]
    millions = log["head_parameters"] / 1e6
    arguments = log.get("arguments") or {}
    stdlib = log["corpus"].startswith(str(stdlib_path()))
    head_path = arguments.get("out", name)
    target_weights = (
        f" (weights sha256 `{log['target_sha256']}`, over its safetensors files)" if log.get("target_sha256") else ""
    )
    lines = [
        f"# {name}",
        "",
        f"An EAGLE draft head (Li et al. 2024) for the target `{log['target']}`, trained by "
        "`specdec train-heads`: one decoder layer of the target's own kind that predicts the target's next "
        "feature (its final hidden state) from the current one and the next token. It borrows the target's "
        "embedding and output layer, so it drafts for that target only.",
        "",
        "| | |",
        "|---|---|",
        f"| head | fc {2 * model['hidden_size']} → {model['hidden_size']}, 1 decoder layer "
        f"({model['num_heads']} heads, {model['num_kv_heads']} key/value heads, MLP "
        f"{model['intermediate_size']}), a norm; {millions:.2f}M parameters |",
        f"| weights | {head.get('torch_dtype', '?')} safetensors, {weight_bytes / 1e6:.2f} MB |",
        f"| target | `{log['target']}`{target_weights} |",
        f"| corpus | {log['corpus']} |",
        f"| held out | {some_names(log.get('held_out') or [])} (never trained on) |",
        f"| data | windows of {log['context']} tokens; {_data_line(heads)} |",
        f"| loss | {heads['feature_weight']:g} · smooth L1 on the next feature + {heads['token_weight']:g} · "
        f"KL(p ‖ q) on the token after it; feature noise ±{heads['feature_noise']:g} × their root mean "
        "square |",
        f"| training | {log['step']:,} steps of {train['batch_size'] * train['grad_accum']} windows; "
        f"{log['tokens_seen']:,} tokens; AdamW lr {train['lr']:g} (warm-up {train['warmup']}, cosine to "
        f"{train['lr'] * train['min_lr_ratio']:g}), weight decay {train['weight_decay']:g}, "
        f"{'bfloat16 autocast' if train['bf16'] else 'float32'}, seed {train['seed']} |",
        f"| time and hardware | {log['seconds'] / 60:.1f} min on {_hardware(log)} |",
        f"| held-out evaluation | {_evaluation_line(log['evaluations'])} |",
        "",
        "## Use",
        "",
        "```",
        f"specdec generate --model {log['target']} --draft {head_path} --prompt 'def f(x):'",
        "```",
        "",
        f'or `LLM(target, speculative_model="{head_path}", speculative_method="eagle")`: the output is the '
        "target's own, the head only proposes.",
        "",
        "## Made by",
        "",
        "```",
        command_line(KIND, arguments, positional=("target",)),
        "```",
        "",
        "Runs are deterministic up to floating-point reduction order: the same command with the same seed on "
        "the same machine and library versions gives the same head.",
        "",
    ]
    if stdlib:
        lines += ["The corpus is Python's standard library, under the Python Software Foundation License.", ""]
    return "\n".join(lines)


def _data_line(heads: dict) -> str:
    fraction = heads["on_policy_fraction"]
    if fraction == 0:
        return "corpus windows"
    temperatures = " or ".join("greedy" if t == 0 else f"temperature {t:g}" for t in heads["sample_temperatures"])
    own = (
        f"the target's own continuation of {heads['prompt_tokens']} corpus tokens ({temperatures}, one chosen "
        "at random per micro-batch)"
    )
    return own if fraction == 1 else f"a fraction {fraction:g} {own}, the rest corpus windows"


def _evaluation_line(evaluations: list[dict]) -> str:
    first, last = evaluations[0], evaluations[-1]
    parts = [
        f"{label} {first[key]:.3f} → {last[key]:.3f}"
        for key, label in (
            ("held_out_greedy_agreement", "greedy agreement"),
            ("held_out_alpha", "α = 1 − TV"),
            ("held_out_feature_loss", "feature loss"),
        )
        if key in last
    ]
    return "; ".join(parts) + f" (step {first['step']} → step {last['step']}; teacher-forced, the first draft token)"


def _hardware(log: dict) -> str:
    device = log.get("device", "cpu")
    return device if device != "cpu" else f"{log.get('cpu') or cpu_model()}, {log.get('torch_threads', '?')} threads"


def agreement_summary(result: TrainResult) -> str:
    """The held-out greedy agreement and α before and after (as distill.alpha_summary)."""
    first, last = result.first_evaluation, result.last_evaluation
    return (
        f"held-out greedy agreement {first['held_out_greedy_agreement']:.3f} -> "
        f"{last['held_out_greedy_agreement']:.3f}; α (1 − TV) {first['held_out_alpha']:.3f} -> "
        f"{last['held_out_alpha']:.3f}; feature loss {first['held_out_feature_loss']:.4f} -> "
        f"{last['held_out_feature_loss']:.4f}"
    )


RESTRICTED_ENTRIES = (HEAD_CONFIG, HEAD_WEIGHTS, "README.md")


def restrict_head(
    head_path: str | Path,
    target_path: str | Path,
    out: str | Path,
    output_vocab: int,
    corpus_path: str | Path | None = None,
    force: bool = False,
) -> dict:
    """FR-Spec without training (Zhao et al. 2025): the head in head_path, its output layer cut to
    the output_vocab tokens most frequent in the corpus the target's text is read from (the
    end-of-text tokens among them), written to out. The head's own weights are unchanged: it
    predicts the same features, and only the tokens it may draft shrink, to those rows of the
    target's output layer (a cheaper drafting step; the drafts it loses are of rare tokens).
    Returns what it measured: the share of the corpus's training and held-out tokens kept."""
    check(is_int(output_vocab) and output_vocab >= 1, f"--output-vocab must be an integer >= 1, got {output_vocab!r}")
    head_path, target_path = Path(head_path), Path(target_path)
    inputs = {"HEAD": head_path, "--target": target_path, "--corpus": corpus_path}
    with open_output_dir(
        out, "restrict-head", inputs, force, is_head_directory, RESTRICTED_ENTRIES, resumable=False
    ) as output:
        output.clear_staging()
        target = load_pretrained(target_path, "float32", what="the target")
        head = load_head(head_path, target.model.config, torch.float32)
        if head.config.output_vocab_size:
            raise ValueError(
                f"the head {head_path} already scores only {head.config.output_vocab_size:,} tokens; "
                "restrict the head it was made from"
            )
        vocab_size = target.model.config.vocab_size
        check(
            output_vocab < vocab_size,
            f"--output-vocab {output_vocab} is not below the vocabulary size ({vocab_size:,}): nothing to cut",
        )
        _, train_stream, held_out_stream = target_streams(target, corpus_path)
        ids = frequent_tokens(train_stream, vocab_size, output_vocab, always=tuple(target.eos_token_ids))
        restricted = EagleHead(
            head_config(target.model.config, output_vocab, head.config.intermediate_size), head.feature_layers
        )
        restricted.load_state_dict({**head.state_dict(), "output_token_ids": ids})
        shares = {
            "training_tokens_kept": round(frequent_share(train_stream, ids), 4),
            "held_out_tokens_kept": round(frequent_share(held_out_stream, ids), 4),
        }
        saved = json.loads((head_path / HEAD_CONFIG).read_text())
        extra = {
            key: value
            for key, value in saved.items()
            if key not in ("format", "version", "model", "torch_dtype", "target")
        }
        extra["restricted"] = {"from": str(head_path), "output_vocab": output_vocab, **shares}
        save_head(
            restricted,
            output.staging,
            getattr(torch, saved.get("torch_dtype", "bfloat16")),
            target=saved.get("target"),
            extra=extra,
        )
        card = (head_path / "README.md").read_text() if (head_path / "README.md").is_file() else ""
        (output.staging / "README.md").write_text(
            card + _restricted_card(head_path, target_path, output_vocab, corpus_path, shares)
        )
        output.commit()
    return shares


def _restricted_card(head_path: Path, target_path: Path, output_vocab: int, corpus_path, shares: dict) -> str:
    corpus = f" --corpus {corpus_path}" if corpus_path is not None else ""
    return (
        f"\n## Output layer cut to {output_vocab:,} tokens\n\n"
        f"This copy of `{head_path}` scores only the {output_vocab:,} tokens most frequent in the training "
        f"text (FR-Spec, no training: the head's weights are the same): "
        f"{shares['training_tokens_kept']:.1%} of the training tokens and {shares['held_out_tokens_kept']:.1%} of "
        f"the held-out ones. Made by\n\n```\nspecdec restrict-head {head_path} --target {target_path} "
        f"--output-vocab {output_vocab}{corpus} --out OUT\n```\n"
    )
