"""The training loop `specdec train` and `specdec distill` share, with its checkpoints.

A run is a `Task` (the model, how to draw a micro-batch, its loss, a held-out evaluation)
driven by a `TrainConfig`:

  step            one optimizer update: grad_accum micro-batches of batch_size windows each,
                  gradients clipped to a global norm of grad_clip, then AdamW
  learning rate   linear warm-up from 0 to lr over `warmup` steps, then cosine decay to
                  lr * min_lr_ratio at step `steps`
  autocast        the forward and the loss run under torch.autocast(bfloat16) (CPU or CUDA);
                  the weights and the optimizer stay float32
  checkpoint      OUT/checkpoint/last.pt: model, optimizer, step, the data generator's and
                  torch's random states, the run's history; written to a temporary name and
                  renamed, so an interruption never leaves half a checkpoint. Restoring it
                  continues the run exactly where it was: same data, same updates.

Checkpoints are read with torch.load(weights_only=True): tensors and plain data only, no
arbitrary pickled objects.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from specdec.config import check, check_device, is_int, is_real
from specdec.output_dir import is_disk_full

CHECKPOINT_FILE = "last.pt"
CHECKPOINT_FORMAT = 1
# TrainConfig fields a resumed run may change; the others decide the data, the updates and the
# held-out text. `steps` may change too, to lengthen or shorten a run: the schedule is then the new
# length's from the resumed step on (the learning rate moves to the new cosine curve there).
RESUMABLE_CHANGES = frozenset(
    {"steps", "device", "eval_every", "checkpoint_every", "log_every", "stop_after", "max_seconds"}
)
DEFAULT_WARMUP = 100  # at most; a tenth of the steps for shorter runs


@dataclass(frozen=True)
class TrainConfig:
    """How to optimise (shared by train and distill). Steps count optimizer updates.

    eval_every / checkpoint_every / log_every: every that many steps (0 = only at the end).
    warmup: warm-up steps (must be fewer than steps); None: a tenth of the steps, at most
        DEFAULT_WARMUP.
    eval_tokens: held-out tokens evaluated each time (the first ones of the held-out text).
    stop_after: end this session at that step of the run although the schedule spans `steps`
        (rerun with a later stop_after, or none, to continue from the checkpoint); None = run
        to `steps`.
    bf16: bfloat16 autocast; False = plain float32.
    max_seconds: the run ends once its training loop has run that long, over all its sessions
        (RunState.seconds), at the step it reached: a time budget (`specdec adapt --minutes`),
        best with a flat schedule (min_lr_ratio 1); None = no budget.
    """

    steps: int = 2000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    bf16: bool = True
    eval_every: int = 200
    eval_tokens: int = 65536
    checkpoint_every: int = 200
    log_every: int = 10
    stop_after: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_tokens"):
            check(
                is_int(getattr(self, name)) and getattr(self, name) >= 1,
                f"{name} must be an integer >= 1, got {getattr(self, name)!r}",
            )
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(DEFAULT_WARMUP, self.steps // 10))
        for name in ("warmup", "eval_every", "checkpoint_every", "log_every", "seed"):
            check(
                is_int(getattr(self, name)) and getattr(self, name) >= 0,
                f"{name} must be an integer >= 0, got {getattr(self, name)!r}",
            )
        check(is_real(self.lr) and self.lr > 0, f"lr must be a number > 0, got {self.lr!r}")
        check(
            self.max_seconds is None or (is_real(self.max_seconds) and 0 < self.max_seconds < math.inf),
            f"max_seconds must be a number of seconds above 0, or None, got {self.max_seconds!r}",
        )
        check(
            is_real(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}",
        )
        check(
            is_real(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be >= 0, got {self.weight_decay!r}",
        )
        check(is_real(self.grad_clip) and self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip!r}")
        check(
            self.stop_after is None or (is_int(self.stop_after) and self.stop_after >= 1),
            f"stop_after must be an integer >= 1 or None, got {self.stop_after!r}",
        )
        check(
            self.warmup < self.steps,  # pyright: ignore[reportOptionalOperand]  # an int from above
            f"warmup {self.warmup} must be fewer steps than steps {self.steps}: the "
            f"learning rate would never reach lr nor decay; lower --warmup",
        )
        check_device(self.device)

    @property
    def last_step(self) -> int:
        """The step this session ends at."""
        return min(self.steps, self.stop_after or self.steps)


@dataclass
class Task:
    """What the loop trains: everything that differs between train and distill.

    next_batch(generator): one micro-batch, drawn with the loop's data generator (on the device).
    loss(model, batch): the micro-batch's mean loss, a scalar to minimise.
    evaluate(model): held-out metrics, e.g. {"held_out_loss": 2.9}; run without gradients.
    tokens_per_batch: tokens the model reads per micro-batch (for tokens/s).
    identity: what a checkpoint must match to be resumed (kind, model config, tokenizer, corpus).
    """

    model: torch.nn.Module  # a LlamaModel, or an EAGLE head (training/heads.py)
    next_batch: Callable[[torch.Generator], object]  # token windows, or what the task's loss reads
    loss: Callable[[Any, Any], torch.Tensor]  # (the task's model, a batch of next_batch's)
    evaluate: Callable[[Any], dict[str, float]]
    tokens_per_batch: int
    identity: dict


@dataclass
class RunState:
    """Where a run stands; saved in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0  # wall time of the training loop, over all sessions
    losses: list[float] = field(default_factory=list)  # train loss of each step
    evaluations: list[dict] = field(default_factory=list)  # {"step": s, **metrics}
    out_of_time: bool = False  # the run ended at TrainConfig.max_seconds, before its last step


def train_loop(task: Task, config: TrainConfig, checkpoint_dir: Path, checkpoint: dict | None) -> RunState:
    """Run steps up to config.last_step from scratch or from `checkpoint` (see read_checkpoint);
    evaluate at step 0 and at the end; return the run's state. The session always ends with its
    checkpoint in checkpoint_dir (also when resumed with nothing left to do)."""
    model, device = task.model, torch.device(config.device)
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(config.seed)
    state = RunState()
    if checkpoint is not None:
        state = restore(checkpoint, task, config, optimizer, generator)
    autocast = _autocast(config, device)
    if not state.evaluations:
        evaluate(task, state, autocast)
    progress = Progress(config, state)
    while state.step < config.last_step and not state.out_of_time:
        loss = train_step(task, optimizer, config, generator, autocast, learning_rate(state.step, config))
        state.step += 1
        state.tokens_seen += task.tokens_per_batch * config.grad_accum
        state.losses.append(loss)
        progress.update(state)
        state.out_of_time = config.max_seconds is not None and state.seconds >= config.max_seconds
        if _due(state.step, config.eval_every, config):
            evaluate(task, state, autocast)
        if _due(state.step, config.checkpoint_every, config):
            save_checkpoint(checkpoint_dir, task, config, optimizer, generator, state)
    if state.evaluations[-1]["step"] != state.step:
        evaluate(task, state, autocast)
    if state.out_of_time or not (checkpoint_dir / CHECKPOINT_FILE).is_file():
        save_checkpoint(checkpoint_dir, task, config, optimizer, generator, state)
    return state


def train_step(
    task: Task, optimizer: torch.optim.Optimizer, config: TrainConfig, generator: torch.Generator, autocast, lr: float
) -> float:
    """One optimizer update over grad_accum micro-batches; returns the step's mean loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    task.model.train()
    total = 0.0
    for _ in range(config.grad_accum):
        batch = task.next_batch(generator)
        with autocast:
            loss = task.loss(task.model, batch) / config.grad_accum
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(task.model.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to config.lr, then cosine decay to lr * min_lr_ratio at config.steps."""
    warmup = config.warmup
    assert warmup is not None  # TrainConfig makes None its default
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, config.steps - warmup))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (embeddings included) only, not on norms or biases;
    the fused implementation (one kernel over all parameters; CPU and CUDA)."""
    params = list(model.parameters())  # a tied embedding appears once
    matrices, others = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def evaluate(task: Task, state: RunState, autocast) -> dict:
    task.model.eval()
    with torch.no_grad(), autocast:
        metrics = {"step": state.step, **task.evaluate(task.model)}
    state.evaluations.append(metrics)
    log(f"eval step {state.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "step"))
    return metrics


def _due(step: int, every: int, config: TrainConfig) -> bool:
    return step == config.last_step or (every > 0 and step % every == 0)


class Progress:
    """One line to stderr every log_every steps: step, loss, learning rate, tokens/s, time left."""

    def __init__(self, config: TrainConfig, state: RunState):
        self.config = config
        self.start_time, self.start_step, self.start_tokens = time.perf_counter(), state.step, state.tokens_seen
        self.base_seconds = state.seconds

    def update(self, state: RunState) -> None:
        elapsed = time.perf_counter() - self.start_time
        state.seconds = self.base_seconds + elapsed
        every = self.config.log_every
        if not (state.step == self.config.last_step or (every > 0 and state.step % every == 0)):
            return
        steps_done = state.step - self.start_step
        tokens_per_second = (state.tokens_seen - self.start_tokens) / max(elapsed, 1e-9)
        left = elapsed / steps_done * (self.config.last_step - state.step)
        recent = state.losses[-max(1, every) :]
        log(
            f"step {state.step}/{self.config.steps}  loss {sum(recent) / len(recent):.4f}  "
            f"lr {learning_rate(state.step - 1, self.config):.2e}  {tokens_per_second:,.0f} tok/s  "
            f"elapsed {format_seconds(state.seconds)}  left {format_seconds(left)}"
        )


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- checkpoints


def read_checkpoint(checkpoint_dir: Path) -> dict | None:
    """The checkpoint in checkpoint_dir, or None if there is none."""
    file = checkpoint_dir / CHECKPOINT_FILE
    if not file.is_file():
        return None
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{file} is not a readable checkpoint ({e}); delete it or pass --restart") from e
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{file} is not a specdec training checkpoint (format {CHECKPOINT_FORMAT}); delete it or pass --restart"
        )
    return checkpoint


def save_checkpoint(
    checkpoint_dir: Path,
    task: Task,
    config: TrainConfig,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    state: RunState,
) -> None:
    """Write checkpoint_dir/last.pt atomically (a temporary file, then a rename)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "identity": task.identity,
        "train_config": asdict(config),
        "model": task.model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data_generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "state": asdict(state),
    }
    save_atomically(checkpoint, checkpoint_dir / CHECKPOINT_FILE)


def save_atomically(data: dict, file: Path) -> None:
    """torch.save data to file through a temporary file, renamed into place once whole; a write
    that fails removes the temporary file (the file keeps its earlier contents), and one that
    failed for want of space is said as an OSError ENOSPC, which torch.save's own error ("unexpected
    pos") is not: told while the partial file still holds its space."""
    temporary = file.with_name(file.name + ".tmp")
    try:
        with open(temporary, "wb") as stream:  # a stream, not a path: its OSError is the error's context
            torch.save(data, stream)
        os.replace(temporary, file)
    except Exception as e:
        full = is_disk_full(e, file.parent)
        temporary.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(temporary)) from e
        raise
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def restore(
    checkpoint: dict, task: Task, config: TrainConfig, optimizer: torch.optim.Optimizer, generator: torch.Generator
) -> RunState:
    """Load the checkpoint into the model, optimizer and generator, after checking it is this run's."""
    check_resumable(checkpoint, task, config)
    task.model.load_state_dict(checkpoint["model"], strict=False)  # the non-persistent inv_freq is not saved
    optimizer.load_state_dict(checkpoint["optimizer"])
    generator.set_state(checkpoint["data_generator"])
    torch.set_rng_state(checkpoint["torch_rng"])
    return RunState(**checkpoint["state"])


def _autocast(config: TrainConfig, device: torch.device):
    """bfloat16 autocast where asked for and native; float32 where the hardware would emulate
    bfloat16 matmuls (an AVX2-only CPU, where they run far slower), with a note. Autocast
    changes how steps compute, not the weights, so a run may go on under either."""
    from specdec.platform import detect_platform

    if not config.bf16:
        return contextlib.nullcontext()
    platform = detect_platform(device)
    if not platform.native_bf16:
        log(
            f"note: bfloat16 is emulated on this {platform.describe()}: training in float32 instead (--precision fp32 "
            "says so)"
        )
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _differing_identity(checkpoint: dict, task: Task) -> list[str]:
    return sorted(
        k
        for k in set(task.identity) | set(checkpoint["identity"])
        if task.identity.get(k) != checkpoint["identity"].get(k)
    )


def _changed_settings(checkpoint: dict, config: TrainConfig) -> list[str]:
    saved = checkpoint["train_config"]
    return sorted(
        f.name
        for f in fields(config)
        if f.name not in RESUMABLE_CHANGES and saved.get(f.name) != getattr(config, f.name)
    )


def check_resumable(checkpoint: dict, task: Task, config: TrainConfig) -> None:
    hint = "use another --out, or pass --restart to start over"
    differing = _differing_identity(checkpoint, task)
    if differing:
        raise ValueError(
            f"the checkpoint in the output directory is of a different run (it differs in "
            f"{', '.join(differing)}); {hint}"
        )
    saved = checkpoint["train_config"]
    changed = _changed_settings(checkpoint, config)
    if changed:
        details = ", ".join(f"{name} {saved.get(name)!r} -> {getattr(config, name)!r}" for name in changed)
        warmup = (
            f" (warm-up defaults to a tenth of --steps, at most {DEFAULT_WARMUP}: pass --warmup "
            f"{saved.get('warmup')} to keep the run's with other --steps)"
            if "warmup" in changed
            else ""
        )
        raise ValueError(
            f"the checkpoint was made with other training settings ({details}){warmup}; "
            f"rerun with the same settings to resume, or {hint}"
        )
    if config.stop_after is not None and checkpoint["state"]["step"] > config.stop_after:
        raise ValueError(
            f"the checkpoint is at step {checkpoint['state']['step']}, past --stop-after "
            f"{config.stop_after}; give a later --stop-after (or none) to go on"
        )
    if checkpoint["state"]["step"] > config.steps:
        raise ValueError(
            f"the checkpoint is at step {checkpoint['state']['step']}, past --steps {config.steps}; {hint}"
        )
