"""Whether specdec's GGUF kernel prefetches weights for one-row products: timed on this machine.

Terms:
  one-row product  a quantized linear layer applied to one row of input: what a decode step does
                   to every weight, streaming it from memory once
  prefetch         the kernel's software prefetch, PREFETCH_BYTES ahead of the codes it reads
                   (kernels/qmatmul.cpp). Products of 2 rows or more always prefetch (they
                   compute long enough between loads for the hardware prefetcher to fall
                   behind); for one row it depends on the machine: on a Zen 4 a streaming read
                   was slower with it and a step no faster, on a Sapphire Rapids a step took
                   28-35% less time with it (docs/runner.md, "GGUF weights, run quantized")
  weights pass     every GGUF linear layer of a model run once on one row of zeros: the weight
                   bytes of a decode step, without the attention between them

The first model of a process whose GGUF weights are at least MIN_TIMED_BYTES (so that most of a
pass comes from memory, not the caches) decides for the process: ROUNDS interleaved weights
passes with and without one-row prefetch, and prefetch if its median pass is MIN_GAIN faster.
A smaller model leaves the kernel's default (no one-row prefetch) and the choice to a later one.
SPECDEC_ONE_ROW_PREFETCH=on or off decides without timing (reproducible benchmarks). Results
are the same either way: a prefetch changes when bytes arrive, not what is computed.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from specdec.kernels import qmatmul
from specdec.models.gguf_linear import GGUFLinear

log = logging.getLogger("specdec")

ENV_VAR = "SPECDEC_ONE_ROW_PREFETCH"
MIN_TIMED_BYTES = 256 * 2**20
ROUNDS = 5
MIN_GAIN = 0.03  # prefetch only where its median pass is at least 3% faster
DEFAULT_ROWS, ONE_ROW = 2, 1  # the kernel's prefetch_rows without and with one-row prefetch

_decided: bool | None = None  # this process's choice, once made


def gguf_linears(model: nn.Module) -> list[GGUFLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


def gguf_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's GGUF linear layers' packed weights (codes and scales)."""
    return sum(part.nbytes() for layer in gguf_linears(model) for part in layer.parts)


def prefers_prefetch(with_prefetch: list[float], without: list[float], min_gain: float = MIN_GAIN) -> bool:
    """Whether the passes timed with one-row prefetch were min_gain faster (medians)."""
    return statistics.median(with_prefetch) < (1 - min_gain) * statistics.median(without)


def time_passes(run_pass: Callable[[], None], set_rows: Callable[[int], None], rounds: int = ROUNDS):
    """(seconds with one-row prefetch, seconds without), a pass of each per round, interleaved;
    the kernel's default is set back afterwards."""
    with_prefetch, without = [], []
    try:
        run_pass()  # the first pass faults pages in and warms the code: not counted
        for _ in range(rounds):
            for rows, times in ((ONE_ROW, with_prefetch), (DEFAULT_ROWS, without)):
                set_rows(rows)
                start = time.perf_counter()
                run_pass()
                times.append(time.perf_counter() - start)
    finally:
        set_rows(DEFAULT_ROWS)
    return with_prefetch, without


def weights_pass(model: nn.Module) -> Callable[[], None]:
    """A function running every GGUF linear layer of model on one row of zeros."""
    layers = gguf_linears(model)
    inputs = [torch.zeros(1, layer.input_size) for layer in layers]

    def run() -> None:
        with torch.inference_mode():
            for layer, x in zip(layers, inputs):
                layer.product(x)

    return run


def choose_one_row_prefetch(model: nn.Module, name: str = "the model") -> bool | None:
    """Set the kernel's one-row prefetch for this process (module docstring): the choice, or
    None while no model has been large enough to time (the default stands)."""
    global _decided
    if _decided is not None:
        return _decided
    setting = os.environ.get(ENV_VAR)
    if setting is not None and setting not in ("on", "off"):
        raise ValueError(f"{ENV_VAR} must be 'on' or 'off' (or unset: timed on this machine), got {setting!r}")
    if setting is not None:
        _decided = setting == "on"
        how = f"{ENV_VAR}={setting}"
    elif gguf_weight_bytes(model) < MIN_TIMED_BYTES:
        return None
    else:
        with_prefetch, without = time_passes(weights_pass(model), qmatmul().set_prefetch_rows)
        _decided = prefers_prefetch(with_prefetch, without)
        how = (
            f"{name}'s weights pass took {statistics.median(with_prefetch) * 1e3:.1f} ms with it, "
            f"{statistics.median(without) * 1e3:.1f} ms without (medians of {ROUNDS})"
        )
    qmatmul().set_prefetch_rows(ONE_ROW if _decided else DEFAULT_ROWS)
    log.info("one-row products prefetch weights: %s (%s)", "yes" if _decided else "no", how)
    return _decided
