"""specdec's own CPU kernels (a C++ extension built on first use with torch.utils.cpp_extension).

attention.cpp attends every forward's queries over the key/value cache (a decode step, a verify
forward, a prefill chunk), each query alone, so that a verify forward gives bit for bit what the
decode steps would and a row's values never depend on the rows beside it.
layer.cpp runs a quantized decoder layer's forward over the cache in one call (kernels.h: what
the three share).
qmatmul.cpp multiplies activations by GGUF-quantized weights held in their integer codes (see
its header for the layout). It is compiled for the CPU it runs on, in one of three variants:
  amx          the avx512_vnni kernel, and AMX-INT8 tiles (amx.h: a tile multiply-add of 16 rows x 16
               outputs x up to 64 inputs), on Sapphire Rapids and later, bit for bit the VNNI
               kernel's products: by default the tiles multiply the Q4_K and Q5_K products of 32
               rows or more (a prefill, a batch's verify: where they are faster, docs/runner.md
               "AMX tiles"), and where SPECDEC_KERNEL=amx asks, every product of 2 rows or more
  avx512_vnni  AVX-512 with VNNI (vpdpbusd: 64 unsigned codes x 4 int8 activations a step)
  avx_vnni     the avx2 kernel with AVX-VNNI's 256-bit vpdpbusd for the k-quants' products (Alder Lake
               and later; a Sapphire Rapids held to AVX2): the same integers, so the same bits
  avx2         AVX2 + FMA + F16C (maddubs + madd), for every other x86-64 CPU of the last decade
The variant follows the CPU's flags and PyTorch's own choice of instruction set (torch.backends.cpu.
get_cpu_capability(), which ATEN_CPU_CAPABILITY lowers), so a run held to AVX2 runs the AVX2
kernel (avx_vnni where the CPU has it); SPECDEC_KERNEL=amx, avx512_vnni, avx_vnni or avx2 holds
one (refused by name where the CPU lacks what it needs), so that one machine can measure each.
The build (once per variant and source; docs/runner.md, "GGUF weights, run quantized", says how
long) lands in SPECDEC_CACHE/extensions/<variant>; `make test` builds it. One process builds there at a time,
and a build killed midway never leaves a later run waiting forever (build_lock.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from specdec.kernels.build_lock import LOCK_NAME, build_lock

log = logging.getLogger("specdec")

SOURCE_DIR = Path(__file__).parent
# extension.cpp includes qmatmul.cpp, attention.cpp and layer.cpp (and they kernels.h, vec16.h, amx.h):
# one translation unit, so that PyTorch's headers are compiled once (its comment has the times)
SOURCES = [SOURCE_DIR / "extension.cpp"]
COMMON_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-mavx2",
    "-mfma",
    "-mf16c",
]  # -fopenmp: at::parallel_for is OpenMP inlined here
AVX512_FLAGS = COMMON_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
VARIANT_FLAGS = {
    "amx": AVX512_FLAGS + ["-mamx-tile", "-mamx-int8"],
    "avx512_vnni": AVX512_FLAGS,
    "avx_vnni": COMMON_FLAGS + ["-mavxvnni"],
    "avx2": COMMON_FLAGS,
}
KERNEL_ENV = "SPECDEC_KERNEL"
AVX2_CPU = {"avx2", "fma", "f16c"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
CPU_NEEDS = {  # a variant: the /proc/cpuinfo flags its kernels run on
    "amx": AVX512_CPU | {"amx_tile", "amx_int8"},
    "avx512_vnni": AVX512_CPU,
    "avx_vnni": AVX2_CPU | {"avx_vnni"},
    "avx2": AVX2_CPU,
}


class KernelUnavailable(RuntimeError):
    """This machine cannot run (or build) specdec's quantized kernels; the message says why."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def variant() -> str:
    """The kernel variant: SPECDEC_KERNEL's where set, else the best this CPU has and PyTorch's
    chosen instruction set allows."""
    import torch

    flags = cpu_flags()
    held = os.environ.get(KERNEL_ENV, "")
    if held:
        return held_variant(held, flags)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        for name in ("amx", "avx512_vnni"):
            if CPU_NEEDS[name] <= flags:
                return name
    if capability in ("AVX2", "AVX512"):
        for name in ("avx_vnni", "avx2"):
            if CPU_NEEDS[name] <= flags:
                return name
    raise KernelUnavailable(
        f"quantized GGUF weights need an x86-64 CPU with AVX2, FMA and F16C (PyTorch reports "
        f"{capability!r}); load the model with quantization=None to dequantize it instead"
    )


def held_variant(name: str, flags: set[str]) -> str:
    """SPECDEC_KERNEL's variant, if this CPU runs it."""
    if name not in CPU_NEEDS:
        raise KernelUnavailable(f"{KERNEL_ENV}={name!r} is not a kernel: choose one of {', '.join(CPU_NEEDS)}")
    missing = CPU_NEEDS[name] - flags
    if missing:
        raise KernelUnavailable(
            f"{KERNEL_ENV}={name}: this CPU lacks {', '.join(sorted(missing))}; unset it to use the best kernel it has"
        )
    return name


@functools.cache
def qmatmul() -> Any:  # a C++ extension module: its attributes are unknown to type checkers
    """The compiled extension module for this CPU (built on first use, under the build lock:
    build_lock.py)."""
    from specdec.paths import CACHE

    name = variant()
    build_dir = CACHE / "extensions" / name
    with build_lock(build_dir):
        start = time.perf_counter()
        module = _build_and_load(name, build_dir)
        elapsed = time.perf_counter() - start
    if elapsed > 1:
        log.info("built specdec's quantized kernel (%s) in %.0f s", name, elapsed)
    if name == "amx":
        _enable_amx(module, held=os.environ.get(KERNEL_ENV) == "amx")
    _register_fakes()
    return module


def _enable_amx(module: Any, held: bool = True) -> None:
    """Turn the amx build's tiles on: for every product of 2 rows or more where SPECDEC_KERNEL=amx
    holds them (an error names why where Linux refuses them), else for the Q4_K and Q5_K products
    of 32 rows or more alone ("auto": where they are faster; on Linux's refusal a log line, and
    the VNNI kernel)."""
    try:
        module.set_kernel("amx" if held else "auto")
    except RuntimeError as e:
        if held:
            raise KernelUnavailable(str(e)) from e
        log.warning("AMX tiles unavailable, the AVX-512 VNNI kernel multiplies every product: %s", e)


def _build_and_load(name: str, build_dir: Path) -> Any:
    """Build (ninja: only what is missing or stale) and load the extension; a library that
    does not load (left broken by an interrupted build) is built afresh, once."""
    try:
        return _load(name, build_dir)
    except ImportError as e:
        log.warning("specdec's kernel library in %s did not load (%s): building it afresh", build_dir, e)
    _clear_build(name, build_dir)
    try:
        return _load(name, build_dir)
    except ImportError as e:
        raise KernelUnavailable(
            f"specdec's kernels, built afresh in {build_dir}, do not load: {e}; "
            "check the compiler's install, or load with quantization=None"
        ) from e


def _load(name: str, build_dir: Path) -> Any:
    from torch.utils import cpp_extension

    # every source's hash in the flags: torch rebuilds when the flags or extension.cpp change, not a
    # file it includes (qmatmul.cpp, attention.cpp, layer.cpp, the headers)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.[ch]*")))).hexdigest()[:16]
    try:
        return cpp_extension.load(
            name=extension_name(name),
            sources=[str(source) for source in SOURCES],
            extra_cflags=[*VARIANT_FLAGS[name], f"-DSPECDEC_SOURCES={digest}"],
            extra_ldflags=["-fopenmp"] if os.name == "posix" else [],
            build_directory=str(build_dir),
            verbose=False,
        )
    except ImportError:
        raise
    except Exception as e:  # no compiler, a failed build
        raise KernelUnavailable(
            f"building specdec's kernels ({', '.join(s.name for s in SOURCES)}, {name}) failed: {e}; "
            "install a C++ compiler (gcc) and ninja, or load with quantization=None"
        ) from e


def extension_name(variant_name: str) -> str:
    """The extension module's name (and its library's, in the build directory) for a variant."""
    return f"specdec_qmatmul_{variant_name}"


def _clear_build(name: str, build_dir: Path) -> None:
    """Remove every build output (all but the build lock's file) and make torch forget that
    this process built the extension, so that the next load builds it from the sources."""
    from torch.utils import cpp_extension

    for path in build_dir.iterdir():
        if path.name != LOCK_NAME:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(extension_name(name), None)


def _register_fakes() -> None:
    """Shapes of torch.ops.specdec.* for torch.compile, which traces with fake tensors."""
    import torch

    @torch.library.register_fake("specdec::quantize_activations")
    def _(x):
        rows, cols = x.shape
        block = 256 if cols % 256 == 0 else 32  # inputs per activation scale (qmatmul.cpp's act_block)
        return (
            x.new_empty(rows, cols, dtype=torch.int8),
            x.new_empty(rows, cols // block, dtype=torch.float32),
            x.new_empty(rows, cols // 16 + cols // 32, dtype=torch.int16),
        )

    @torch.library.register_fake("specdec::qmatmul")
    def _(xq, dx, xsum, codes, sc, mn, d, dmin, bits, S, SB, z, sc_signed):
        return dx.new_empty(xq.shape[0], codes.shape[0] * 16)

    @torch.library.register_fake("specdec::qlinear")
    def _(x, codes, sc, mn, d, dmin, layouts, bias, norm_weight=None, eps=0.0, gated=False):
        return x.new_empty(x.shape[0], sum(c.shape[0] for c in codes) * 16, dtype=torch.float32)

    @torch.library.register_fake("specdec::attend")
    def _(q, keys, values, mask, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("specdec::attend_paged")
    def _(q, keys, values, blocks, mask, num_keys, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("specdec::attend_packed")
    def _(q, keys, values, blocks, row_starts, row_keys, mask, num_keys, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("specdec::dequantize_rows")
    def _(ids, codes, sc, mn, d, dmin, K, bits, S, SB, z, sc_signed):
        return d.new_empty(ids.shape[0], K, dtype=torch.float32)


@functools.cache
def available() -> bool:
    """Whether this machine runs (and has built, or can build) specdec's kernels. Another build
    that outlasts the wait (build_lock.KernelBuildBusy) is raised, not answered False: the
    kernels may well run here, once it ends."""
    try:
        qmatmul()
    except KernelUnavailable as e:
        log.warning("%s", e)
        return False
    return True


def ops():
    """torch.ops.specdec, once the extension is loaded."""
    import torch

    qmatmul()
    return torch.ops.specdec
