"""Linear layers with their weights prepacked for oneDNN, for running on the CPU.

Decoding multiplies a few rows of activations by every weight matrix: pure weight
streaming. PyTorch's plain bf16 CPU matmul re-lays out the weight on every call; oneDNN's
prepacked (blocked) layout is made once at load time, and on this project's machines it
roughly halves the time of a decode step's matmuls (benchmarks/bench_core.py). In float32
PyTorch's plain matmul (MKL) rounds a row differently by how many rows share the product (one
row runs a matrix-vector kernel, a few rows another), so a request's tokens would depend on
its batch; oneDNN's product, laid out for 64 rows (PACKED_FOR_ROWS), gives each row the same
bits whatever the rows around it (tests/engine/test_batch_independence.py), and on the 2-core
AMD EPYC (AVX2) it is also faster: 0.25-1.05x of F.linear's time for 1, 4 and 300 rows. Same
arithmetic up to rounding order; the model code is untouched: `pack_linears` swaps modules
after loading.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# The number of rows oneDNN lays a weight out for (its batch-size hint). In float32 a layout for
# one row runs that row with another kernel than a layout for 64 (on the AMD EPYC, AVX2: a row's
# bits then depend on how many rows share the product); laid out for 64, every row gets the same
# bits for 1 to 600 rows, in 0.25-1.05x F.linear's time (1, 4 and 300 rows, K x N from
# 512 x 1536 to 576 x 49152). bfloat16 takes the same layout, for the same reason; its speed is
# measured only where oneDNN runs bfloat16 (not on that machine).
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


@functools.cache
def _packed_matches_plain(dtype: torch.dtype) -> bool:
    """A one-off check that the packed op computes what F.linear does on this machine."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g))
        x = torch.randn(2, 3, 64, generator=g).to(dtype)
        expected = linear(x).float()
        got = PackedLinear(linear)(x).float()
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-1))
