"""Linear layers with their weights prepacked for oneDNN, for running on the CPU.

Decoding multiplies a few rows of activations by every weight matrix: pure weight
streaming. PyTorch's plain bf16 CPU matmul re-lays out the weight on every call; oneDNN's
prepacked (blocked) layout is made once at load time, and on this project's machines it
roughly halves the time of a decode step's matmuls (benchmarks/bench_core.py). In float32
PyTorch's plain matmul (MKL) rounds a row differently by how many rows share the product (one
row runs a matrix-vector kernel, a few rows another), so a request's tokens would depend on
its batch; oneDNN's product, laid out for 64 rows (PACKED_FOR_ROWS), gives each row the same
bits whatever the rows around it on the AMD EPYCs, and on a Sapphire Rapids once run as
ProductShape says (one row as two; bfloat16 at most 32 rows a call), which rows_per_product
finds by probing once per process (tests/engine/test_batch_independence.py). On the 2-core
AMD EPYC (AVX2) it is also faster: 0.25-1.05x of F.linear's time for 1, 4 and 300 rows. Same
arithmetic up to rounding order; the model code is untouched: `pack_linears` swaps modules
after loading.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

# The number of rows oneDNN lays a weight out for (its batch-size hint). In float32 a layout for
# one row runs that row with another kernel than a layout for 64 (on the AMD EPYC, AVX2: a row's
# bits then depend on how many rows share the product); laid out for 64, every row gets the same
# bits for 1 to 600 rows, in 0.25-1.05x F.linear's time (1, 4 and 300 rows, K x N from
# 512 x 1536 to 576 x 49152). bfloat16 takes the same layout, for the same reason; its speed is
# measured only where oneDNN runs bfloat16 (not on that machine). No layout hint (1, 16, 32, 64,
# 128, 512) made a Sapphire Rapids' products row-independent by itself: ProductShape does.
PACKED_FOR_ROWS = 64


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (bfloat16 or float32). weight_dtype:
    round the weight (and bias) to it first (None: the linear's own dtype)."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = linear.weight.detach(), linear.bias
        if weight_dtype is not None:
            weight = weight.to(weight_dtype)
            bias = None if bias is None else nn.Parameter(bias.detach().to(weight_dtype), requires_grad=False)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        out = product_by_rows(self._product, rows, rows_per_product(x.dtype))  # [M, N]
        return out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [None], "")


class Bf16PackedLinear(PackedLinear):
    """A PackedLinear inside a float32 model: the weight rounded to bfloat16, the input cast
    to bfloat16 and the output back to float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, weight_dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(torch.bfloat16)).to(x.dtype)


def pack_large_linears_in_bf16(model: nn.Module, min_weight_bytes: int) -> None:
    """In a float32 model, replace the nn.Linear layers whose weight holds at least
    min_weight_bytes by Bf16PackedLinear (in place). For a small draft model on the CPU: its
    small matrices run faster in float32, while the big ones (in a small draft, typically only
    the output layer, vocabulary x hidden) are big enough that halving their bytes pays
    (benchmarks/bench_draft.py)."""
    replace_linears(
        model, Bf16PackedLinear, lambda linear: linear.weight.numel() * linear.weight.element_size() >= min_weight_bytes
    )


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of dtype on device can be prepacked (a CPU with oneDNN; bfloat16 where
    oneDNN runs it) and the packed product checks out against F.linear here."""
    packable = (torch.bfloat16, torch.float32)
    if device.type != "cpu" or dtype not in packable or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        return _packed_matches_plain(dtype)
    except (RuntimeError, AttributeError):  # an op this build or CPU lacks
        return False


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear inside model by a PackedLinear (in place)."""
    replace_linears(model, PackedLinear)


def replace_linears(model: nn.Module, replacement, chosen=lambda linear: True) -> None:
    """Swap each nn.Linear inside model for which chosen(linear) holds by replacement(linear)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and chosen(child):
                setattr(parent, name, replacement(child))


@dataclass(frozen=True)
class ProductShape:
    """How many rows one oneDNN product may take so that each row gets the bits it gets alone.

    pad_one_row  a single row is run as two (itself twice) and the first kept: oneDNN runs one
                 row with another kernel than two or more, which rounds differently (float32 on a
                 Sapphire Rapids, K of 1536 and more)
    max_rows     products of more rows are run in chunks of this many (None: any number): on a
                 Sapphire Rapids oneDNN's AMX bfloat16 kernel blocks 2-32 rows one way and more
                 another; on the AMD EPYCs seen, 1-600 rows all gave the same bits
    """

    pad_one_row: bool = False
    max_rows: int | None = None

    def __post_init__(self):
        if self.max_rows is not None and self.max_rows < 2:
            raise ValueError(f"max_rows must be at least 2 (or None), got {self.max_rows}")


PROBE_SHAPES = ((1536, 1536), (8960, 1536), (1024, 384))  # (K, N): where the Sapphire Rapids' kernels differed
PROBE_ROWS = (3, 17, 32, 33, 48, 64, 100)
CHUNK_CANDIDATES = (None, 32, 16)


def product_by_rows(product, rows: torch.Tensor, shape: ProductShape) -> torch.Tensor:
    """product (a [M, K] -> [M, N] oneDNN product) of rows [M, K], run as shape says."""
    if shape.max_rows is not None and rows.shape[0] > shape.max_rows:
        return torch.cat([product_by_rows(product, chunk, shape) for chunk in rows.split(shape.max_rows)])
    if rows.shape[0] == 1 and shape.pad_one_row:
        return product(rows.expand(2, -1).contiguous())[:1]  # [2, K] -> [1, N]
    return product(rows)


@functools.cache
def rows_per_product(dtype: torch.dtype) -> ProductShape:
    """This machine's ProductShape for dtype, probed once (a fraction of a second): every row of
    products of PROBE_ROWS rows against the same row run in a product of two, on PROBE_SHAPES,
    for each candidate max_rows in turn. Tests check the answer on more shapes
    (tests/engine/test_batch_independence.py)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return ProductShape()
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ProductShape()  # nothing packs bfloat16 here (can_pack's answer, asked without recursing)
    g = torch.Generator().manual_seed(0)
    probes = []  # (product, x [max rows, K], each row's output in a product of two [max rows, N])
    for k, n in PROBE_SHAPES:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g).to(dtype), PACKED_FOR_ROWS)

        def product(x: torch.Tensor, packed=packed) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")

        x = torch.randn(max(PROBE_ROWS), k, generator=g).to(dtype)
        pairs = torch.cat([product(row.expand(2, -1).contiguous())[:1] for row in x.split(1)])
        probes.append((product, x, pairs))
    pad = not all(torch.equal(torch.cat([product(row) for row in x.split(1)]), pairs) for product, x, pairs in probes)
    for max_rows in CHUNK_CANDIDATES:
        shape = ProductShape(pad_one_row=pad, max_rows=max_rows)
        if all(
            torch.equal(product_by_rows(product, x[:rows], shape), pairs[:rows])
            for product, x, pairs in probes
            for rows in PROBE_ROWS
        ):
            return shape
    raise RuntimeError(
        f"oneDNN's {dtype} products give a row other bits by the rows beside it, however chunked "
        f"({CHUNK_CANDIDATES}): load the model in another dtype, or report this CPU"
    )


@functools.cache
def _packed_matches_plain(dtype: torch.dtype) -> bool:
    """A one-off check that the packed op computes what F.linear does on this machine."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g))
        x = torch.randn(2, 3, 64, generator=g).to(dtype)
        expected = linear(x).float()
        got = PackedLinear(linear)._product(x).float()
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-1))
