"""This machine, as the benchmarks measure it: what it is, how fast it streams memory, and
what one model step costs on it.

The roofline of decoding: every step reads every weight once, so a step can take no less
than weight bytes ÷ streaming read bandwidth; bandwidth ÷ weight bytes is the ceiling in
tokens/s for plain decoding at batch 1.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch

from specdec.platform import cpu_model


def describe_machine(device: str | torch.device = "cpu") -> dict:
    """CPU model, cores, threads, accelerator, torch and Python versions, and the date (UTC)."""
    device = torch.device(device)
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def read_bandwidth(num_bytes: int, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes/s of summing a float32 buffer of num_bytes (the best of repeats). A buffer larger
    than the last-level cache measures streaming from DRAM."""
    device = torch.device(device)
    buffer = torch.ones(num_bytes // 4, device=device)
    buffer.sum()
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter, buffer (quantized weights and
    their scales) and prepacked weight once, but of the embedding table only the row it looks
    up, unless the table is also the output matrix (tied, not prepacked nor quantized), which
    the step reads whole."""
    seen, total = set(), 0
    packed = [m.packed_weight for m in model.modules() if hasattr(m, "packed_weight")]
    for tensor in list(model.parameters()) + list(model.buffers()) + packed:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    embedding = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not embedding:
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total


def step_seconds(runner, repeats: int = 50, context: int = 64, num_tokens: int = 1, num_forwards: int = 0) -> float:
    """Median time of one forward of num_tokens tokens (1: a decode step; k + 1: a verify
    forward) after a context of `context` tokens, as runner (a ModelRunner, or a model to run
    eagerly) runs it for work of num_forwards forwards (which decides whether "auto" compiles)."""
    from specdec.worker import ForwardBatch, ModelRunner

    if not isinstance(runner, ModelRunner):
        runner = ModelRunner(runner, compile="off")
    device = runner.device
    runner.prepare(1, context + num_tokens + 16, (num_tokens,), num_forwards)
    ids = torch.randint(0, runner.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    step = ForwardBatch.of(ids[:, -num_tokens:], torch.arange(context, context + num_tokens, device=device)[None], [0])
    with torch.inference_mode():
        runner(ForwardBatch.of(ids, torch.arange(context, device=device)[None], [0]))  # the context
        for _ in range(5):
            runner(step)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            runner(step)
            _synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
