"""specdec's quantized GGUF kernel (kernels/qmatmul.cpp) by rows: what a verify forward of
k + 1 tokens costs against a decode step, layer by layer.

For each matrix kind of the model (attention, MLP, output layer) one real tensor of the file is
packed and multiplied by 1..16 activation rows; the table gives the fastest of --repeats runs
(wall time) and the ratio to one row. One matrix is small enough to stay in the CPU's caches,
so a one-row product here runs faster than inside a whole model, where every weight comes from
memory; a layer's ratio here is an upper bound of what it costs in a model.

    .venv/bin/python benchmarks/bench_qmatmul.py [MODEL] [--threads N] [--rows 1,2,4,7,8,16]
        [--kernels avx512_vnni,auto,amx]

Each kernel the build holds gets a table (--kernels: some of them): on a Sapphire Rapids AVX-512
VNNI, auto (the default: AMX tiles for the Q4_K and Q5_K products of 32 rows or more) and amx
(the tiles for every product of 2 rows or more). Run it held to AVX2 with ATEN_CPU_CAPABILITY=avx2 or
SPECDEC_KERNEL=avx2 (the AVX2 kernel is then the one used).
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from specdec.kernels import qmatmul, variant
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_quants import LAYOUTS, pack
from specdec.models.registry import resolve_model

TENSORS = (
    "blk.0.attn_q.weight",
    "blk.0.attn_v.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_down.weight",
    "output.weight",
)


def timed(layer: GGUFLinear, x: torch.Tensor, repeats: int) -> float:
    layer(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,4,7,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kernels", default="", help="kernels to time (default: every one the build holds)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(n) for n in args.rows.split(",")]
    reader = gguf.GGUFReader(str(resolve_model(args.model)))
    tensors = {t.name: t for t in reader.tensors}
    module = qmatmul()
    original = module.isa()
    built = ["avx512_vnni", "auto", "amx"] if variant() == "amx" else [original]
    kernels = args.kernels.split(",") if args.kernels else built
    layers = {}
    for name in TENSORS:
        tensor = tensors.get(name)
        if tensor is not None and tensor.tensor_type.name in LAYOUTS:
            cols, n_rows = (int(n) for n in tensor.shape)
            packed = pack(tensor.tensor_type.name, np.asarray(tensor.data), n_rows, cols)
            layers[name] = (tensor.tensor_type.name, n_rows, cols, GGUFLinear([packed]))
    for kernel in kernels:
        module.set_kernel(kernel)
        print(f"\nkernel {kernel} (build {variant()}), {args.threads} threads; ms per product (x one row)")
        print(f"{'tensor':<24} {'type':<5} {'N x K':>14} " + " ".join(f"{f'{m} rows':>15}" for m in rows))
        for name, (kind, n_rows, cols, layer) in layers.items():
            times = [timed(layer, torch.randn(m, cols), args.repeats) * 1e3 for m in rows]
            cells = " ".join(f"{t:>7.3f} ({t / times[0]:>4.2f}x)" for t in times)
            print(f"{name:<24} {kind:<5} {f'{n_rows}x{cols}':>14} {cells}")
    module.set_kernel("auto" if original == "avx512_vnni+amx" else original)


if __name__ == "__main__":
    main()
