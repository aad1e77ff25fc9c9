"""Hugging Face checkpoint names <-> this package's fused parameters, and writing a model
directory that transformers loads too.

Hugging Face stores q_proj, k_proj, v_proj and gate_proj, up_proj separately; LlamaModel
holds qkv_proj = [q; k; v] and gate_up_proj = [gate; up] (one matmul each). Everything
else keeps its name, without the "model." prefix.
"""

from __future__ import annotations

import json
import os
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
    from specdec.models.cpu_linear import PackedLinear

    packed = [name for name, module in model.named_modules() if isinstance(module, PackedLinear)]
    if packed:  # their weights live in oneDNN's layout, outside the state dict
        raise ValueError(
            f"the model's linear layers are packed for oneDNN ({packed[:2]}...), and their weights "
            "cannot be saved; save a model load_pretrained gave, before a ModelRunner runs it eagerly "
            "(which packs it)"
        )
    c = model.config
    split_sizes = {
        "self_attn.qkv_proj": [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2,
        "mlp.gate_up_proj": [c.intermediate_size] * 2,
    }
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "inv_freq" or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        if "." not in name:  # a buffer of the model itself (output_token_ids)
            out[f"model.{name}"] = tensor
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
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling or None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        **({"output_vocab_size": config.output_vocab_size} if config.output_vocab_size else {}),
        **(extra or {}),
    }


SHARD_BYTES = 15_000_000  # the largest safetensors file save_pretrained writes (15 MB, as in "15MB")
WEIGHT_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def save_pretrained(
    model: LlamaModel,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    extra_config: dict | None = None,
    *,
    max_shard_bytes: int = SHARD_BYTES,
    tokenizer=None,
    eos_token_id: int | None = None,
) -> Path:
    """Write a Hugging Face directory for a plain-Llama LlamaModel that transformers loads too.

    Weights: model.safetensors if they fit in max_shard_bytes, else shards
    model-0000i-of-0000n.safetensors of at most max_shard_bytes each (a single tensor larger
    than that gets a shard of its own) listed in model.safetensors.index.json. Weight files a
    previous save left in the directory are removed first.
    tokenizer: a `tokenizers.Tokenizer`, written as tokenizer.json with a tokenizer_config.json.
    eos_token_id: the end-of-sequence token, written to config.json (as bos_token_id too: a
        document starts after the previous one's end) and generation_config.json.
    """
    path = Path(path)
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes > 0):
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in to_hf(model).items()}  # checks it first
    path.mkdir(parents=True, exist_ok=True)
    save_weights(state, path, max_shard_bytes)
    ids = {} if eos_token_id is None else {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
    _write_json(path / "config.json", hf_config_dict(model.config, dtype, {**ids, **(extra_config or {})}))
    if ids:
        _write_json(path / "generation_config.json", ids)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path, model.config.max_position_embeddings, eos_token_id)
    return path


def save_weights(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int = SHARD_BYTES) -> None:
    """state (Hugging Face names) as model.safetensors, or as shards with an index when it is
    larger than max_shard_bytes; weight files already in path are removed first, and so are the
    ones written when a write fails (a full disk): no weights are left half-written."""
    _remove_weight_files(path)
    try:
        _write_weights(state, path, max_shard_bytes)
    except BaseException:
        _remove_weight_files(path)
        raise


def _write_weights(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int) -> None:
    shards = plan_shards(state, max_shard_bytes)
    if len(shards) == 1:
        _save_safetensors(state, path / WEIGHT_FILE)
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors({name: state[name] for name in names}, path / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(path / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def save_hf_directory(
    path: Path,
    weights: dict[str, torch.Tensor],
    config: dict,
    tokenizer,
    tokenizer_config: dict,
    generation_config: dict,
    max_shard_bytes: int = 2_000_000_000,
) -> Path:
    """A Hugging Face directory from its parts (a GGUF file's, say): config.json, the weights
    (shards of at most max_shard_bytes), tokenizer.json (a `tokenizers.Tokenizer`),
    tokenizer_config.json and generation_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    save_weights(weights, path, max_shard_bytes)
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", generation_config)
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", tokenizer_config)
    return path


def _save_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """A safetensors file with the permissions of any other new file (safetensors writes 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def plan_shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into files of at most max_shard_bytes (tensor data plus
    a generous allowance for the file's JSON header)."""
    shards, current, current_bytes = [], [], 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size() + len(name) + 128  # header entry: name, dtype, shape, offsets
        if current and current_bytes + size > max_shard_bytes - 64:  # 64: the header's own framing
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return shards + [current] if current else shards


def save_tokenizer(tokenizer, path: Path, model_max_length: int, eos_token_id: int | None) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers' AutoTokenizer reads as
    the same tokenizer (PreTrainedTokenizerFast over tokenizer.json, no text clean-up)."""
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if eos_token_id is not None:
        config["eos_token"] = tokenizer.id_to_token(eos_token_id)
    _write_json(path / "tokenizer_config.json", config)


def _remove_weight_files(path: Path) -> None:
    for file in [path / WEIGHT_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        file.unlink(missing_ok=True)


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")
