"""A Hugging Face model directory -> LlamaModel + Tokenizer + EOS ids.

Reads config.json, model.safetensors (or the shards listed in model.safetensors.index.json),
tokenizer.json / tokenizer_config.json and generation_config.json. Safetensors only: no
pickle, no remote code. Every problem is reported as a ModelLoadError naming the file and
what to do, before anything is half-built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import is_int, is_real, torch_dtypes
from specdec.models.checkpoint import from_hf, to_hf
from specdec.models.errors import CONFIG_BOUNDS, ModelLoadError, size_out_of_bounds
from specdec.models.llama import LlamaModel, ModelConfig, rope_inverse_frequencies
from specdec.models.registry import resolve_model
from specdec.models.tokenizer import Tokenizer
from specdec.output_dir import unfinished_output_message
from specdec.platform import Platform, auto_dtype, detect_platform, warn_if_emulated

log = logging.getLogger("specdec")

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensor, in Hugging Face names
DTYPES = torch_dtypes()


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    path: Path
    hf_config: dict


def load_pretrained(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    platform: Platform | None = None,
    what: str = "the model",
    keep_quantized: bool = False,
) -> LoadedModel:
    """Load a Hugging Face directory (or a GGUF file) in dtype ("auto": see resolve_dtype;
    platform: the device's, detected if None). keep_quantized: a GGUF file's quantized
    matrices stay quantized (models/gguf_model.py), on the CPU; otherwise they are dequantized.
    How the model then runs (weight layouts, compilation) is its ModelRunner's business."""
    path = resolve_model(path, what)  # a registered model's name -> its fetched file or directory
    if is_gguf_file(path):
        return _load_gguf(Path(path).expanduser(), dtype, device, load_tokenizer, platform, what, keep_quantized)
    path = check_model_path(path)
    hf_config = read_config(path)
    config = model_config_from_hf(hf_config, path / "config.json")
    torch_dtype = resolve_dtype(dtype, hf_config, platform or detect_platform(device), what)
    eos_ids = eos_token_ids(path, hf_config, config.vocab_size)
    weights = read_safetensors(path)
    tokenizer = _load_tokenizer(path, config.vocab_size) if load_tokenizer else None
    model = build_model(config, weights, torch_dtype, torch.device(device), path)
    return LoadedModel(model, tokenizer, eos_ids, path, hf_config)


def load_tokenizer_and_config(path: str | Path, what: str = "the model") -> tuple[Tokenizer, ModelConfig]:
    """A model's tokenizer and its config, no weight read: what a front end that only
    tokenizes and checks prompts needs (a Ray Serve ingress)."""
    path = resolve_model(path, what)
    if is_gguf_file(path):
        from specdec.models.gguf import read_gguf_tokenizer

        path = Path(path).expanduser()
        hf_config, backend, tokenizer_config = read_gguf_tokenizer(path)
        config = model_config_from_hf(hf_config, path)
        tokenizer = Tokenizer.from_backend(backend, tokenizer_config)
        _check_tokenizer_fits(tokenizer, path, "the GGUF's tokenizer", config.vocab_size, "the model's")
        return tokenizer, config
    path = check_model_path(path)
    config = model_config_from_hf(read_config(path), path / "config.json")
    return _load_tokenizer(path, config.vocab_size), config


def is_gguf_file(path) -> bool:
    return isinstance(path, (str, Path)) and str(path).lower().endswith(".gguf") and Path(path).expanduser().is_file()


def _load_gguf(
    path: Path, dtype, device, load_tokenizer: bool, platform: Platform | None, what: str, keep_quantized: bool = False
) -> LoadedModel:
    """A GGUF file, read as the Hugging Face directory `specdec convert` would write from it,
    or with keep_quantized, with its quantized matrices as they are."""
    from specdec.models.gguf import read_gguf

    if keep_quantized and torch.device(device).type != "cpu":
        raise ModelLoadError(
            f"{path}: quantized GGUF weights run on the CPU only (device {device}); pass "
            "quantization=None to dequantize them"
        )
    # cast once, to the dtype it runs in
    checkpoint = read_gguf(path, weights_dtype=torch.float32, keep_quantized=keep_quantized)
    hf_config = checkpoint.hf_config
    config = model_config_from_hf(hf_config, path)
    torch_dtype = resolve_dtype(dtype, hf_config, platform or detect_platform(device), what)
    eos_ids = _eos_ids({"the GGUF metadata": checkpoint.generation_config}, path, config.vocab_size)
    tokenizer = None
    if load_tokenizer:
        tokenizer = Tokenizer.from_backend(checkpoint.tokenizer, checkpoint.tokenizer_config)
        _check_tokenizer_fits(tokenizer, path, "the GGUF's tokenizer", config.vocab_size, "the model's")
    if checkpoint.packed:
        from specdec.models.gguf_model import build_quantized_model

        check_layer_count(config, [*checkpoint.weights, *checkpoint.packed], path)
        model = build_quantized_model(config, checkpoint.weights, checkpoint.packed, torch_dtype, path)
    else:
        model = build_model(config, checkpoint.weights, torch_dtype, torch.device(device), path)
    return LoadedModel(model, tokenizer, eos_ids, path, hf_config)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_model_path(path) -> Path:
    """path as a Path to a model directory, or a ModelLoadError saying what it is instead."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ModelLoadError(f"model must be the path of a Hugging Face model directory, got {path!r}")
    path = Path(path).expanduser()
    if path.is_file():
        raise ModelLoadError(f"{str(path)!r} is a file, not a model directory: {_file_hint(path)}")
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist; point at a Hugging Face model "
            "directory holding config.json and *.safetensors, or a .gguf file"
        )
    unfinished = unfinished_output_message(path)
    if unfinished is not None:
        raise ModelLoadError(unfinished)
    return path


def _file_hint(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return (
            f"a {suffix} checkpoint is a pickle, which specdec never loads (it can run code); use the "
            "model's safetensors release, a directory with config.json and *.safetensors"
        )
    if suffix == ".safetensors" or path.name == "config.json":
        return f"point at the directory holding it, {str(path.parent)!r}"
    return "point at a Hugging Face model directory holding config.json and *.safetensors, or a .gguf file"


def read_config(path: Path) -> dict:
    return _read_json(path / "config.json", what="the model's config.json")


def model_config_from_hf(cfg: dict, where: Path) -> ModelConfig:
    """Translate a Hugging Face config (transformers v4 or v5 style) into a ModelConfig."""
    model_type = _model_type(cfg, where)

    def need(key: str):
        if key not in cfg or cfg[key] is None:
            raise ModelLoadError(
                f"{where}: required field {key!r} is missing; "
                "the config must come from a complete Hugging Face checkpoint"
            )
        return cfg[key]

    def positive_int(key: str, value):
        if not (is_int(value) and value >= 1):
            raise ModelLoadError(f"{where}: {key} must be a positive integer, got {value!r}")
        _check_bound(key, value, where)
        return value

    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden, heads = (positive_int(key, need(key)) for key in ("hidden_size", "num_attention_heads"))
    num_layers = positive_int("num_hidden_layers", need("num_hidden_layers"))
    eps = cfg.get("rms_norm_eps") if cfg.get("rms_norm_eps") is not None else 1e-6
    if not (is_real(eps) and eps > 0):
        raise ModelLoadError(f"{where}: rms_norm_eps must be a number > 0, got {eps!r}")
    rope_theta, rope_scaling = _rope(cfg, where)
    # transformers gives these biases only to some architectures, whatever config.json says
    attention_bias = model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=positive_int("num_key_value_heads", cfg.get("num_key_value_heads") or heads),
            head_dim=positive_int("head_dim", cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=positive_int("max_position_embeddings", cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(cfg, model_type, num_layers, where),
            output_vocab_size=_output_vocab_size(cfg, where),
        )
    except ModelLoadError:
        raise
    except ValueError as e:  # ModelConfig's own checks (heads a multiple of key/value heads)
        raise ModelLoadError(f"{where}: {e}") from e


def _check_bound(key: str, value: int, where: Path) -> None:
    """Refuse a size past its bound (errors.CONFIG_BOUNDS), before anything of that size is made."""
    if key in CONFIG_BOUNDS and (message := size_out_of_bounds(key, value, str(where))) is not None:
        raise ModelLoadError(message)


def _output_vocab_size(cfg: dict, where: Path) -> int:
    """specdec's own field: a draft whose output layer scores only part of the vocabulary (its
    model.output_token_ids say which ids); 0 or absent: all of it."""
    value = cfg.get("output_vocab_size") or 0
    if not (is_int(value) and value >= 0):
        raise ModelLoadError(f"{where}: output_vocab_size must be an integer >= 0, got {value!r}")
    _check_bound("output_vocab_size", value, where)
    return value


def _model_type(cfg: dict, where: Path) -> str:
    architectures = cfg.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelLoadError(f"{where}: 'architectures' must be a list of names, got {architectures!r}")
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if architectures:
        raise ModelLoadError(f"{where}: unsupported architecture {architectures}; supported: {supported}")
    if cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return cfg["model_type"]
    raise ModelLoadError(
        f"{where}: unsupported or missing model_type {cfg.get('model_type')!r} "
        f"(no 'architectures' field); supported: {supported}"
    )


def _rope(cfg: dict, where: Path) -> tuple[float, tuple]:
    """(rope_theta, rope scaling as sorted pairs) from v5's rope_parameters or v4's rope_scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ModelLoadError(f"{where}: {key} must be an object (or null), got {cfg[key]!r}")
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta"))
    theta = 10000.0 if theta is None else theta
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    needed = {
        "linear": ["factor"],
        "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
    }.get(rope_type, [])
    if rope_type == "llama3" and merged.get("original_max_position_embeddings") is None:
        merged["original_max_position_embeddings"] = cfg.get("max_position_embeddings")  # as transformers v5 does
    missing = [key for key in needed if merged.get(key) is None]
    if missing:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} needs {missing} in rope_scaling")
    values = [theta] + [merged[k] for k in needed]
    if not all(is_real(v) and v > 0 for v in values):
        raise ModelLoadError(
            f"{where}: rope_theta and the rope scaling values {needed} must be numbers > 0, got {values}"
        )
    pairs = tuple(sorted((k, float(merged[k])) for k in needed))
    return float(theta), (("rope_type", rope_type),) + pairs if rope_type != "default" else ()


def _sliding_windows(cfg: dict, model_type: str, num_layers: int, where: Path) -> tuple:
    window = cfg.get("sliding_window")
    if not window:
        return ()
    if not (is_int(window) and window >= 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    _check_bound("sliding_window", window, where)
    layer_types = cfg.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelLoadError(
                f"{where}: layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type == "mistral":
        return (window,) * num_layers
    if cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        if not (is_int(first) and first >= 0):
            raise ModelLoadError(
                f"{where}: max_window_layers must be an integer >= 0 with use_sliding_window, got {first!r}"
            )
        return tuple(window if i >= first else None for i in range(num_layers))
    return ()


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: dict, platform: Platform, what: str = "the model"
) -> torch.dtype:
    """dtype as a torch dtype; "auto" = the checkpoint's, unless platform would emulate it
    (platform.auto_dtype). The choice is logged; an explicit half precision the platform emulates
    runs, with a warning."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype {dtype} is not supported: the model runs in torch.float32, torch.bfloat16 "
                "or torch.float16 ('auto' takes the checkpoint's)"
            )
    elif not isinstance(dtype, str):
        raise ValueError(f"dtype must be 'auto', one of {sorted(DTYPES)} or a torch dtype, got {dtype!r}")
    elif dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
    if dtype != "auto":
        chosen = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]
        warn_if_emulated(chosen, platform, what)
        return chosen
    saved = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if not isinstance(saved, str) or saved not in DTYPES:
        raise ModelLoadError(
            f"config.json says the weights are {saved!r}, which is not supported; pass "
            f"dtype= one of {sorted(DTYPES)} instead of 'auto'"
        )
    chosen, why = auto_dtype(DTYPES[saved], platform)
    log.info("%s runs in %s: %s", what, str(chosen).removeprefix("torch."), why)
    return chosen


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards its index lists, on the CPU."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, what="the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no 'weight_map' listing the shards")
        if not all(isinstance(file, str) and file for file in weight_map.values()):
            raise ModelLoadError(f"{index}: every 'weight_map' entry must name a shard file")
        files = sorted(set(weight_map.values()))
        outside = [file for file in files if Path(file).is_absolute() or ".." in Path(file).parts]
        if outside:
            raise ModelLoadError(
                f"{index}: shard paths must stay inside the model directory, got {_some(outside)}; "
                "an index naming files elsewhere is refused"
            )
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {found}: pickle checkpoints are not loaded; convert them to safetensors)" if found else ""
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")
    tensors = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise ModelLoadError(f"{file}: shard listed in the index is missing; re-save or re-download the model")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            raise ModelLoadError(
                f"{file}: corrupt or truncated safetensors file ({e}); re-save or re-download it"
            ) from e
    return tensors


def build_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, path: Path
) -> LlamaModel:
    """A LlamaModel holding exactly the checkpoint's weights, checked by name and shape in
    the checkpoint's own (Hugging Face) names before the projections are fused."""
    given = {name: t for name, t in weights.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" in given:
        if _same_tensor(given["lm_head.weight"], given.get("model.embed_tokens.weight")):
            del given["lm_head.weight"]  # some tied checkpoints store the shared matrix twice
        else:  # a head of its own: transformers then leaves them untied, and so do we
            config = dataclasses.replace(config, tie_word_embeddings=False)
    check_layer_count(config, list(given), path)
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in to_hf(model).items()}
    missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match its config.json: "
            f"missing tensors {_some(missing)}, unexpected tensors {_some(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {tuple(given[name].shape)}, config.json implies {shape}"
            )
    state = {
        name: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
        for name, t in from_hf(given).items()
    }
    _check_finite(state, given, dtype, path)
    if config.output_vocab_size:
        _check_output_token_ids(state["output_token_ids"], config.vocab_size, path)
    # names checked above; a tied lm_head is re-tied below
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    return model.eval().requires_grad_(False)


def check_layer_count(config: ModelConfig, names: list[str], path: Path) -> None:
    """Refuse a config whose num_hidden_layers is not the layers the checkpoint's tensors (names,
    Hugging Face's) hold, before a model of that many layers is built: a config claiming a
    million layers would otherwise build for minutes before its tensors were found missing."""
    layers = sorted({int(match.group(1)) for name in names if (match := LAYER_TENSOR.match(name))})
    if layers == list(range(config.num_layers)):
        return
    config_file = "its metadata (block_count)" if path.is_file() else "config.json"  # a GGUF file, or a directory
    raise ModelLoadError(
        f"{path}: {config_file} says num_hidden_layers is {config.num_layers}, but the checkpoint holds "
        f"the tensors of {_layer_list(layers)}; the config is not this checkpoint's: set num_hidden_layers "
        "to the checkpoint's, or re-download the model"
    )


def _layer_list(layers: list[int]) -> str:
    """Sorted layer numbers in words: '24 layers (0 to 23)', 'layers 0, 1, 3', 'no layer'."""
    if not layers:
        return "no layer"
    if layers == list(range(len(layers))):
        return f"{len(layers)} layer{'s' if len(layers) > 1 else ''} (0 to {layers[-1]})"
    shown = ", ".join(map(str, layers[:8])) + (f", ... ({len(layers)} in all)" if len(layers) > 8 else "")
    return f"layers {shown}"


def _check_finite(
    state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], dtype: torch.dtype, path: Path
) -> None:
    """Refuse weights holding NaN or infinity, which would otherwise decode to empty or garbled
    text: one pass over the weights as they will run (state); only when that finds some, the
    checkpoint's own (saved, Hugging Face names) tell a corrupt or diverged checkpoint from
    values the requested dtype cannot hold."""
    if all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point()):
        return
    bad = _non_finite(saved)
    if bad:
        raise ModelLoadError(
            f"{path}: tensors {_some(bad)} hold NaN or infinite values; the checkpoint is corrupt "
            "or its training diverged: re-save or re-download it"
        )
    raise ModelLoadError(
        f"{path}: tensors {_some(_non_finite(state))} hold NaN or infinite values once converted "
        f"to {str(dtype).removeprefix('torch.')} (use a wider dtype)"
    )


def _check_output_token_ids(ids: torch.Tensor, vocab_size: int, path: Path) -> None:
    """The ids an output layer over part of the vocabulary scores: integers, ascending, in range."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ModelLoadError(f"{path}: model.output_token_ids must hold integer token ids, got {ids.dtype}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all())):
        raise ModelLoadError(
            f"{path}: model.output_token_ids must be distinct token ids in [0, {vocab_size}), ascending"
        )


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and bool(torch.equal(a, b))


def _some(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}" if names else "none"


def eos_token_ids(path: Path, hf_config: dict, vocab_size: int) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json (either may hold an int, a list of
    them, or null); anything else, or an id outside the vocabulary, is a ModelLoadError."""
    sources = {"config.json": hf_config}
    if (path / "generation_config.json").is_file():
        sources = {
            "generation_config.json": _read_json(path / "generation_config.json", what="generation_config.json"),
            **sources,
        }
    return _eos_ids(sources, path, vocab_size)


def _eos_ids(sources: dict[str, dict], path: Path, vocab_size: int) -> tuple[int, ...]:
    """The eos_token_id values of sources ({where: config}), first ones first, each once."""
    ids: list[int] = []
    for name, source in sources.items():
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is None:
                continue
            if not (is_int(token) and 0 <= token < vocab_size):
                raise ModelLoadError(
                    f"{path}: {name}'s eos_token_id must be token ids in [0, {vocab_size}) (or null), got {value!r}"
                )
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def _load_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"{path}: tokenizer.json is missing; save the tokenizer with the model "
            "(tokenizer.save_pretrained) or pass skip_tokenizer_init=True and give token ids"
        )
    config_file = path / "tokenizer_config.json"
    config = _read_json(config_file, what="tokenizer_config.json") if config_file.is_file() else None
    try:
        tokenizer = Tokenizer.from_directory(path, config)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read the tokenizer ({e})") from e
    _check_tokenizer_fits(tokenizer, path, "tokenizer.json", vocab_size)
    return tokenizer


def _check_tokenizer_fits(
    tokenizer: Tokenizer, path: Path, what: str, vocab_size: int, vocab_source: str = "config.json's"
) -> None:
    largest = max(tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= vocab_size:
        raise ModelLoadError(
            f"{path}: {what} has token ids up to {largest}, beyond {vocab_source} vocab_size "
            f"{vocab_size}: the tokenizer is not this model's (or tokens were added without "
            "resizing the model's embedding)"
        )


def _read_json(file: Path, what: str) -> dict:
    if not file.is_file():
        raise ModelLoadError(f"{file}: {what} is missing; point at a Hugging Face model directory")
    try:
        with open(file) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: {what} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: {what} must hold a JSON object")
    return data
