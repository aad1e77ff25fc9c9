"""bfloat16 linear layers with their weights prepacked for oneDNN, for decoding on the CPU.

Decoding multiplies a few rows of activations by every weight matrix: pure weight
streaming. PyTorch's plain bf16 CPU matmul re-lays out the weight on every call; oneDNN's
prepacked (blocked) layout is made once at load time, and on this project's machines it
roughly halves the time of a decode step's matmuls (benchmarks/bench_core.py). Same
arithmetic up to bf16 rounding order; the model code is untouched: `pack_linears` swaps
modules after loading.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked bf16 layout. weight_dtype: round the
    weight (and bias) to it first (None: the linear's own dtype, which must be bf16)."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = linear.weight.detach(), linear.bias
        if weight_dtype is not None:
            weight = weight.to(weight_dtype)
            bias = None if bias is None else nn.Parameter(bias.detach().to(weight_dtype), requires_grad=False)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
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
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        return _packed_matches_plain()
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


def _packed_matches_plain() -> bool:
    """A one-off check that the packed op computes what F.linear does on this machine."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g))
        x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
        expected = linear(x).float()
        got = PackedLinear(linear)(x).float()
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-1))
