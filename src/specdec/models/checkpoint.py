"""Hugging Face checkpoint names <-> this package's fused parameters, and writing a model
directory that transformers loads too.

Hugging Face stores q_proj, k_proj, v_proj and gate_proj, up_proj separately; LlamaModel
holds qkv_proj = [q; k; v] and gate_up_proj = [gate; up] (one matmul each). Everything
else keeps its name, without the "model." prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.llama import LlamaModel, ModelConfig

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> LlamaModel's (fusing projections). Tensors are not copied
    except where fused; names this mapping does not know pass through unchanged."""
    out = {key.removeprefix("model."): t for key, t in state.items() if not key.endswith("rotary_emb.inv_freq")}
    for layer_prefix in sorted({k.rsplit(".self_attn.", 1)[0] for k in out if ".self_attn." in k}):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer_prefix}.{part}.{kind}" for part in parts]
                if all(n in out for n in names):
                    out[f"{layer_prefix}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def to_hf(model: LlamaModel) -> dict[str, torch.Tensor]:
    """LlamaModel parameters -> Hugging Face names (splitting fused projections)."""
    c = model.config
    split_sizes = {"self_attn.qkv_proj": [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2,
                   "mlp.gate_up_proj": [c.intermediate_size] * 2}
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "inv_freq" or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        module, kind = name.rsplit(".", 1)
        fused = next((f for f in FUSED if module.endswith(f)), None)
        if fused is None:
            out[name if name.startswith("lm_head") else f"model.{name}"] = tensor
            continue
        layer_prefix = module[: -len(fused) - 1]
        for part, piece in zip(FUSED[fused], tensor.split(split_sizes[fused], dim=0)):
            out[f"model.{layer_prefix}.{part}.{kind}"] = piece
    return {name: t.detach().contiguous() for name, t in out.items()}


def hf_config_dict(config: ModelConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """A config.json that names LlamaForCausalLM (for configs without Qwen/Mistral switches)."""
    if config.qk_norm or config.sliding_windows or (config.qkv_bias != config.o_bias):
        raise ValueError("hf_config_dict writes plain Llama configs only")
    scaling = dict(config.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": scaling or None, "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias, "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {}),
    }


def save_pretrained(model: LlamaModel, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                    extra_config: dict | None = None) -> Path:
    """Write config.json and model.safetensors for a plain-Llama LlamaModel."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: t.to(dtype) for name, t in to_hf(model).items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_dict(model.config, dtype, extra_config), indent=2))
    return path
