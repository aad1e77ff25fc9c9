"""Weight-only quantized linear layers (int8 per output channel, int4 group-wise) on the CPU.

Decoding streams every weight once per step, so its speed follows the weight bytes: int8
halves a bfloat16 model's and quarters a float32 one's, int4 halves them again. Only the
weights are quantized; activations, attention, norms and the KV cache keep the model's dtype.

Kernels: PyTorch's own, `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu`.
They are fast with bfloat16 activations on AVX-512 and on AVX2 alike (they widen to float32
inside), and an order of magnitude slower with float32 ones (a scalar path), so a quantized layer
of a float32 model casts its input to bfloat16 and its output back (benchmarks/bench_quant.py).
torchao's int8 weight-only layer was measured too (0.18.0): in eager mode it dequantizes the
whole weight every call, far slower than _weight_int8pack_mm, so it pays only under
torch.compile; these kernels pay in both modes (docs/runner.md, "Weight-only quantization").

Numbers (the kernels hold scales and zeros in bfloat16: each is rounded first, a scale
upwards so that no weight falls outside the range, and q is rounded against the stored values):
  int8  W ~ q * s, q in [-127, 127] per output row n, s_n = max|W_n| / 127 (symmetric).
  int4  W ~ (q - 8) * s + z per group of INT4_GROUP_SIZE inputs, q in [0, 15],
        s = (max - min) / 15, z = min + 8 s (asymmetric: the kernel's layout, as in gpt-fast).
int4 needs the output size to be a multiple of 16 and the input size of the group size; a
layer that is not keeps int8 (`quantize_linears` says how many did).

Each row's result is the same whatever else is in the batch (checked in tests), so
speculation stays exact with respect to the quantized model.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from specdec.config import check_quantization_name
from specdec.models.cpu_linear import replace_linears

INT4_GROUP_SIZE = 32  # inputs per int4 scale; docs/runner.md compares 32, 64 and 128
KERNEL_DTYPE = torch.bfloat16  # the activations' dtype inside the kernels


def check_quantization(quantization: str | None, device: torch.device, what: str = "quantization") -> str | None:
    """quantization if this device has its kernel, else a ValueError naming the valid choices."""
    check_quantization_name(quantization, what)
    if quantization in (None, "auto"):  # "auto": a GGUF file's own quantization, checked as it loads
        return quantization
    if device.type != "cpu":
        raise ValueError(
            f"{what}={quantization!r} runs on the CPU kernels only, and the device is {device}; "
            "use quantization=None there (CUDA int8/int4 is not built yet)"
        )
    kernel = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}[quantization]
    if not hasattr(torch.ops.aten, kernel):
        raise ValueError(
            f"{what}={quantization!r} needs torch.ops.aten.{kernel}, which this PyTorch "
            f"({torch.__version__}) lacks; use one of None, 'int8'"
        )
    return quantization


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 [N, K] and one scale per output row."""

    weight_int8: torch.Tensor  # buffers
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [N, K]
        scales = stored_scale(weight.abs().amax(dim=1) / 127)  # [N]
        self.register_buffer(
            "weight_int8", torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized_weight(self) -> torch.Tensor:
        """W as the kernel sees it, [N, K] float32 (for tests and error measurements)."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [..., K] -> [M, K]
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales)  # [M, N]
        return _finish(y, x, self.out_features, self.bias)


class Int4Linear(nn.Module):
    """y = x W^T + b with W as int4 in groups of group_size inputs, packed for the CPU kernel."""

    packed_weight: torch.Tensor  # buffers
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        N, K = self.out_features, self.in_features
        groups = linear.weight.detach().float().view(N, K // group_size, group_size)  # [N, K/G, G]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/G]
        scales = stored_scale((high - low) / 15)  # [N, K/G]
        zeros = (low + 8 * scales.float()).to(KERNEL_DTYPE)  # so that W = (q - 8) * s + z
        q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8  # [N, K/G, G]
        q = q.clamp(0, 15).to(torch.int32)
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(N, K), 1))
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1)  # [K/G, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def fits(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
        """Whether the kernel takes this layer's shape."""
        return linear.out_features % 16 == 0 and linear.in_features % group_size == 0

    def dequantized_weight(self) -> torch.Tensor:
        """W as the kernel sees it, [N, K] float32: the kernel applied to the identity."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)  # [K, K]
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed_weight, self.group_size, self.scales_and_zeros)
            .float()
            .t()
        )  # [K, N] -> [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [..., K] -> [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed_weight, self.group_size, self.scales_and_zeros
        )  # [M, N]
        return _finish(y, x, self.out_features, self.bias)


def stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """A float32 scale as the kernel holds it: in bfloat16, rounded up (never below the float32
    one: the largest weight of a row or group still fits the integer range), and never zero."""
    tiny = torch.finfo(KERNEL_DTYPE).tiny
    return (scale.clamp(min=tiny) * (1 + 2**-7)).to(KERNEL_DTYPE)  # nearest of a value 2^-7 up: >= scale


def _finish(y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's [M, N] output back in x's shape [..., N] and dtype, plus the bias."""
    y = y.to(x.dtype).view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def quantize_linears(model: nn.Module, quantization: str) -> dict[str, int]:
    """Replace every nn.Linear inside model by its quantized layer (in place); returns how many
    layers took each form ({"int4": 84, "int8": 1}, say: int4 layers whose shape the kernel
    does not take are int8). A tied output layer gets its own quantized copy; the embedding
    it shared stays as it was."""

    def quantized(linear: nn.Linear) -> nn.Module:
        return Int4Linear(linear) if quantization == "int4" and Int4Linear.fits(linear) else Int8Linear(linear)

    replace_linears(model, quantized)
    forms = Counter(
        "int4" if isinstance(m, Int4Linear) else "int8"
        for m in model.modules()
        if isinstance(m, (Int8Linear, Int4Linear))
    )
    return dict(forms)
