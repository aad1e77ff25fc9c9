"""A GGUF model's decoder layer, whose forwards over the cache run in one C++ call.

GGUFDecoderLayer holds the same submodules (and so the same names and function) as llama.
DecoderLayer, with its norms and the MLP's gate fused into the quantized products (gguf_model.
fuse_into_kernels). Every forward over the cache on the CPU (a decode step, a verify forward, a
prefill chunk) goes to kernels/layer.cpp's DecoderLayerPlan: norm, q/k/v, RoPE, the cache write,
attention (each query alone, as Attention does over the cache), the output projection, the MLP
and both residual adds, with no Python op between them. In the model the ops between a step's
products cost several times what they cost timed alone: each runs after a product has streamed
tens of megabytes of weights through the CPU's caches (docs/runner.md, "GGUF weights, run
quantized"). One path for every length also keeps a row's values independent of its batch: the
ordinary path's RoPE and norms are separate PyTorch ops that round differently, and a prompt
padded to a longer one's length would take it where the prompt alone would not. Forwards without
a cache (training) and off the CPU take the layer's ordinary path.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.kernels import qmatmul
from specdec.models.gguf_linear import GGUFMLP, GGUFLinear
from specdec.models.llama import DecoderLayer


class GGUFDecoderLayer(nn.Module):
    def __init__(self, layer: DecoderLayer, plan):
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        self.plan = _Shared(plan)  # a DecoderLayerPlan

    def forward(self, x, cos, signed_sin, mask, positions, cache, num_keys) -> torch.Tensor:
        """As DecoderLayer.forward; positions are where the tokens' keys and values go."""
        if cache is not None and x.device.type == "cpu" and not torch.compiler.is_compiling():
            if num_keys > cache.max_len:
                raise ValueError(f"position {num_keys - 1} is past the cache length {cache.max_len}")
            keys, values, blocks = cache.layer(self.self_attn.layer_index, x.shape[0])  # each row's blocks [B, M]
            flat = getattr(cache, "flat", None)  # x [1, N, hidden]: rows one after another (kv_cache.FlatRows)
            starts, row_keys = (None, None) if flat is None else (flat.starts, flat.num_keys)
            return self.plan.forward(
                x, cos, signed_sin, keys, values, blocks, positions, mask, num_keys, starts, row_keys
            )
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, mask, positions, cache, num_keys)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Shared:
    """A DecoderLayerPlan, which points into the layer's buffers and never changes: a copy of the
    model (runner._sharing_copy, which shares the buffers too) shares it."""

    def __init__(self, plan):
        self.forward = plan.forward

    def __deepcopy__(self, memo):
        return self


def _q_linear(linear: GGUFLinear):
    parts = linear.parts
    return qmatmul().QLinear(
        [p.codes for p in parts],
        [p.sc for p in parts],
        [p.mn for p in parts],
        [p.d for p in parts],
        [p.dmin for p in parts],
        linear.layouts,
        linear.padded_bias,
    )


def fused_layer(layer: DecoderLayer) -> nn.Module:
    """layer as a GGUFDecoderLayer where its parts allow (quantized products with fused norms and
    gate, no padded rows, no q/k norms), else layer itself."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = (
        attention.qkv_proj,
        attention.o_proj,
        getattr(mlp, "gate_up_proj", None),
        getattr(mlp, "down_proj", None),
    )
    if not (
        isinstance(mlp, GGUFMLP)
        and all(isinstance(m, GGUFLinear) and m.keep is None for m in linears)
        and attention.q_norm is None
        and attention.qkv_proj.norm_weight is not None
        and mlp.gate_up_proj.norm_weight is not None
        and attention.qkv_proj.eps == mlp.gate_up_proj.eps
    ):
        return layer
    qkv, o, gate_up, down = (_q_linear(m) for m in linears)  # pyright: ignore[reportArgumentType]  # GGUFLinear: checked above
    plan = qmatmul().DecoderLayerPlan(
        qkv,
        o,
        gate_up,
        down,
        attention.qkv_proj.norm_weight,
        mlp.gate_up_proj.norm_weight,
        attention.qkv_proj.eps,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
    )
    return GGUFDecoderLayer(layer, plan)
