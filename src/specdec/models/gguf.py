"""A GGUF file (llama.cpp's format) -> what a Hugging Face directory holds.

Terms:
  metadata     the file's key/value pairs ("llama.block_count", "tokenizer.ggml.tokens", ...),
               read with llama.cpp's own `gguf` package
  tensor type  how a tensor's values are stored: plain (F32, F16, BF16) or in quantized
               blocks (Q8_0, Q4_0, ... Q6_K); every one is dequantized by the `gguf` package's
               vectorised numpy code into float32, then cast to the chosen dtype
  row permutation  llama.cpp's converter reorders the rows of a Llama model's Q and K
               projections (each head's rotary pairs interleaved instead of split in halves);
               unpermute() undoes it, so the weights are the Hugging Face checkpoint's again

read_gguf(path) gives a GGUFCheckpoint: config.json's dict, the weights under Hugging Face
names, the tokenizer (tokenizers library) with its tokenizer_config.json and
generation_config.json. The loader builds a model from it as from a directory; `specdec
convert` writes it out as one. Every problem (not a GGUF file, cut short, an architecture or
tensor type this does not read) is a GGUFError naming the file and the problem.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.config import is_int, torch_dtypes
from specdec.models.errors import ModelLoadError, size_out_of_bounds
from specdec.models.gguf_quants import LAYOUTS, PackedTensor, pack

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

log = logging.getLogger("specdec")

# general.architecture -> the Hugging Face class (loader.SUPPORTED_ARCHITECTURES reads it)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_ARCHITECTURES = ("llama",)  # whose Q and K rows llama.cpp's converter permutes
TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)  # the tensor types read (and tested against transformers' own reader)
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DTYPE_OF = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# llama.cpp's tensor names -> Hugging Face's ("{i}" is the layer)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be read; the message names the file, the problem and what to do."""


@dataclass
class GGUFCheckpoint:
    hf_config: dict  # config.json
    weights: dict[str, torch.Tensor]  # Hugging Face names, in the dtype asked for
    tokenizer: RustTokenizer
    tokenizer_config: dict  # tokenizer_config.json (special tokens, chat template)
    generation_config: dict  # generation_config.json (bos / eos ids)
    tensor_types: dict[str, int]  # how many tensors the file held of each type, e.g. {"Q4_1": 210}
    packed: dict[str, PackedTensor] = field(default_factory=dict)  # quantized matrices kept (keep_quantized)


def read_gguf(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    weights_dtype: torch.dtype | None = None,
    keep_quantized: bool = False,
) -> GGUFCheckpoint:
    """The checkpoint a GGUF file holds. dtype: the checkpoint's dtype (config.json's
    torch_dtype); "auto" = the file's float type where all its matrices share one (F32, F16,
    BF16), else float32, which holds dequantized values exactly. weights_dtype: the dtype the
    weights are returned in, if not that one (float32 keeps every value as the file has it:
    a BF16 file's norms are F32). keep_quantized: quantized matrices of the types
    gguf_quants.LAYOUTS maps come back packed for specdec's kernel (checkpoint.packed), never
    as floats; the checkpoint's dtype is then bfloat16 ("auto" runs it in bfloat16 where that is
    native, float32 elsewhere: the activations' dtype)."""
    path = Path(path)
    if keep_quantized:
        return _read_quantized(path, dtype, weights_dtype)
    return _read(path, dtype, weights_dtype, keep_quantized)


def _read_quantized(path: Path, dtype, weights_dtype) -> GGUFCheckpoint:
    """read_gguf with keep_quantized, through the cache of packed files (gguf_cache.py): a file
    read for the first time is packed into the cache tensor by tensor, and the checkpoint
    returned maps its tensors from there."""
    from specdec.models import gguf_cache

    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    cached = gguf_cache.load(path)
    if cached is None:
        try:
            writer = gguf_cache.Writer(path)
        except OSError as e:
            log.warning("cannot cache packed weights in %s (%s): they stay in memory", gguf_cache.cache_dir(), e)
            return _read(path, dtype, weights_dtype, keep_quantized=True)
        try:
            checkpoint = _read(path, "auto", None, keep_quantized=True, sink=writer.add)
            writer.finish(
                {
                    "hf_config": checkpoint.hf_config,
                    "tokenizer_config": checkpoint.tokenizer_config,
                    "generation_config": checkpoint.generation_config,
                    "tensor_types": checkpoint.tensor_types,
                    "tokenizer": checkpoint.tokenizer.to_str(),
                }
            )
        except BaseException:
            writer.abandon()
            raise
        cached = gguf_cache.load(path)
        if cached is None:
            raise GGUFError(
                f"{path}: the packed weights just written to {gguf_cache.cache_dir()} cannot be read "
                "back; is the disk full?"
            )
    index, weights, packed = cached
    if not packed:  # nothing quantized: the file is read as floats
        return _read(path, dtype, weights_dtype, keep_quantized=False)
    from tokenizers import Tokenizer

    hf_config = dict(index["hf_config"])
    if dtype != "auto":
        hf_config["torch_dtype"] = str(_weight_dtype(dtype, {})).removeprefix("torch.")
    weights = {name: t.to(weights_dtype or DTYPE_OF[hf_config["torch_dtype"]]) for name, t in weights.items()}
    return GGUFCheckpoint(
        hf_config,
        weights,
        Tokenizer.from_str(index["tokenizer"]),
        index["tokenizer_config"],
        index["generation_config"],
        index["tensor_types"],
        packed,
    )


def read_gguf_tokenizer(path: str | Path) -> tuple[dict, RustTokenizer, dict]:
    """(config.json, the tokenizer, tokenizer_config.json) of a GGUF file, from its metadata
    alone: no tensor is read (what a front end that only tokenizes needs). From the cache of
    packed files where the file was packed before (gguf_cache.py: parsing a vocabulary's
    metadata takes seconds)."""
    from tokenizers import Tokenizer

    from specdec.models import gguf_cache

    path = Path(path)
    index = gguf_cache.load_index(path)
    if index is not None:
        return dict(index["hf_config"]), Tokenizer.from_str(index["tokenizer"]), index["tokenizer_config"]
    reader = _open(path)
    metadata = _metadata(reader, path)
    architecture = _architecture(metadata, path)
    hf_config = hf_config_from_metadata(metadata, architecture, path, torch.float32, reader)
    tokenizer, tokenizer_config = _tokenizer(metadata, hf_config, path)
    return hf_config, tokenizer, tokenizer_config


def _metadata(reader, path: Path) -> dict:
    """The file's key/value pairs (the reader's parsed fields released once copied)."""
    from specdec.models.gguf_tokenizer import metadata_from_reader

    try:
        metadata = metadata_from_reader(reader)
    except Exception as e:  # a field cut short or of a type the reader does not know
        raise GGUFError(
            f"{path}: the metadata cannot be read ({type(e).__name__}: {e}); the file is corrupt "
            "or cut short: download or convert it again"
        ) from e
    _release_fields(reader)  # its parsed fields (a vocabulary: ~0.5 GB of small arrays) are in metadata now
    return metadata


def _tokenizer(metadata: dict, hf_config: dict, path: Path) -> tuple[RustTokenizer, dict]:
    from specdec.models.gguf_tokenizer import GGUFTokenizerError, tokenizer_from_gguf

    try:
        tokenizer, tokenizer_config = tokenizer_from_gguf(metadata)
    except GGUFTokenizerError as e:
        raise GGUFError(f"{path}: {e}") from e
    tokenizer_config["model_max_length"] = hf_config["max_position_embeddings"]
    return tokenizer, tokenizer_config


def _read(path: Path, dtype, weights_dtype, keep_quantized: bool, sink=None) -> GGUFCheckpoint:
    """The file read directly; sink(name, tensor): each tensor goes there as it is read, and
    the checkpoint holds none."""
    reader = _open(path)
    metadata = _metadata(reader, path)
    architecture = _architecture(metadata, path)
    types = _tensor_types(reader, path)
    torch_dtype = _weight_dtype(dtype, types)
    keep_quantized = keep_quantized and has_packable_tensors(types)
    if keep_quantized and dtype == "auto":
        torch_dtype = torch.bfloat16
    hf_config = hf_config_from_metadata(metadata, architecture, path, torch_dtype, reader)
    weights, packed, names = {}, {}, set()
    for name, tensor in _hf_tensors(reader, architecture, hf_config, path, keep_quantized):
        if sink is not None:
            sink(name, tensor)
            names.add(name)
        elif isinstance(tensor, torch.Tensor):
            weights[name] = tensor.to(weights_dtype or torch_dtype)
        else:
            packed[name] = tensor
    hf_config["tie_word_embeddings"] = "lm_head.weight" not in {*weights, *packed, *names}
    tokenizer, tokenizer_config = _tokenizer(metadata, hf_config, path)
    return GGUFCheckpoint(
        hf_config,
        weights,
        tokenizer,
        tokenizer_config,
        _generation_config(metadata, hf_config),
        dict(sorted(types.items())),
        packed,
    )


def _release_fields(reader) -> None:
    """Drop the reader's parsed metadata fields and give the memory back to the system, so that
    it is not held while the weights are read."""
    reader.fields.clear()
    release_freed_memory()


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc keeps it otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # wrong magic, a header cut short, offsets past the end, ...
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')") from e
        raise GGUFError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e}); download or convert it again"
        ) from e


def _architecture(metadata: dict, path: Path) -> str:
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return architecture


def gguf_bits_per_weight(path: str | Path) -> float:
    """The bits a GGUF file stores per matrix weight, over all its matrices (norms and biases
    left out), from its header (memory-mapped: no tensor is read): a Q4_K_M file about 4.9, Q8_0
    8.5, a file of Q5_0 matrices with a Q8_0 embedding and output layer 6 to 7."""
    from gguf import GGML_QUANT_SIZES

    path = Path(path).expanduser()
    reader = _open(path)
    _tensor_types(reader, path)  # an unsupported type is named here
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    bits = 0.0
    for tensor in matrices:
        block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        bits += int(tensor.n_elements) * 8 * block_bytes / block_size
    return bits / max(sum(int(t.n_elements) for t in matrices), 1)


def _tensor_types(reader, path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    unsupported = sorted(set(counts) - set(TENSOR_TYPES))
    if unsupported:
        raise GGUFError(
            f"{path}: tensor type {', '.join(unsupported)} is not supported; supported: "
            f"{', '.join(TENSOR_TYPES)} (requantize the file with llama.cpp's llama-quantize)"
        )
    return counts


def _weight_dtype(dtype: str | torch.dtype, types: dict[str, int]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        dtypes = torch_dtypes()
        if dtype not in dtypes:
            raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(dtypes)}")
        return dtypes[dtype]
    matrix_types = set(types) - {"F32"} or {"F32"}  # norms are F32 in every file
    if len(matrix_types) == 1 and next(iter(matrix_types)) in FLOAT_TYPES:
        return getattr(torch, FLOAT_TYPES[next(iter(matrix_types))])
    return torch.float32


def hf_config_from_metadata(metadata: dict, architecture: str, path: Path, dtype: torch.dtype, reader) -> dict:
    """config.json's fields from the "<architecture>.*" metadata."""

    def get(key: str, default=None, required: bool = False) -> Any:  # a metadata value, of the file's type
        value = metadata.get(f"{architecture}.{key}", default)
        if required and value is None:
            raise GGUFError(f"{path}: metadata {architecture}.{key} is missing; the file is incomplete")
        return value

    def size(key: str, field: str, default=None) -> int:  # a size, checked before anything of it is made
        value = get(key, default, required=default is None)
        return _checked_size(value, f"{architecture}.{key}", field, path)

    if isinstance(get("attention.head_count"), list):
        raise GGUFError(f"{path}: a head count per layer ({architecture}.attention.head_count) is not supported")
    heads = size("attention.head_count", "num_attention_heads")
    hidden = size("embedding_length", "hidden_size")
    head_dim = size("attention.key_length", "head_dim", max(hidden // heads, 1))
    rotary_dims = get("rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings ({rotary_dims} of {head_dim} dimensions) are not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(
            f"{path}: rope frequency factors (rope_freqs.weight, Llama 3.1-style rope scaling) are not "
            "supported yet; convert the Hugging Face checkpoint instead"
        )
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFError(f"{path}: tensor token_embd.weight is missing")
    return {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": size("vocab_size", "vocab_size", int(embedding.shape[1])),
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length", "intermediate_size"),
        "num_hidden_layers": size("block_count", "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": size("attention.head_count_kv", "num_key_value_heads", heads),
        "head_dim": head_dim,
        "max_position_embeddings": size("context_length", "max_position_embeddings", 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get, path),
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        **_special_ids(metadata),
    }


def _checked_size(value, key: str, field: str, path: Path) -> int:
    """A size from the metadata (key: its name there; field: config.json's), refused unless a
    positive integer within errors.CONFIG_BOUNDS."""
    if isinstance(value, bool) or not (is_int(value) and value >= 1):
        raise GGUFError(f"{path}: metadata {key} ({field}) must be a positive integer, got {value!r}")
    message = size_out_of_bounds(field, int(value), str(path), named=f"metadata {key}")
    if message is not None:
        raise GGUFError(message)
    return int(value)


def _rope_scaling(get, path: Path) -> dict | None:
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise GGUFError(f"{path}: rope scaling {kind!r} is not supported (none, linear)")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor", required=True))}


def _special_ids(metadata: dict) -> dict:
    ids = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    return {key: int(value) for key, value in ids.items() if value is not None}


def _generation_config(metadata: dict, hf_config: dict) -> dict:
    """BOS and every id that ends a turn: EOS, and end-of-turn / end-of-message where given
    (Llama 3's <|eot_id|>, <|eom_id|>)."""
    eos = [metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    config = {"bos_token_id": hf_config.get("bos_token_id")} if "bos_token_id" in hf_config else {}
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def has_packable_tensors(types: dict[str, int]) -> bool:
    """Whether a file with these tensor types has matrices specdec's kernel runs quantized."""
    return any(kind in LAYOUTS for kind in types)


def _hf_tensors(reader, architecture: str, hf_config: dict, path: Path, keep_quantized: bool = False):
    """(Hugging Face name, tensor) for every tensor of the file, in the file's order: a float32
    torch tensor, or with keep_quantized, a PackedTensor for each matrix of a type the kernel
    takes. Quantized matrices are read and packed a few at a time, on as many threads as
    PyTorch uses (numpy releases the GIL), never the whole file in memory."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    progress = _Progress(path, sum(int(t.n_bytes) for t in reader.tensors)) if keep_quantized else None
    workers = max(1, torch.get_num_threads())
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = deque()  # (name, bytes, future or tensor), in the file's order
        for tensor in reader.tensors:
            name = hf_name(tensor.name, path)
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
            if keep_quantized and tensor.tensor_type.name in LAYOUTS and len(shape) == 2:
                item = pool.submit(_packed, tensor, name, shape, architecture, hf_config, path)
            else:
                item = _float_tensor(tensor, name, shape, architecture, hf_config, path)
            pending.append((name, int(tensor.n_bytes), item))
            while len(pending) > workers:
                yield _finished(pending.popleft(), progress)
        while pending:
            yield _finished(pending.popleft(), progress)
    if progress:
        progress.done()
        release_freed_memory()  # the packing's temporaries


def _finished(item, progress) -> tuple[str, object]:
    name, nbytes, value = item
    if not isinstance(value, torch.Tensor):
        value = value.result()  # a PackedTensor being made
    if progress:
        progress.advance(nbytes)
    return name, value


def _float_tensor(tensor, name: str, shape: tuple, architecture: str, hf_config: dict, path: Path) -> torch.Tensor:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, columns], float32
    except Exception as e:  # data cut short, a shape that is not whole blocks
        raise GGUFError(
            f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) cannot be read "
            f"({type(e).__name__}: {e}); the file is corrupt or cut short"
        ) from e
    values = values.astype(np.float32, copy=not values.flags.writeable)  # F32 tensors map the file read-only
    weight = torch.from_numpy(np.ascontiguousarray(values).reshape(shape))
    return _unpermuted(weight, name, architecture, hf_config)


def _unpermuted(weight, name: str, architecture: str, hf_config: dict):
    """weight (rows first) with llama.cpp's Q/K row order undone where the architecture has it."""
    if architecture in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute(weight, hf_config["num_attention_heads"])
    if architecture in PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute(weight, hf_config["num_key_value_heads"])
    return weight


def _packed(tensor, name: str, shape: tuple[int, int], architecture: str, hf_config: dict, path: Path) -> PackedTensor:
    """One quantized matrix read from the file and packed for the kernel, rows in Hugging Face's order."""
    rows, cols = shape
    data = np.fromfile(path, dtype=np.uint8, count=int(tensor.n_bytes), offset=int(tensor.data_offset))
    layout = LAYOUTS[tensor.tensor_type.name]
    if data.size != rows * cols // layout.block_size * layout.block_bytes or cols % layout.block_size:
        raise GGUFError(
            f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) is cut short or not whole "
            "blocks; the file is corrupt: download or convert it again"
        )
    data = data.reshape(rows, -1)  # [rows, row bytes]
    order = _unpermuted(torch.arange(rows), name, architecture, hf_config)
    if not torch.equal(order, torch.arange(rows)):
        data = data[order.numpy()]
    return pack(tensor.tensor_type.name, data, rows, cols)


class _Progress:
    """'reading FILE: 40% (450 / 1117 MB), 12 s left' on stderr, at most twice a second, once
    the read has taken a second."""

    def __init__(self, path: Path, total: int):
        import time

        self.path, self.total, self.read = path, max(total, 1), 0
        self.start = self.last = time.perf_counter()
        self.shown = False

    def advance(self, nbytes: int) -> None:
        import time

        self.read += nbytes
        now = time.perf_counter()
        if now - self.start > 1 and now - self.last > 0.5:
            self.last = now
            left = (now - self.start) * (self.total - self.read) / max(self.read, 1)
            self._show(
                f"reading {self.path.name}: {100 * self.read // self.total}% "
                f"({self.read >> 20} / {self.total >> 20} MB), {left:.0f} s left"
            )

    def done(self) -> None:
        import time

        if self.shown:
            self._show(f"read {self.path.name} ({self.total >> 20} MB) in {time.perf_counter() - self.start:.1f} s\n")

    def _show(self, text: str) -> None:
        import sys

        self.shown = True
        sys.stderr.write("\r" + text.ljust(78) if sys.stderr.isatty() else text.rstrip("\n") + "\n")
        sys.stderr.flush()


def hf_name(gguf_name: str, path: Path) -> str:
    """llama.cpp's tensor name -> Hugging Face's ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    base, _, kind = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and kind == "weight":
        return f"{GLOBAL_NAMES[base]}.weight"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    raise GGUFError(
        f"{path}: tensor {gguf_name!r} is not one a Llama-family model has; the file is not a plain "
        f"{'/'.join(ARCHITECTURES)} model"
    )


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a Q or K projection's rows (weight [heads*D, ...] or a
    bias [heads*D]): within each head it stored rows as pairs (i, i + D/2) interleaved; Hugging
    Face keeps the two halves apart."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])  # [H, D/2, 2, ...]: llama.cpp's order
    return pairs.transpose(1, 2).reshape(weight.shape)  # [H, 2, D/2, ...] -> [H*D, ...]
