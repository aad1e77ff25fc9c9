"""`specdec train`: a byte-level BPE tokenizer and a Llama-architecture model, from a corpus.

The recipe: train the tokenizer on the corpus's training documents (or reuse one, so that a
draft shares its target's), tokenize them into one stream, and train a LlamaModel to predict
the next token of random windows of it (cross-entropy), with the shared loop of loop.py.
The result is a Hugging Face directory (save_pretrained: config.json naming LlamaForCausalLM,
safetensors shards with their index, tokenizer files, generation_config.json) plus
training_log.json (settings, evaluations, summary).

Weights start as in GPT-2 / Hugging Face Llama: normal(0, 0.02) matrices and embeddings, the
projections that write into the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * layers)
so the stream's variance does not grow with depth; norms at 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from specdec.models.checkpoint import SHARD_BYTES, save_pretrained
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.tokenizer import train_byte_level_bpe
from specdec.output_dir import OutputDir, open_output_dir, staging_path
from specdec.platform import cpu_model
from specdec.tools.training.corpus import (
    END_OF_TEXT,
    Corpus,
    check_stream_length,
    evaluation_windows,
    load_corpus,
    sample_windows,
    token_stream,
)
from specdec.tools.training.loop import CHECKPOINT_FILE, RunState, Task, TrainConfig, log, read_checkpoint, train_loop
from specdec.tools.training.model_card import write_model_card

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelShape:
    """The size of a model to train. context: the window length T trained on (and the
    model's max_position_embeddings). head_dim = hidden_size / num_heads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    context: int
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "context",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.vocab_size < 258:
            raise ValueError(
                f"vocab_size must be >= 258 (256 bytes, the end-of-text token and a merge), got {self.vocab_size}"
            )
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) times "
                "an even head size (rotary embeddings rotate pairs)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.context < 2:
            raise ValueError(f"context must be >= 2, got {self.context}")

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.context,
            rms_norm_eps=1e-5,
            tie_word_embeddings=self.tie_word_embeddings,
        )


PRESETS = {
    # ~22.0M parameters (3.1M of them the tied embedding). Deep and narrow, like the large
    # models speculative decoding is for: decoding cost grows with depth, not only with bytes.
    "target": ModelShape(
        vocab_size=8192,
        hidden_size=384,
        num_layers=12,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=1024,
        context=512,
    ),
    # ~1.9M parameters, 11x fewer than "target", same vocabulary
    "draft": ModelShape(
        vocab_size=8192, hidden_size=160, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=448, context=512
    ),
    # ~0.25M parameters: for tests
    "tiny": ModelShape(
        vocab_size=512, hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, context=128
    ),
}


def model_shape(preset: str | None, **sizes) -> ModelShape:
    """A preset with some sizes replaced (None values ignored); without a preset, all sizes."""
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if preset is None:
        missing = [
            f.name for f in dataclasses.fields(ModelShape) if f.name not in sizes and f.default is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"give a --preset ({', '.join(PRESETS)}) or every size: missing {', '.join(missing)}")
        return ModelShape(**sizes)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **sizes)


@dataclass(frozen=True)
class TrainResult:
    """The summary of a run. out: the model directory (None if the session stopped early)."""

    out: Path | None
    state: RunState
    steps: int

    @property
    def finished(self) -> bool:
        """Run to its last step, or to its time budget (TrainConfig.max_seconds)."""
        return self.state.step >= self.steps or self.state.out_of_time

    @property
    def train_loss(self) -> float:
        """Mean train loss over the last 5% of steps (at least 1, at most 50)."""
        recent = self.state.losses[-max(1, min(50, len(self.state.losses) // 20)) :]
        return sum(recent) / len(recent) if recent else float("nan")

    @property
    def first_evaluation(self) -> dict:
        return self.state.evaluations[0]

    @property
    def last_evaluation(self) -> dict:
        return self.state.evaluations[-1]


def train(
    out: str | Path,
    shape: ModelShape | None,
    config: TrainConfig,
    corpus_path: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    save_dtype: str = "bfloat16",
    max_shard_bytes: int = SHARD_BYTES,
    restart: bool = False,
    require_checkpoint: bool = False,
    arguments: dict | None = None,
    init_dir: str | Path | None = None,
    force: bool = False,
) -> TrainResult:
    """Train (or resume training) a model on the corpus and write it to `out` (see
    output_dir.py: out must not be an input, nor a directory of other files unless force).
    init_dir: go on training the model there (its weights, size and tokenizer; shape and
    tokenizer_dir must be None) instead of a new one."""
    started = time.perf_counter()
    check_save_dtype(save_dtype)
    if init_dir is not None and (shape is not None or tokenizer_dir is not None):
        raise ValueError(
            "--init takes the model's size and tokenizer from its directory; drop the size flags and --tokenizer"
        )
    inputs = {"--init": init_dir, "--tokenizer": tokenizer_dir, "--corpus": corpus_path}
    with open_run_output(out, "train", inputs, force) as output:
        checkpoint = resume_checkpoint(output, restart, require_checkpoint)
        corpus = load_corpus(corpus_path)
        log(corpus.describe())
        initial = load_initial_model(init_dir).model if init_dir is not None else None
        if initial is not None:
            shape, tokenizer_dir = shape_of(initial.config), init_dir
        assert shape is not None  # given, or the initial model's
        tokenizer, eot_id = prepare_tokenizer(corpus, shape, tokenizer_dir, checkpoint)
        shape = _fit_vocabulary(shape, tokenizer, tokenizer_dir)
        train_stream, held_out_stream = (
            token_stream(docs, tokenizer, eot_id) for docs in (corpus.train, corpus.held_out)
        )
        check_stream_length(train_stream, shape.context, "training", config.batch_size)
        log(
            f"{len(train_stream):,} training tokens, {len(held_out_stream):,} held-out tokens; model of "
            f"{shape.model_config().num_parameters / 1e6:.2f}M parameters; tokenizer ready in "
            f"{time.perf_counter() - started:.1f}s"
        )
        model = (initial if initial is not None else new_model(shape.model_config(), config.seed)).to(config.device)
        identity = run_identity(
            "train", model.config, tokenizer, corpus, **({"init": str(init_dir)} if init_dir else {})
        )
        task = language_model_task(model, train_stream, held_out_stream, shape.context, config, identity)
        state = train_loop(task, config, output.staging / CHECKPOINT_DIR, checkpoint)
        settings = {"model": dataclasses.asdict(shape), **corpus_record(corpus)}
        if init_dir is not None:
            settings.update(init=str(init_dir), init_log=read_training_log(init_dir))

        def save_model(directory: Path) -> None:
            save_pretrained(
                model,
                directory,
                SAVE_DTYPES[save_dtype],
                max_shard_bytes=max_shard_bytes,
                tokenizer=tokenizer,
                eos_token_id=eot_id,
            )

        return finish_run(output, "train", config, settings, state, arguments, save_model)


def load_initial_model(init_dir: str | Path, load_tokenizer: bool = False):
    """The trained model in init_dir (a LoadedModel), in float32 with its model ready to train:
    what a --init run of train or distill goes on from."""
    from specdec.models.loader import load_pretrained

    loaded = load_pretrained(init_dir, "float32", "cpu", load_tokenizer=load_tokenizer)
    loaded.model.train().requires_grad_(True)
    return loaded


def shape_of(config: ModelConfig) -> ModelShape:
    """The ModelShape of a loaded model's config (rejects shapes `specdec train` cannot make)."""
    if config.head_dim * config.num_heads != config.hidden_size:
        raise ValueError(
            f"--init: head_dim {config.head_dim} x {config.num_heads} heads is not the hidden size "
            f"{config.hidden_size}; specdec train makes (and continues) only models where it is"
        )
    return ModelShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        context=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def read_training_log(model_dir) -> dict | None:
    """How the model in model_dir (an --init model) was made, for the model card: its
    training_log.json, or None. An unfinished log there (written by versions that kept a stopped
    session's log in out) is this very run's, resumed with --out the same as --init: the model it
    started from is the one that log names."""
    path = None if model_dir is None else Path(model_dir) / "training_log.json"
    if path is None or not path.is_file():
        return None
    log = json.loads(path.read_text())
    return log if log.get("finished", True) else log.get("init_log")


def new_model(config: ModelConfig, seed: int) -> LlamaModel:
    """A LlamaModel in float32 with its weights initialised as in the module docstring."""
    return initialise(LlamaModel(config), config.num_layers, seed)


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def initialise(model: ModuleT, num_layers: int, seed: int) -> ModuleT:
    """model's weights as the module docstring says: normal(0, 0.02) matrices, the projections
    into the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * num_layers), norms at 1,
    biases at 0."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * num_layers)
    for name, param in model.named_parameters():  # a tied lm_head is the embedding, visited once
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        elif param.dim() < 2:  # biases
            torch.nn.init.zeros_(param)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(param, std=std, generator=generator)
    return model


def language_model_task(
    model: LlamaModel,
    train_stream: torch.Tensor,
    held_out_stream: torch.Tensor,
    context: int,
    config: TrainConfig,
    identity: dict,
) -> Task:
    """Next-token prediction on random windows of the training stream; held-out loss."""
    device = torch.device(config.device)
    held_out = evaluation_windows(held_out_stream, context, config.eval_tokens)

    def next_batch(generator: torch.Generator) -> torch.Tensor:
        return sample_windows(train_stream, config.batch_size, context, generator).to(device)

    def evaluate(model: LlamaModel) -> dict[str, float]:
        batches = held_out.split(config.batch_size)
        total = sum(float(next_token_loss(model, batch.to(device))) * len(batch) for batch in batches)
        return {"held_out_loss": total / len(held_out)}

    return Task(model, next_batch, next_token_loss, evaluate, config.batch_size * context, identity)


def next_token_loss(model: LlamaModel, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1]; windows [B, T+1]."""
    inputs, targets = windows[:, :-1], windows[:, 1:]  # [B, T] each
    logits = model(inputs, training_positions(inputs), None)  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # [B*T, V] vs [B*T]


def training_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """0..T-1 for every row: [B, T]."""
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).expand(B, T)


# ---------------------------------------------------------------------------- tokenizer


def prepare_tokenizer(corpus: Corpus, shape: ModelShape, tokenizer_dir, checkpoint: dict | None):
    """(tokenizer, end-of-text id): the checkpoint's when resuming, else the one in tokenizer_dir,
    else a byte-level BPE of shape.vocab_size trained on the training documents."""
    from tokenizers import Tokenizer

    if checkpoint is not None:
        tokenizer = Tokenizer.from_str(checkpoint["identity"]["tokenizer"])
    elif tokenizer_dir is not None:
        tokenizer = read_tokenizer(Path(tokenizer_dir))
    else:
        log(f"training a byte-level BPE tokenizer of {shape.vocab_size} tokens ...")
        tokenizer = train_byte_level_bpe((d.text for d in corpus.train), shape.vocab_size, (END_OF_TEXT,))
        if tokenizer.get_vocab_size() < shape.vocab_size:
            log(
                f"note: the corpus yields only {tokenizer.get_vocab_size():,} tokens, not {shape.vocab_size:,}; the "
                f"model's other {shape.vocab_size - tokenizer.get_vocab_size():,} embedding rows will never be used "
                "(give a smaller --vocab-size, or more text)"
            )
    return tokenizer, end_of_text_id(tokenizer, tokenizer_dir)


def read_tokenizer(path: Path):
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise ValueError(
            f"--tokenizer {str(path)!r}: no tokenizer.json there; point at a model directory "
            "(e.g. the target's) holding one"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:
        raise ValueError(f"{file}: not a readable tokenizer.json ({e})") from e


def end_of_text_id(tokenizer, tokenizer_dir) -> int:
    """The id of the token that ends every document: <|endoftext|>, or the eos_token of the
    reused tokenizer's tokenizer_config.json."""
    token = END_OF_TEXT
    config_file = Path(tokenizer_dir) / "tokenizer_config.json" if tokenizer_dir is not None else None
    if config_file is not None and config_file.is_file():
        eos = json.loads(config_file.read_text()).get("eos_token")
        token = (eos.get("content") if isinstance(eos, dict) else eos) or END_OF_TEXT
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no end-of-text token {token!r}; its documents need one")
    return token_id


def _fit_vocabulary(shape: ModelShape, tokenizer, tokenizer_dir) -> ModelShape:
    """A reused tokenizer brings its model's vocab_size (config.json there, else its own size),
    so a draft's embedding matches its target's."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if tokenizer_dir is not None:
        config_file = Path(tokenizer_dir) / "config.json"
        model_vocab = json.loads(config_file.read_text()).get("vocab_size") if config_file.is_file() else None
        shape = dataclasses.replace(shape, vocab_size=max(size, model_vocab or size))
    if size > shape.vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens, more than the model's vocab_size {shape.vocab_size}")
    return shape


# ---------------------------------------------------------------------------- run bookkeeping

CHECKPOINT_DIR = "checkpoint"  # in a run's output directory: the checkpoint to resume or lengthen it from


# what a train or distill run writes in its output directory (beside nothing of the user's)
RUN_OUTPUT_ENTRIES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
    "training_log.json",
    *(f"{CHECKPOINT_DIR}/{name}" for name in (CHECKPOINT_FILE, CHECKPOINT_FILE + ".tmp", "training_log.json")),
)


def open_run_output(
    out, kind: str, inputs: dict, force: bool, entries: tuple[str, ...] = RUN_OUTPUT_ENTRIES
) -> OutputDir:
    """The output directory of a training run (output_dir.py). Its own earlier output is a
    directory holding this kind of run's checkpoint and log, finished or not; entries: what the
    run writes there (a model's files by default)."""
    return open_output_dir(out, kind, inputs, force, lambda path: is_run_output(path, kind), entries)


def is_run_output(path: Path, kind: str) -> bool:
    """Whether path holds the checkpoint of a `specdec <kind>` run, with the run's log (beside
    the model, or beside the checkpoint for a run that stopped early) naming that kind."""
    if not (path / CHECKPOINT_DIR / CHECKPOINT_FILE).is_file():
        return False
    for log_file in (path / "training_log.json", path / CHECKPOINT_DIR / "training_log.json"):
        if log_file.is_file():
            try:
                return json.loads(log_file.read_text()).get("kind") == kind
            except (ValueError, AttributeError):
                return False
    return False


def resume_checkpoint(output: OutputDir, restart: bool, require_checkpoint: bool) -> dict | None:
    """The checkpoint to resume from (None = start afresh): the one in the staging directory
    (a session that stopped early), else the one of this command's earlier run in --out (a
    finished run, lengthened or rerun)."""
    if restart:
        output.clear_staging()
        return None
    for directory in checkpoint_dirs(output.final):
        checkpoint = read_checkpoint(directory)
        if checkpoint is not None:
            log(f"resuming from {directory / CHECKPOINT_FILE} (step {checkpoint['state']['step']})")
            return checkpoint
    if require_checkpoint:
        raise ValueError(
            f"--resume: no checkpoint in {output.staging / CHECKPOINT_DIR} or "
            f"{output.final / CHECKPOINT_DIR}; drop --resume to start a new run"
        )
    return None


def checkpoint_dirs(out) -> tuple[Path, Path]:
    """Where a run writing --out `out` may have left a checkpoint, the newest first: its
    staging directory's (a session that stopped early), then its earlier finished run's."""
    final = Path(out).expanduser().resolve()
    return staging_path(final) / CHECKPOINT_DIR, final / CHECKPOINT_DIR


def finish_run(
    output: OutputDir,
    kind: str,
    config: TrainConfig,
    settings: dict,
    state: RunState,
    arguments: dict | None,
    save_model: Callable[[Path], None],
    write_card: Callable[[Path, dict, str], None] | None = None,
) -> TrainResult:
    """A session's end: a finished run saves its model and log and moves into --out; a session
    that stopped early leaves its log beside its checkpoint in the staging directory.
    write_card: as write_log's."""
    finished = TrainResult(None, state, config.steps).finished
    if finished:
        save_model(output.staging)
    write_log(
        output.staging,
        kind,
        config,
        settings,
        TrainResult(None, state, config.steps),
        arguments,
        name=output.final.name,
        write_card=write_card,
    )
    if not finished:
        return TrainResult(None, state, config.steps)
    return TrainResult(output.commit(), state, config.steps)


def run_identity(kind: str, model_config: ModelConfig, tokenizer, corpus: Corpus, **extra) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    tokenizer_json = tokenizer.to_str()
    corpus_fingerprint = hashlib.sha256("\0".join(f"{d.name}\0{len(d.text)}" for d in corpus.train).encode())
    return {
        "kind": kind,
        "model": dataclasses.asdict(model_config),
        "tokenizer": tokenizer_json,
        "corpus": f"{corpus.root}:{corpus_fingerprint.hexdigest()[:16]}",
        **extra,
    }


def corpus_record(corpus: Corpus) -> dict:
    """What the training log keeps of the corpus (for the model card)."""
    return {"corpus": corpus.describe().removeprefix("corpus "), "held_out": [d.name for d in corpus.held_out]}


def write_log(
    out: Path,
    kind: str,
    config: TrainConfig,
    settings: dict,
    result: TrainResult,
    arguments: dict | None,
    name: str | None = None,
    write_card: Callable[[Path, dict, str], None] | None = None,
) -> None:
    """training_log.json: what was run and how it went. A finished run's goes in out, with the
    model card out/README.md made from it (write_card(out, the log's record, name); default
    model_card.py's, for a model directory; name: the model's, default out's); a session that
    stopped early writes its log beside its checkpoint, in out/checkpoint, so that it never
    stands beside weights (an earlier run's, or none) that it does not describe."""
    where = out if result.finished else out / CHECKPOINT_DIR
    where.mkdir(parents=True, exist_ok=True)
    state = result.state
    device = torch.cuda.get_device_name(config.device) if config.device.startswith("cuda") else "cpu"
    record = {
        "kind": kind,
        "arguments": arguments,
        "finished": result.finished,
        "train_config": dataclasses.asdict(config),
        **settings,
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "seconds": round(state.seconds, 1),
        "train_loss": result.train_loss,
        "evaluations": state.evaluations,
        "device": device,
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
    }
    (where / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")
    if result.finished:
        if write_card is None:
            write_model_card(out, name=name)
        else:
            write_card(out, record, name or out.name)


def check_save_dtype(save_dtype: str) -> None:
    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype {save_dtype!r} is not supported; use one of {', '.join(SAVE_DTYPES)}")
