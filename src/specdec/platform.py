"""What this machine can do, detected once: device, CPU capability, native half precision.

Half-precision matmuls pay only where the hardware runs them natively. On a CPU with
AVX-512-bf16 or AMX, bfloat16 halves the bytes a decode step reads; on an AVX2-only CPU
PyTorch emulates them, far slower than float32 (docs/runner.md, 'dtype "auto"'). `auto_dtype`
turns that into the dtype "auto" picks.

Tests (and users who know better) pass a Platform of their own wherever one is taken;
nothing here is global except the cache of what was detected.
"""

from __future__ import annotations

import functools
import logging
import platform as _platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("specdec")


@dataclass(frozen=True)
class Platform:
    """device_type: "cpu" or "cuda".
    cpu_capability: what PyTorch's CPU kernels were dispatched for ("AVX512", "AVX2", ...).
    native_bf16 / native_fp16: matmuls in that dtype run natively on device_type (CPU:
        oneDNN's bf16 / fp16 support, AVX-512-bf16, AVX-512-fp16 or AMX; CUDA: by capability).
    cuda_capability: (major, minor) of the CUDA device, None on the CPU.
    """

    device_type: str
    cpu_capability: str
    native_bf16: bool
    native_fp16: bool
    cuda_capability: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.device_type == "cuda":
            assert self.cuda_capability is not None  # detect_platform sets it for CUDA
            major, minor = self.cuda_capability
            return f"CUDA capability {major}.{minor}" + (", native bfloat16" if self.native_bf16 else "")
        half = [name for name, native in (("bfloat16", self.native_bf16), ("float16", self.native_fp16)) if native]
        return f"CPU with {self.cpu_capability} and " + (
            f"native {' and '.join(half)}" if half else "no native half precision"
        )


def detect_platform(device: torch.device | str = "cpu") -> Platform:
    """The platform of device (detected once per device)."""
    device = torch.device(device)
    return _detect(device.type, device.index or 0 if device.type == "cuda" else None)


@functools.cache
def _detect(device_type: str, cuda_index: int | None) -> Platform:
    cpu_capability = torch.backends.cpu.get_cpu_capability()
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability(cuda_index)
        return Platform(
            "cuda", cpu_capability, native_bf16=capability >= (8, 0), native_fp16=True, cuda_capability=capability
        )
    return Platform("cpu", cpu_capability, native_bf16=_mkldnn_supports("bf16"), native_fp16=_mkldnn_supports("fp16"))


def _mkldnn_supports(kind: str) -> bool:
    """oneDNN's own check (it honours ONEDNN_MAX_CPU_ISA; false where it emulates)."""
    try:
        return bool(getattr(torch.ops.mkldnn, f"_is_mkldnn_{kind}_supported")())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def auto_dtype(saved: torch.dtype, platform: Platform) -> tuple[torch.dtype, str]:
    """The dtype "auto" runs a checkpoint saved in `saved` in, and why.

    CPU: the saved half precision where its matmuls are native, else float32 (a float32
    checkpoint stays float32). CUDA: float32 checkpoints run in bfloat16 (float16 before
    capability 8.0), as vLLM does; bfloat16 ones in float16 where bfloat16 is not native."""
    if platform.device_type == "cuda":
        half = torch.bfloat16 if platform.native_bf16 else torch.float16
        if saved == torch.float32 or (saved == torch.bfloat16 and not platform.native_bf16):
            return half, f"{_name(saved)} checkpoint, {_name(half)} on {platform.describe()}"
        return saved, f"the checkpoint's {_name(saved)}"
    if saved == torch.float32:
        return saved, "the checkpoint's float32"
    if is_native(saved, platform):
        return saved, f"the checkpoint's {_name(saved)}, native on this {platform.describe()}"
    return torch.float32, (
        f"the checkpoint is {_name(saved)}, but this {platform.describe()} emulates "
        f"{_name(saved)} matmuls, which run far slower than float32"
    )


def is_native(dtype: torch.dtype, platform: Platform) -> bool:
    """Whether dtype's matmuls run natively on platform (float32 always does)."""
    return {torch.bfloat16: platform.native_bf16, torch.float16: platform.native_fp16}.get(dtype, True)


def warn_if_emulated(dtype: torch.dtype, platform: Platform, what: str) -> None:
    """An explicitly asked half precision that this platform emulates runs, with a warning."""
    if not is_native(dtype, platform):
        warnings.warn(
            f"{what} runs in {_name(dtype)}, which this {platform.describe()} emulates: expect it to be "
            "much slower than float32 (dtype='auto' picks float32 here)",
            stacklevel=3,
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return _platform.processor() or _platform.machine() or "unknown"
