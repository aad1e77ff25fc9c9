"""`specdec distill`: train a draft to match its target's next-token distributions.

Terms (docs/architecture.md): target_probs (p) is the target's distribution at a position, draft_probs
(q) the draft's, both at the same temperature. A draft token is accepted with probability
min(1, p/q), so the expected acceptance rate at a position is

    α = Σ_v min(p_v, q_v) = 1 − TV(p, q),    TV(p, q) = ½ Σ_v |p_v − q_v|.

The loss. Maximising α is minimising TV, so TV is optimised directly; but TV alone steers
poorly. Its gradient with respect to the draft's logit z_v is q_v·(g_v − Σ_u q_u g_u) with
g = ½ sign(q − p): proportional to the draft's own probability q_v, so a token the draft
gives little mass gets little push however much the target wants it, and it says only "up"
or "down", not how far. Forward KL(p ‖ q), the cross-entropy against the target's soft
labels, has the gradient q_v − p_v, which pulls every token the target likes by its full
p_v, and it bounds TV (Pinsker: TV ≤ sqrt(KL / 2)). The default loss is their sum,
forward KL + TV: KL does the steering, TV keeps the acceptance rate itself in the objective.
The sum measured best on held-out text (docs/training.md, "Distill a draft"); DistillSpec
(Zhou et al. 2023) likewise found TV and forward KL the safe choices. "tv" and "fkl" alone are
options.

Data: random windows of the corpus (the target's training corpus by default), and, with
on_policy_fraction F > 0, a fraction F of micro-batches is on-policy: text the target itself
samples continuing the first `prompt_tokens` of a corpus window, which is the text the draft
meets when speculating. It is sampled at the distillation temperature unless
`sample_temperature` says otherwise; 0 means the target's greedy text, the text greedy
speculative decoding verifies (a small target's greedy text repeats itself, unlike its corpus).

The draft shares the target's tokenizer (its files are copied) and vocabulary size. It is
reported by held-out α (mean over positions of 1 − TV) and greedy agreement (the fraction
of positions where the draft's most likely token is the target's: greedy decoding's α),
before distillation (the initial draft: random init, or --init) and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import check, is_int, is_real
from specdec.models.checkpoint import SHARD_BYTES, save_pretrained
from specdec.models.llama import LlamaModel
from specdec.models.loader import LoadedModel, load_pretrained
from specdec.tools.training.corpus import (
    check_stream_length,
    evaluation_windows,
    load_corpus,
    sample_windows,
    token_stream,
)
from specdec.tools.training.loop import Task, TrainConfig, log, train_loop
from specdec.tools.training.train import (
    CHECKPOINT_DIR,
    SAVE_DTYPES,
    ModelShape,
    TrainResult,
    check_save_dtype,
    corpus_record,
    finish_run,
    load_initial_model,
    new_model,
    open_run_output,
    read_training_log,
    resume_checkpoint,
    run_identity,
    training_positions,
)

DIVERGENCES = ("fkl+tv", "tv", "fkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class DistillConfig:
    """What the draft is taught (see the module docstring).

    temperature: both distributions are softened by it before comparing (> 0).
    on_policy_fraction: the fraction of micro-batches sampled from the target, in [0, 1].
    sample_temperature: the temperature on-policy text is sampled at (>= 0; 0 is greedy);
        None: `temperature`.
    prompt_tokens: corpus tokens an on-policy sample continues from.
    divergence: "fkl+tv" (default), "tv" or "fkl".
    target_dtype: the target's weights: "auto" (as saved), "float32" or "bfloat16".
    embeddings_from_target: a new draft's embedding starts as the target's, projected onto its
        top principal directions (project_embeddings), instead of random: with a large
        vocabulary the embedding is most of a small draft, and this one already places
        tokens as the target does.
    output_vocab: > 0: a new draft's output layer scores only the output_vocab tokens most
        frequent in the training text (and the end-of-text token), FR-Spec style (Zhao et al.
        2025): with a large vocabulary the output layer is most of a small draft's cost per
        step, and most of its rows score tokens the text never uses. The others get
        probability 0, so the draft never proposes them; the target, which verifies, still
        can emit them, so speculation stays exact. 0: the whole vocabulary.
    """

    temperature: float = 1.0
    on_policy_fraction: float = 0.0
    sample_temperature: float | None = None
    prompt_tokens: int = 32
    divergence: str = "fkl+tv"
    target_dtype: str = "auto"
    embeddings_from_target: bool = False
    output_vocab: int = 0

    def __post_init__(self) -> None:
        check(
            is_real(self.temperature) and self.temperature > 0,
            f"temperature must be a number > 0, got {self.temperature!r}",
        )
        check(
            is_real(self.on_policy_fraction) and 0 <= self.on_policy_fraction <= 1,
            f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction!r}",
        )
        check(
            self.sample_temperature is None or (is_real(self.sample_temperature) and self.sample_temperature >= 0),
            f"sample_temperature must be a number >= 0 (0 is greedy), got {self.sample_temperature!r}",
        )
        check(
            is_int(self.prompt_tokens) and self.prompt_tokens >= 1,
            f"prompt_tokens must be an integer >= 1, got {self.prompt_tokens!r}",
        )
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {self.divergence!r}")
        check(
            is_int(self.output_vocab) and self.output_vocab >= 0,
            f"output_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.output_vocab!r}",
        )
        check(
            isinstance(self.embeddings_from_target, bool),
            f"embeddings_from_target must be True or False, got {self.embeddings_from_target!r}",
        )
        if self.target_dtype not in ("auto", *SAVE_DTYPES):
            raise ValueError(f"target_dtype must be auto, float32 or bfloat16, got {self.target_dtype!r}")


def distill(
    target_dir: str | Path,
    out: str | Path,
    shape: ModelShape | None,
    config: TrainConfig,
    distill_config: DistillConfig = DistillConfig(),
    corpus_path: str | Path | None = None,
    init_dir: str | Path | None = None,
    save_dtype: str = "bfloat16",
    max_shard_bytes: int = SHARD_BYTES,
    restart: bool = False,
    require_checkpoint: bool = False,
    arguments: dict | None = None,
    force: bool = False,
) -> TrainResult:
    """Distill a draft of `shape` (or the trained draft in init_dir) from the target into `out`
    (see output_dir.py: out must not be an input, nor a directory of other files unless force)."""
    target_dir, started = Path(target_dir), time.perf_counter()
    check_save_dtype(save_dtype)
    inputs = {"--target": target_dir, "--init": init_dir, "--corpus": corpus_path}
    with open_run_output(out, "distill", inputs, force) as output:
        target = load_pretrained(target_dir, distill_config.target_dtype, config.device)
        if target.tokenizer is None or not target.eos_token_ids:
            raise ValueError(f"the target {target_dir} needs a tokenizer.json and an eos_token_id to distill from")
        checkpoint = resume_checkpoint(output, restart, require_checkpoint)
        corpus, train_stream, held_out_stream = target_streams(target, corpus_path)
        tokenizer, eot_id = target.tokenizer.backend, target.eos_token_ids[0]
        output_ids = None
        if distill_config.output_vocab and init_dir is None:
            output_ids = frequent_tokens(
                train_stream, target.model.config.vocab_size, distill_config.output_vocab, always=target.eos_token_ids
            )
            log(
                f"output layer over the {len(output_ids):,} most frequent tokens of the training text: they are "
                f"{frequent_share(train_stream, output_ids):.1%} of its tokens"
            )
        draft = initial_draft(target, shape, init_dir, config.seed, output_ids).to(config.device)
        if distill_config.embeddings_from_target and init_dir is None:
            project_embeddings(target.model, draft)
        context = min(draft.config.max_position_embeddings, target.model.config.max_position_embeddings)
        check_stream_length(train_stream, context, "training", config.batch_size)
        check_prompt_tokens(distill_config, context)
        log(
            f"target {target.model.config.num_parameters / 1e6:.2f}M parameters, draft "
            f"{draft.config.num_parameters / 1e6:.2f}M; {len(train_stream):,} training tokens; ready in "
            f"{time.perf_counter() - started:.1f}s"
        )
        identity = run_identity(
            "distill",
            draft.config,
            tokenizer,
            corpus,
            target=str(target_dir.resolve()),
            distill=dataclasses.asdict(distill_config),
            init=str(init_dir),
        )
        task = distillation_task(
            draft, target.model, train_stream, held_out_stream, context, config, distill_config, identity
        )
        state = train_loop(task, config, output.staging / CHECKPOINT_DIR, checkpoint)
        settings = {
            "target": str(target_dir),
            "target_sha256": weights_fingerprint(target_dir),
            "init": str(init_dir),
            "init_log": read_training_log(init_dir),
            "distill": dataclasses.asdict(distill_config),
            "model": dataclasses.asdict(draft.config),
            **corpus_record(corpus),
        }

        def save_model(directory: Path) -> None:
            save_pretrained(
                draft, directory, SAVE_DTYPES[save_dtype], max_shard_bytes=max_shard_bytes, eos_token_id=eot_id
            )
            copy_tokenizer(target, directory)

        return finish_run(output, "distill", config, settings, state, arguments, save_model)


def target_streams(target: LoadedModel, corpus_path) -> tuple:
    """The corpus at corpus_path (logged), and its training and held-out text as the target's
    token ids, documents joined by its end-of-text token: (corpus, train_stream, held_out_stream)."""
    corpus = load_corpus(corpus_path)
    log(corpus.describe())
    assert target.tokenizer is not None  # loaded with its tokenizer: the corpus is text
    tokenizer, eot_id = target.tokenizer.backend, target.eos_token_ids[0]
    return (corpus, *(token_stream(docs, tokenizer, eot_id) for docs in (corpus.train, corpus.held_out)))


def check_prompt_tokens(distill_config: DistillConfig, context: int) -> None:
    """On-policy samples continue --prompt-tokens corpus tokens up to the context: say so when
    the context leaves them fewer than asked for."""
    if distill_config.on_policy_fraction > 0 and distill_config.prompt_tokens >= context:
        log(
            f"note: --prompt-tokens {distill_config.prompt_tokens} is not below the context ({context} tokens): "
            f"on-policy samples continue the first {context} corpus tokens of a window by one sampled token; "
            f"give --prompt-tokens below {context} for more of the target's own text"
        )


def weights_fingerprint(model_dir: Path) -> str:
    """The first 16 hex digits of the SHA-256 of a model directory's safetensors files, in
    name order: which weights a draft was distilled from, kept in its training log."""
    digest = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def initial_draft(
    target: LoadedModel, shape: ModelShape | None, init_dir, seed: int, output_token_ids: torch.Tensor | None = None
) -> LlamaModel:
    """A random-init draft of `shape` with the target's vocabulary size (its output layer over
    output_token_ids only, if given), or the draft in init_dir."""
    target_vocab, target_context = target.model.config.vocab_size, target.model.config.max_position_embeddings
    if init_dir is None:
        assert shape is not None  # given where there is no init_dir
        if shape.context > target_context:
            log(
                f"note: the draft's context is cut from {shape.context} to the target's, {target_context} tokens "
                "(distillation needs the target's distribution at every position)"
            )
        shape = dataclasses.replace(shape, vocab_size=target_vocab, context=min(shape.context, target_context))
        config = shape.model_config()
        if output_token_ids is not None:
            config = dataclasses.replace(config, output_vocab_size=len(output_token_ids), tie_word_embeddings=False)
        draft = new_model(config, seed)
        if output_token_ids is not None:
            draft.output_token_ids.copy_(output_token_ids)
        return draft
    from specdec.drafters.draft_model import check_same_vocabulary

    loaded = load_initial_model(init_dir, load_tokenizer=True)
    check_same_vocabulary(target, loaded)
    if loaded.model.config.vocab_size != target_vocab:
        raise ValueError(
            f"--init {init_dir} has vocab_size {loaded.model.config.vocab_size}, the target "
            f"{target_vocab}; distillation compares distributions over the same vocabulary"
        )
    return loaded.model


def frequent_tokens(stream: torch.Tensor, vocab_size: int, count: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `count` ids most frequent in stream [N] (ties: the lower id first), with the ids in
    `always` among them, ascending: [count] int64."""
    if count > vocab_size:
        raise ValueError(f"--output-vocab {count} is larger than the vocabulary ({vocab_size} tokens)")
    counts = torch.bincount(stream.long(), minlength=vocab_size).double()  # [V]
    counts[list(always)] = float("inf")
    order = torch.argsort(-counts, stable=True)  # most frequent first, lower ids first among equals
    return order[:count].sort().values


def frequent_share(stream: torch.Tensor, token_ids: torch.Tensor) -> float:
    """The fraction of stream's tokens that are among token_ids."""
    return float(torch.isin(stream.long(), token_ids).double().mean())


@torch.no_grad()
def project_embeddings(target: LlamaModel, draft: LlamaModel) -> None:
    """Set the draft's embedding (and a tied output layer with it) to the target's embedding
    E [V, H] projected onto its top h principal directions, h the draft's hidden size:
    E·W, W [H, h] the leading right singular vectors of E, scaled to the draft's initial
    standard deviation. An untied output layer starts from the same rows (those of its
    output_token_ids, if it scores part of the vocabulary)."""
    target_embedding = target.embed_tokens.weight.float()  # [V, H]
    hidden = draft.config.hidden_size
    if hidden > target_embedding.shape[1]:
        raise ValueError(
            f"--embeddings-from-target projects the target's {target_embedding.shape[1]}-wide embedding "
            f"down; the draft's hidden size {hidden} is wider"
        )
    _, _, right = torch.linalg.svd(target_embedding, full_matrices=False)  # right [H, H], rows = directions
    projected = target_embedding @ right[:hidden].T  # [V, H] @ [H, h] -> [V, h]
    draft_embedding = draft.embed_tokens.weight
    draft_embedding.copy_(projected * (draft_embedding.std() / projected.std()))
    if not draft.config.tie_word_embeddings:
        rows = draft.output_token_ids if draft.config.output_vocab_size else slice(None)
        draft.lm_head.weight.copy_(draft_embedding[rows])


def distillation_task(
    draft: LlamaModel,
    target: LlamaModel,
    train_stream: torch.Tensor,
    held_out_stream: torch.Tensor,
    context: int,
    config: TrainConfig,
    distill_config: DistillConfig,
    identity: dict,
) -> Task:
    device, temperature = torch.device(config.device), distill_config.temperature
    sample_temperature = temperature if distill_config.sample_temperature is None else distill_config.sample_temperature
    held_out = evaluation_windows(held_out_stream, context, config.eval_tokens)

    def next_batch(generator: torch.Generator) -> torch.Tensor:
        windows = sample_windows(train_stream, config.batch_size, context, generator)  # [B, T+1]
        on_policy = float(torch.rand((), generator=generator)) < distill_config.on_policy_fraction
        if on_policy:
            prompt = windows[:, : min(distill_config.prompt_tokens, context)].to(device)  # [B, P]
            return sample_from_target(target, prompt, context + 1, sample_temperature, generator)
        return windows.to(device)

    def loss(draft: LlamaModel, windows: torch.Tensor) -> torch.Tensor:
        if draft.config.output_vocab_size:  # the same loss over the scored tokens only: a sixth of the memory
            draft_scores, target_logits = both_logits(draft, target, windows[:, :-1], scored_only=True)
            return scored_divergence_loss(
                draft_scores, target_logits, draft.output_token_ids, temperature, distill_config.divergence
            )
        draft_logits, target_logits = both_logits(draft, target, windows[:, :-1])
        return divergence_loss(draft_logits, target_logits, temperature, distill_config.divergence)

    def evaluate(draft: LlamaModel) -> dict[str, float]:
        totals = {"held_out_alpha": 0.0, "held_out_greedy_agreement": 0.0, "held_out_tv": 0.0}
        for batch in held_out.split(config.batch_size):
            draft_logits, target_logits = both_logits(draft, target, batch[:, :-1].to(device))
            for name, value in acceptance_metrics(draft_logits, target_logits, temperature).items():
                totals[name] += value * len(batch)
        return {name: total / len(held_out) for name, total in totals.items()}

    return Task(draft, next_batch, loss, evaluate, config.batch_size * context, identity)


def both_logits(
    draft: LlamaModel, target: LlamaModel, inputs: torch.Tensor, scored_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's logits (with gradients) and the frozen target's, [B, T, V] each, float32.
    scored_only: the draft's logits over the tokens its output layer scores only, [B, T, S]."""
    positions = training_positions(inputs)
    with torch.no_grad():
        target_logits = target(inputs, positions, None)
    if scored_only:
        return draft.lm_head(draft.hidden_states(inputs, positions, None)).float(), target_logits
    return draft(inputs, positions, None), target_logits


def divergence_loss(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float, divergence: str
) -> torch.Tensor:
    """Mean over positions of the chosen divergence between the target's and the draft's
    distributions at `temperature`; logits [B, T, V]."""
    target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, T, V]
    draft_log_probs = torch.log_softmax(draft_logits.float() / temperature, dim=-1)  # [B, T, V]
    loss = torch.zeros((), device=draft_logits.device)
    if "tv" in divergence.split("+"):
        loss = loss + total_variation(target_probs, draft_log_probs.exp()).mean()
    if "fkl" in divergence.split("+"):
        # KL(p || q) over the tokens the draft scores: all of them, but for an output layer over part
        # of the vocabulary q = 0 elsewhere, where the draft can do nothing about p
        target_entropy_term = torch.special.xlogy(target_probs, target_probs)  # p log p, 0 where p = 0
        scored = draft_log_probs.isfinite()  # [B, T, V]
        kl_terms = torch.where(scored, target_entropy_term - target_probs * draft_log_probs.clamp(min=-1e30), 0.0)
        loss = loss + kl_terms.sum(-1).mean()
    return loss


def scored_divergence_loss(
    draft_scores: torch.Tensor,
    target_logits: torch.Tensor,
    scored_ids: torch.Tensor,
    temperature: float,
    divergence: str,
) -> torch.Tensor:
    """divergence_loss for a draft whose output layer scores only scored_ids [S]: the same
    value, computed over those S tokens (draft_scores [B, T, S]) and the target's mass outside
    them, without [B, T, V] tensors beyond the target's logits. There q = 0: TV adds half the
    target's mass outside, and the KL counts the scored tokens only (as divergence_loss does)."""
    target_scaled = target_logits.float() / temperature  # [B, T, V]
    log_normalizer = torch.logsumexp(target_scaled, dim=-1, keepdim=True)  # [B, T, 1]
    target_probs = torch.exp(target_scaled.index_select(-1, scored_ids) - log_normalizer)  # [B, T, S]
    draft_log_probs = torch.log_softmax(draft_scores.float() / temperature, dim=-1)  # [B, T, S]
    loss = torch.zeros((), device=draft_scores.device)
    if "tv" in divergence.split("+"):
        outside = (1 - target_probs.sum(-1)).clamp(min=0)  # [B, T]
        loss = loss + (0.5 * ((target_probs - draft_log_probs.exp()).abs().sum(-1) + outside)).mean()
    if "fkl" in divergence.split("+"):
        kl_terms = torch.special.xlogy(target_probs, target_probs) - target_probs * draft_log_probs  # [B, T, S]
        loss = loss + kl_terms.sum(-1).mean()
    return loss


def total_variation(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = ½ Σ_v |p_v − q_v| at each position: [..., V] -> [...]."""
    return 0.5 * (target_probs - draft_probs).abs().sum(-1)


def acceptance_metrics(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> dict[str, float]:
    """Mean over positions of α = 1 − TV(p, q), of TV, and of greedy agreement (argmax q = argmax p)."""
    target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, T, V]
    draft_probs = torch.softmax(draft_logits.float() / temperature, dim=-1)  # [B, T, V]
    tv = total_variation(target_probs, draft_probs)  # [B, T]
    agreement = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()  # [B, T]
    return {
        "held_out_alpha": float(1 - tv.mean()),
        "held_out_greedy_agreement": float(agreement.mean()),
        "held_out_tv": float(tv.mean()),
    }


@torch.no_grad()
def sample_from_target(
    target: LlamaModel, prompt: torch.Tensor, length: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """Continue prompt [B, P] by sampling from the target at `temperature` (0: its most likely
    token) up to `length` tokens: [B, length]. Draws use `generator` (on the CPU), so a resumed
    run samples the same text."""
    B, P = prompt.shape
    device = prompt.device
    cache = target.new_cache(B, length)
    logits = target(prompt, torch.arange(P, device=device).expand(B, P), cache)[:, -1]  # [B, V]
    tokens = [prompt]
    for position in range(P, length):
        next_token = next_tokens(logits, temperature, generator).to(device)  # [B, 1]
        tokens.append(next_token)
        if position + 1 < length:
            logits = target(next_token, torch.full((B, 1), position, device=device), cache)[:, -1]
    return torch.cat(tokens, dim=1)  # [B, length]


def next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of logits [B, V], drawn at `temperature` or, at 0, the most likely: [B, 1] on the CPU."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True).cpu()  # [B, 1]
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()  # [B, V]
    return torch.multinomial(probs, 1, generator=generator)  # [B, 1]


def copy_tokenizer(target: LoadedModel, out: Path) -> None:
    """The draft gets the target's tokenizer files, byte for byte."""
    for name in TOKENIZER_FILES:
        if (target.path / name).is_file():
            shutil.copyfile(target.path / name, out / name)


def alpha_summary(result: TrainResult) -> str:
    first, last = result.first_evaluation, result.last_evaluation
    return (
        f"held-out α (1 − TV) {first['held_out_alpha']:.3f} -> {last['held_out_alpha']:.3f}; "
        f"greedy agreement {first['held_out_greedy_agreement']:.3f} -> {last['held_out_greedy_agreement']:.3f}"
    )
