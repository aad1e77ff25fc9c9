"""Which GGUF kernel runs (kernels/__init__.py's variants, SPECDEC_KERNEL), and that every kernel a
CPU has gives the same bits: AMX tiles (amx.h) against the AVX-512 VNNI kernel they stand in for,
for every packed type and 1-40 rows (one row, verify widths, past a tile's 16 and a pass's 32),
and as the default uses them (Q4_K and Q5_K products of 32 rows or more); AVX-VNNI's 256-bit
kernel against AVX2's (1-33 rows); and AVX2's against AVX-512's for every type but Q6_K (the
default's tiles at 32 and 33 rows)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gguf_files import encode
from specdec import kernels
from specdec.kernels import CPU_NEEDS, KernelUnavailable, cpu_flags, qmatmul, variant
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_quants import LAYOUTS, pack

TYPES = sorted(LAYOUTS)


def test_variant_follows_the_cpu_and_pytorchs_instruction_set(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    flags = cpu_flags()
    best_first = ("amx", "avx512_vnni", "avx_vnni", "avx2")
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        best_first = ("avx_vnni", "avx2")
    assert variant() == next(name for name in best_first if CPU_NEEDS[name] <= flags)


def test_an_alder_lake_gets_avx_vnni_and_an_older_cpu_avx2(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: CPU_NEEDS["avx_vnni"])  # AVX2 and AVX-VNNI, no AVX-512
    assert variant() == "avx_vnni"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: CPU_NEEDS["avx2"])
    assert variant() == "avx2"


def test_the_loaded_kernel_is_the_variants():
    built = variant()
    # the amx build multiplies with AVX-512 VNNI unless SPECDEC_KERNEL=amx asks for its tiles
    assert qmatmul().isa() in ({"amx", "avx512_vnni+amx", "avx512_vnni"} if built == "amx" else {built})


def test_a_held_kernel_is_taken_or_refused_by_name(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: CPU_NEEDS["avx512_vnni"])  # an AMD EPYC Zen 4
    monkeypatch.setenv(kernels.KERNEL_ENV, "avx2")
    assert variant() == "avx2"
    monkeypatch.setenv(kernels.KERNEL_ENV, "avx512_vnni")
    assert variant() == "avx512_vnni"
    monkeypatch.setenv(kernels.KERNEL_ENV, "amx")
    with pytest.raises(KernelUnavailable, match="SPECDEC_KERNEL=amx: this CPU lacks amx_int8, amx_tile"):
        variant()
    monkeypatch.setenv(kernels.KERNEL_ENV, "avx_vnni")
    with pytest.raises(KernelUnavailable, match="SPECDEC_KERNEL=avx_vnni: this CPU lacks avx_vnni"):
        variant()
    monkeypatch.setenv(kernels.KERNEL_ENV, "avx1024")
    with pytest.raises(
        KernelUnavailable, match="'avx1024' is not a kernel: choose one of amx, avx512_vnni, avx_vnni, avx2"
    ):
        variant()


SET_KERNEL_NAME = {"avx512_vnni+amx": "auto"}  # isa() -> set_kernel()'s name for it


@pytest.fixture
def amx_module():
    """The amx build with its tiles on (as SPECDEC_KERNEL=amx has it), or a skip; afterwards the
    kernel it had."""
    module = qmatmul()
    if variant() != "amx":
        pytest.skip("no AMX on this CPU: the VNNI or AVX2 kernel is the only one")
    original = module.isa()
    try:
        kernels._enable_amx(module)
    except KernelUnavailable as e:
        pytest.skip(str(e))
    assert module.isa() == "amx"
    yield module
    module.set_kernel(SET_KERNEL_NAME.get(original, original))


@pytest.mark.parametrize("kind", TYPES)
def test_amx_gives_the_bits_of_the_vnni_kernel(kind, amx_module):
    module = amx_module
    rng = np.random.default_rng(11)
    block = LAYOUTS[kind].block_size
    for cols in sorted({block * 2, 1536}):  # two super-blocks (or 16 sub-blocks), and a 1.5B model's width
        if cols % block:
            continue
        data = encode(rng.standard_normal((48, cols)).astype(np.float32) * 0.05, kind, rng)
        layer = GGUFLinear([pack(kind, data, 48, cols)])
        x = torch.randn(40, cols, generator=torch.Generator().manual_seed(12))
        for rows in (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 40):
            module.set_kernel("avx512_vnni")
            vnni = layer(x[:rows])
            module.set_kernel("amx")
            assert torch.equal(layer(x[:rows]), vnni), (kind, cols, rows)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_the_default_tiles_give_the_bits_of_the_vnni_kernel(kind, amx_module):
    """The default ("auto") multiplies Q4_K and Q5_K products of 32 rows or more on the tiles, the
    rest on the VNNI kernel: the same bits either way, around the threshold and over a few tiles of rows."""
    module = amx_module
    rng = np.random.default_rng(15)
    data = encode(rng.standard_normal((48, 1536)).astype(np.float32) * 0.05, kind, rng)
    layer = GGUFLinear([pack(kind, data, 48, 1536)])
    x = torch.randn(100, 1536, generator=torch.Generator().manual_seed(16))
    for rows in (2, 16, 31, 32, 47, 100):
        module.set_kernel("avx512_vnni")
        vnni = layer(x[:rows])
        module.set_kernel("auto")
        assert module.isa() == "avx512_vnni+amx"
        assert torch.equal(layer(x[:rows]), vnni), (kind, rows)


def test_set_kernel_refuses_a_kernel_the_build_lacks():
    module = qmatmul()
    with pytest.raises(RuntimeError, match="has no avx1024 kernel"):
        module.set_kernel("avx1024")
    assert module.isa() in ("amx", "avx512_vnni+amx", "avx512_vnni", "avx_vnni", "avx2")


PRODUCTS_SCRIPT = """
import sys
import numpy as np, torch
sys.path.insert(0, {tests!r})
from gguf_files import encode
from specdec.kernels import qmatmul
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_quants import LAYOUTS, pack
assert qmatmul().isa() == {kernel!r}, qmatmul().isa()
rng = np.random.default_rng(13)
out = {{}}
for kind in sorted(LAYOUTS):
    cols = 2 * LAYOUTS[kind].block_size if LAYOUTS[kind].block_size == 256 else 96
    data = encode(rng.standard_normal((48, cols)).astype(np.float32) * 0.05, kind, rng)
    layer = GGUFLinear([pack(kind, data, 48, cols)])
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(14))
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17, 24, 31, 32, 33):
        out[kind, rows] = layer(x[:rows])
torch.save(out, {path!r})
"""


@pytest.mark.skipif("avx_vnni" not in cpu_flags(), reason="the CPU has no AVX-VNNI")
@pytest.mark.slow
def test_avx_vnni_gives_the_bits_of_the_avx2_kernel(tmp_path):
    """Each kernel in a process held to it (and PyTorch to AVX2), for every packed type and 1-33 rows."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for kernel in ("avx2", "avx_vnni"):
        script = PRODUCTS_SCRIPT.format(tests=tests, kernel=kernel, path=str(tmp_path / f"{kernel}.pt"))
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", kernels.KERNEL_ENV: kernel}
        subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=600)
    avx2, avx_vnni = (torch.load(tmp_path / f"{kernel}.pt") for kernel in ("avx2", "avx_vnni"))
    assert avx2.keys() == avx_vnni.keys()
    for key in avx2:
        assert torch.equal(avx_vnni[key], avx2[key]), key


# Q6_K: the AVX-512 kernel weighs each 16-input sub-block's sum by its scale in float32, AVX2 sums
# them in integers first (docs/runner.md, "AMX tiles"): the last bits differ
SAME_BITS_ON_AVX2_AND_AVX512 = [kind for kind in TYPES if kind != "Q6_K"]


@pytest.mark.slow
def test_avx512_gives_the_bits_of_the_avx2_kernel_for_every_type_but_q6_k(tmp_path, monkeypatch):
    """Q4_K and Q5_K: both sum a super-block's sc_s * dot_s in integers and take the same float
    steps from there (qmatmul.cpp's group_tile_k); the legacy types: the same integer sum per
    sub-block (Q8_0's too: AVX2 sums x (code - 128) and starts from 128 xs) and the same float
    steps. So a model of these types gives the same bits on every x86 CPU; Q6_K's products agree to
    float32 rounding. The AVX-512 side is this process's own build (the amx build's default uses
    its tiles from 32 rows)."""
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    if variant() not in ("amx", "avx512_vnni"):
        pytest.skip("no AVX-512 VNNI here (or PyTorch held below it)")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    held = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", kernels.KERNEL_ENV: "avx2"}, qmatmul().isa(): {}}
    for kernel, env in held.items():
        script = PRODUCTS_SCRIPT.format(tests=tests, kernel=kernel, path=str(tmp_path / f"{kernel}.pt"))
        subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, **env}, timeout=600)
    avx2, avx512 = (torch.load(tmp_path / f"{kernel}.pt") for kernel in held)
    keys = [key for key in avx2 if key[0] in SAME_BITS_ON_AVX2_AND_AVX512]
    assert len(keys) == 13 * len(SAME_BITS_ON_AVX2_AND_AVX512)  # 13 row counts, the default's tiles at 32 and 33
    for key in keys:
        assert torch.equal(avx512[key], avx2[key]), key
    for key in avx2.keys() - set(keys):  # Q6_K: the same integer products, float32 rounding apart
        assert (avx2[key] - avx512[key]).abs().max() <= 1e-6 * avx512[key].abs().max(), key
