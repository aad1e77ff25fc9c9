"""Small GGUF files written with llama.cpp's own writer (gguf.GGUFWriter), as llama.cpp's
converter lays them out: its tensor names, its metadata keys, Q and K rows of Llama models
permuted, every matrix in one tensor type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from helpers import make_tokenizer

# where each K-quant block keeps its float16 scales (d, and dmin where there is one), in bytes:
# ggml's block_q2_K ... block_q6_K
QUANTIZABLE = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf.quants.quantize writes
K_QUANT_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_hf_model(arch: str = "llama", seed: int = 0, vocab_size: int = 300, tie: bool = True):
    """A transformers model of a shape every block size divides (hidden 256, intermediate 512)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=128 if arch == "qwen3" else 64,  # transformers reads no head_dim from a qwen3 GGUF
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    return model


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's reordering of a Llama Q or K projection's rows (convert_hf_to_gguf.py):
    each head's two halves interleaved."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{kind}"
    return {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[name]


def encode(values: np.ndarray, tensor_type: str, rng: np.random.Generator) -> np.ndarray:
    """values stored as tensor_type: quantized by the gguf package, or, for the K-quants (which
    it cannot quantize), random blocks with small float16 scales: then the file's values are
    not `values`, and only readers of the same file can be compared."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    if tensor_type == "F32":
        return values.astype(np.float32)
    if tensor_type == "F16":
        return values.astype(np.float16)
    if tensor_type in QUANTIZABLE:
        return gguf.quants.quantize(values.astype(np.float32), Q[tensor_type])
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q[tensor_type]]
    rows, columns = values.shape
    blocks = rng.integers(0, 256, size=(rows, columns // block_values, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS.get(tensor_type, ()):
        scales = rng.uniform(1e-3, 4e-3, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: Path,
    model,
    tensor_type: str = "F32",
    seed: int = 0,
    tokenizer=None,
    chat_template: str | None = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
    metadata: dict | None = None,
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """model (transformers, Llama / Qwen2 / Qwen3) written as llama.cpp writes a GGUF file:
    matrices as tensor_type, norms and biases as F32, the tokenizer (make_tokenizer's by
    default) as gpt2-style metadata; metadata: more key/value pairs; tensor_types: a type for
    some matrices (llama.cpp's names) other than tensor_type."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    config = model.config
    arch = config.model_type
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, tokenizer or make_tokenizer(config.vocab_size), chat_template)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, _value_type(value))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, config.num_key_value_heads)
        kind = (tensor_types or {}).get(gguf_name(name), tensor_type)
        stored = encode(values, kind, rng) if values.ndim == 2 else values.astype(np.float32)
        raw_type = Q[kind] if values.ndim == 2 and kind not in ("F32", "F16") else None
        writer.add_tensor(gguf_name(name), stored, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer, chat_template: str | None) -> None:
    state = json.loads(tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    special = {added["content"] for added in state["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _value_type(value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, list):
        return GGUFValueType.ARRAY
    return GGUFValueType.STRING
