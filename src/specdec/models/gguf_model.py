"""A LlamaModel whose matrices stay as a GGUF file's quantized tensors (GGUFLinear and
GGUFEmbedding in place of nn.Linear and nn.Embedding); norms, biases and any float matrices
are ordinary tensors in the model's dtype. The model code is unchanged: only modules differ.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specdec.models.checkpoint import FUSED, to_hf
from specdec.models.errors import ModelLoadError
from specdec.models.gguf_layer import fused_layer
from specdec.models.gguf_linear import GGUFMLP, GGUFEmbedding, GGUFLinear, dequantize
from specdec.models.gguf_quants import PackedTensor
from specdec.models.llama import DecoderLayer, LlamaModel, ModelConfig, rope_inverse_frequencies

log = logging.getLogger("specdec")


def build_quantized_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    packed: dict[str, PackedTensor],
    dtype: torch.dtype,
    path: Path,
) -> LlamaModel:
    """A LlamaModel (CPU) from Hugging Face names: weights (float) and packed (quantized)."""
    shapes = {
        **{name: tuple(t.shape) for name, t in weights.items()},
        **{name: (p.rows, p.cols) for name, p in packed.items()},
    }
    with torch.device("meta"):
        model = LlamaModel(config)
    _check_names(model, shapes, path)
    tensors = {**weights, **packed}
    for module_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            _set_module(model, module_name, _linear(module_name, tensors, dtype, config))
    embedding = tensors["model.embed_tokens.weight"]
    model.embed_tokens = (  # pyright: ignore[reportAttributeAccessIssue]  # a GGUFEmbedding where quantized
        GGUFEmbedding(embedding, dtype)
        if isinstance(embedding, PackedTensor)
        else nn.Embedding.from_pretrained(embedding.to(dtype), freeze=True)
    )
    rest = {
        name.removeprefix("model."): t.to(dtype)
        for name, t in weights.items()
        if not _is_matrix_name(name) and name != "model.embed_tokens.weight"
    }
    model.load_state_dict(rest, strict=False, assign=True)
    model.inv_freq = rope_inverse_frequencies(config)
    left_on_meta = [name for name, t in model.state_dict().items() if t.is_meta]
    if left_on_meta:
        raise ModelLoadError(f"{path}: tensors {left_on_meta[:3]} were not loaded")
    for i, layer in enumerate(model.layers):  # DecoderLayers (ModuleList yields Modules)
        fuse_into_kernels(layer)  # pyright: ignore[reportArgumentType]
        model.layers[i] = fused_layer(layer)  # pyright: ignore[reportArgumentType]
    return model.eval().requires_grad_(False)


def fuse_into_kernels(layer: DecoderLayer) -> None:
    """Give a decoder layer's quantized matrices the work around them: each RMSNorm goes into the
    one matrix that reads its output (q/k/v after input_layernorm, gate/up after
    post_attention_layernorm) and the MLP's gate into its down projection. The layer computes the
    same function (in float32 where it was in the model's dtype) with fewer ops per token."""
    attention, mlp = layer.self_attn, layer.mlp
    if isinstance(attention.qkv_proj, GGUFLinear):
        attention.qkv_proj.fuse_input(norm=layer.input_layernorm)
        layer.input_layernorm = nn.Identity()  # pyright: ignore[reportAttributeAccessIssue]  # fused into the matrix
    if isinstance(mlp.gate_up_proj, GGUFLinear):
        mlp.gate_up_proj.fuse_input(norm=layer.post_attention_layernorm)
        layer.post_attention_layernorm = nn.Identity()  # pyright: ignore[reportAttributeAccessIssue]
        if isinstance(mlp.down_proj, GGUFLinear):
            layer.mlp = GGUFMLP(mlp.gate_up_proj, mlp.down_proj)  # pyright: ignore[reportAttributeAccessIssue]


def _check_names(model: LlamaModel, shapes: dict[str, tuple], path: Path) -> None:
    expected = {name: tuple(t.shape) for name, t in to_hf(model).items()}
    if model.config.tie_word_embeddings:
        shapes = {name: shape for name, shape in shapes.items() if name != "lm_head.weight"}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: the file's tensors do not match its metadata: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {shapes[name]}, the metadata implies {shape}")


def _is_matrix_name(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj.bias")) or name == "lm_head.weight"


def _hf_parts(module_name: str) -> list[str]:
    """A LlamaModel linear layer's name -> the Hugging Face names of the matrices it stacks."""
    if module_name == "lm_head":
        return ["lm_head"]
    fused = next((f for f in FUSED if module_name.endswith(f)), None)
    if fused is None:
        return [f"model.{module_name}"]
    prefix = module_name[: -len(fused)]
    return [f"model.{prefix}{part}" for part in FUSED[fused]]


def _linear(module_name: str, tensors: dict, dtype: torch.dtype, config: ModelConfig) -> nn.Module:
    names = _hf_parts(module_name)
    if module_name == "lm_head" and config.tie_word_embeddings:
        names = ["model.embed_tokens"]
    parts = [tensors[f"{name}.weight"] for name in names]
    biases = [tensors.get(f"{name}.bias") for name in names]
    bias = torch.cat(biases).to(dtype) if all(b is not None for b in biases) else None  # pyright: ignore[reportArgumentType]
    if all(isinstance(p, PackedTensor) for p in parts):
        return GGUFLinear(parts, bias)
    if any(isinstance(p, PackedTensor) for p in parts):  # a fused layer of quantized and float parts
        log.warning("%s: parts %s are quantized and float; the layer runs dequantized", module_name, names)
    weight = torch.cat([dequantize(p, torch.arange(p.rows)) if isinstance(p, PackedTensor) else p for p in parts])
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
