"""Float matrices quantized into GGUF block types, to run on specdec's GGUF kernels.

A small float model part that runs one row at a time (an EAGLE head's drafting step) pays
PyTorch's per-op cost on every op of every step; a GGUF file's layers do not, since their whole
decoder layer runs in one C++ call (gguf_layer.py) and each product reads int8 or 4-bit blocks.
`quantize_into_gguf_kernels` gives a float module's linear layers that form: each weight
quantized by the `gguf` package's own quantizer (the same bytes llama.cpp's quantize writes for
that type) and packed for kernels/qmatmul.cpp, each decoder layer's norms and gate fused into
its products, as for a model loaded from a GGUF file.

  Q8_0   8-bit codes, one float16 scale per 32 inputs (8.5 bits a weight)
  Q4_0   4-bit codes, one float16 scale per 32 inputs (4.5 bits a weight)
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch import nn

from specdec.models.cpu_linear import replace_linears
from specdec.models.gguf_layer import fused_layer
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_model import fuse_into_kernels
from specdec.models.gguf_quants import LAYOUTS, PackedTensor, pack
from specdec.models.llama import DecoderLayer

REQUANTIZE_TYPES = ("Q8_0", "Q4_0")  # what quantize_into_gguf_kernels makes


def quantize_matrix(weight: torch.Tensor, kind: str) -> PackedTensor:
    """weight [N, K] (float) as a PackedTensor of GGUF type kind (K a multiple of 32)."""
    from gguf import GGMLQuantizationType, quants

    if kind not in REQUANTIZE_TYPES:
        raise ValueError(f"quantizes into {REQUANTIZE_TYPES}, got {kind!r}")
    rows, cols = weight.shape
    block = LAYOUTS[kind].block_size
    if cols % block:
        raise ValueError(f"a {kind} matrix's rows must hold whole blocks of {block} inputs, got {cols}")
    values = weight.detach().float().cpu().numpy()  # [N, K]
    data = quants.quantize(values, GGMLQuantizationType[kind])  # [N, K / block x block bytes] uint8
    return pack(kind, np.ascontiguousarray(data), rows, cols)


def fits(linear: nn.Linear, kind: str) -> bool:
    return linear.in_features % LAYOUTS[kind].block_size == 0


def gguf_linear(linear: nn.Linear, kind: str) -> GGUFLinear:
    """linear's weight quantized into kind, its bias (if any) kept in float."""
    bias = None if linear.bias is None else linear.bias.detach().float()
    return GGUFLinear([quantize_matrix(linear.weight, kind)], bias)


def quantize_into_gguf_kernels(module: nn.Module, kind: str) -> dict[str, int]:
    """Replace module's nn.Linear layers by GGUFLinear layers of kind (in place; a layer whose
    input size is not a whole number of blocks stays float) and run each DecoderLayer in one C++
    call where its parts allow (gguf_layer.fused_layer). Returns how many layers took each form
    ({"Q4_0": 5, "float": 0}). The module's float linears must be on the CPU."""
    counts = Counter("quantized" if fits(m, kind) else "float" for m in module.modules() if isinstance(m, nn.Linear))
    replace_linears(module, lambda linear: gguf_linear(linear, kind), lambda linear: fits(linear, kind))
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DecoderLayer):
                fuse_into_kernels(child)
                setattr(parent, name, fused_layer(child))
    return {kind: counts["quantized"], "float": counts["float"]}
