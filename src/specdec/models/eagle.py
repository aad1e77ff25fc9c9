"""An EAGLE draft head: one decoder layer of its target's own kind, over the target's features.

Terms:
  feature f_t    what the head reads of the target at position t. EAGLE-1: the target's final
                 normed hidden state there, what its output layer reads to score token t+1.
                 EAGLE-3 (Li et al. 2025): the outputs of a low, a middle and a high layer of the
                 target (feature_layers) side by side [3 x hidden], which the head's `fuse`
                 layer turns into one vector of hidden size (fuse_features)
  head           fc: [embedding of token t+1 ; f_t] (2 x hidden) -> hidden (EAGLE-3: each of the
                 two RMS-normalised first), one decoder layer,
                 a norm -> f^_{t+1}, the predicted next feature; the target's own output layer
                 turns it into scores for token t+2 (EAGLE, Li et al. 2024). At the next
                 drafting step the head reads f^_{t+1} in place of a feature of the target's.
                 An EAGLE-3 head is trained on its tokens alone (not to match the target's
                 final hidden state) and with its own predictions fed back as at drafting time
                 (training-time test: training/eagle3.py)

The head owns only fc, its layer and its norm. The target lends its embedding and output
layer at each use (they are never stored in the head, so a head's checkpoint holds only its
own weights and always speaks its target's vocabulary exactly). A head may score part of the
vocabulary (output_vocab_size > 0: the tokens output_token_ids, FR-Spec style): then it uses
those rows of the target's output layer only, which for a large vocabulary is most of a
drafting step's cost saved; the other tokens get probability 0 (never drafted). The model knows nothing of
speculation: drafters/eagle.py runs it, training/heads.py trains it.

A head directory holds head.json (the format, the layer's shape, and which target it was
trained for) and head.safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specdec.config import is_int
from specdec.models.errors import size_out_of_bounds
from specdec.models.llama import DecoderLayer, DecoderStack, ModelConfig, RMSNorm, scores_over_vocabulary

HEAD_FORMAT = "specdec-eagle-head"
HEAD_CONFIG, HEAD_WEIGHTS = "head.json", "head.safetensors"
# the fields of a target's config its head's layer must share (sizes, vocabulary, layer type)
MATCHING_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
)

# head.json's sizes (ModelConfig's names) -> config.json's, whose bounds (errors.CONFIG_BOUNDS)
# they share; sliding_windows' entries are bounded as sliding_window
HEAD_SIZES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "output_vocab_size": "output_vocab_size",
    "max_position_embeddings": "max_position_embeddings",
}


class HeadLoadError(ValueError):
    """A head directory that cannot be used (missing, malformed, or made for another target)."""


def head_config(target: ModelConfig, output_vocab_size: int = 0, intermediate_size: int | None = None) -> ModelConfig:
    """The head's layer shape: one layer of the target's kind (its MLP intermediate_size wide,
    None: the target's), full attention, scoring the whole vocabulary (or output_vocab_size
    tokens of it)."""
    return dataclasses.replace(
        target,
        num_layers=1,
        sliding_windows=(),
        output_vocab_size=output_vocab_size,
        tie_word_embeddings=False,
        intermediate_size=intermediate_size or target.intermediate_size,
    )


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads by default: the outputs of layers 1, L/2 - 1 and
    L - 4 of L (the inputs of layers 2, L/2 and L - 3, which EAGLE-3's code captures), distinct."""
    return tuple(sorted({min(1, num_layers - 1), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)}))


class EagleHead(DecoderStack):
    """config: head_config(target config); feature_layers: () for an EAGLE-1 head, the target
    layers an EAGLE-3 head reads (then `fuse` maps their outputs, side by side, to one vector)."""

    output_token_ids: torch.Tensor  # a buffer, where config.output_vocab_size

    def __init__(self, config: ModelConfig, feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        self.feature_layers = tuple(feature_layers)
        if self.feature_layers:
            self.fuse = nn.Linear(len(self.feature_layers) * config.hidden_size, config.hidden_size, bias=False)
            self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.feature_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(config, 0)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.output_vocab_size:  # which vocabulary id each scored row is, ascending
            self.register_buffer("output_token_ids", torch.arange(config.output_vocab_size))
        self._init_rope()

    def forward(
        self, token_embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache=None, tree=None
    ) -> torch.Tensor:
        """token_embeddings of tokens t+1 and features f_t [B, T, hidden], at positions t [B, T]
        -> predicted features f^_{t+1} [B, T, hidden]. cache=None (training) attends causally;
        tree: see DecoderStack.transform. An EAGLE-3 head normalises both before fc (as EAGLE-3
        does): the embeddings are tiny beside the target's layer outputs, and the fused target
        features beside the head's own predicted ones, which it reads at later drafting steps."""
        if self.feature_layers:
            token_embeddings, features = self.embedding_norm(token_embeddings), self.feature_norm(features)
        x = self.fc(
            torch.cat([token_embeddings, features.to(token_embeddings.dtype)], dim=-1)
        )  # [B, T, 2H] -> [B, T, H]
        return self.transform(x, positions, cache, tree)

    @property
    def is_eagle3(self) -> bool:
        return bool(self.feature_layers)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., n x hidden] as the head reads them [..., hidden]: fused by
        `fuse` (EAGLE-3), or as they are (EAGLE-1, n = 1)."""
        if not self.feature_layers:
            return features
        return self.fuse(features.to(self.dtype))  # [..., n x H] -> [..., H]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def output_layer(self, lm_head: nn.Module) -> nn.Linear:
        """The head's output layer from its target's (a Linear of weight [V, H], or a GGUF layer,
        whose rows are dequantized): the rows of the tokens it scores (a copy, made once, in the
        head's dtype), or all of them (shared): Linear(H -> S), frozen."""
        if hasattr(lm_head, "dequantized_rows"):  # quantized: never a float copy of every row
            ids = self.output_token_ids if self.config.output_vocab_size else torch.arange(self.config.vocab_size)
            dequantized_rows: Callable[[torch.Tensor], torch.Tensor] = getattr(lm_head, "dequantized_rows")  # noqa: B009
            rows = dequantized_rows(ids).to(self.device, self.dtype)  # [S, H]: GGUFLinear's rows
        else:
            weight: torch.Tensor = getattr(lm_head, "weight")  # noqa: B009 - an nn.Linear's [V, H]
            rows = weight.detach()
            if self.config.output_vocab_size:
                rows = rows.index_select(0, self.output_token_ids.to(rows.device))  # [S, H]
        layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(rows, requires_grad=False)
        return layer

    def logits(self, scores: torch.Tensor) -> torch.Tensor:
        """What output_layer gave, scores [..., S], as logits over the whole vocabulary [..., V]
        (float32; -inf for the tokens it does not score)."""
        if not self.config.output_vocab_size:
            return scores.float()
        return scores_over_vocabulary(scores.float(), self.output_token_ids, self.config.vocab_size)


def save_head(
    head: EagleHead,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    target: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Write head.json and head.safetensors into path (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {
        name: (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()).contiguous()
        for name, tensor in head.state_dict().items()
    }
    save_file(weights, str(path / HEAD_WEIGHTS), metadata={"format": "pt"})
    config = {
        "format": HEAD_FORMAT,
        "version": 1,
        "model": dataclasses.asdict(head.config),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "target": target,
        **({"feature_layers": list(head.feature_layers)} if head.feature_layers else {}),
        **(extra or {}),
    }
    (path / HEAD_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def head_mismatch(head: EagleHead, other: EagleHead, other_name: str) -> str | None:
    """Why head cannot take other's place (the target layers it reads, else the fields of its
    shape that differ, each "name value (other_name: value)"); None where it can."""
    if head.feature_layers != other.feature_layers:
        return f"reads the target's layers {list(head.feature_layers)}, {other_name} {list(other.feature_layers)}"
    differing = [
        f"{field.name} {getattr(head.config, field.name)!r} ({other_name}: {getattr(other.config, field.name)!r})"
        for field in dataclasses.fields(head.config)
        if getattr(head.config, field.name) != getattr(other.config, field.name)
    ]
    return f"has another shape: {'; '.join(differing)}" if differing else None


def is_head_directory(path) -> bool:
    """Whether path names a directory holding a head's config (False for what is not a path)."""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / HEAD_CONFIG).is_file()


def load_head(
    path: str | Path, target: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> EagleHead:
    """The head in path, checked to fit target (the config of the model it will draft for)."""
    path = Path(path)
    config, feature_layers = read_head_config(path)
    check_head_fits(config, target, path)
    if any(layer >= target.num_layers for layer in feature_layers):
        raise HeadLoadError(
            f"the EAGLE-3 head {path} reads the target's layers {list(feature_layers)}, but the target has "
            f"{target.num_layers}; train one for this target with `specdec train-heads --eagle3`"
        )
    head = EagleHead(config, feature_layers)
    weights = _read_weights(path / HEAD_WEIGHTS)
    expected = set(head.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise HeadLoadError(
            f"{path / HEAD_WEIGHTS} does not hold an EAGLE head's weights (missing {missing[:3]}, "
            f"unexpected {extra[:3]})"
        )
    for name, tensor in weights.items():
        if tensor.shape != head.state_dict()[name].shape:
            raise HeadLoadError(
                f"{path / HEAD_WEIGHTS}: {name} has shape {tuple(tensor.shape)}, the head's config "
                f"says {tuple(head.state_dict()[name].shape)}"
            )
        if not bool(tensor.float().isfinite().all()):
            raise HeadLoadError(f"{path / HEAD_WEIGHTS}: {name} holds NaN or infinite values")
    if "output_token_ids" in weights:
        ids = weights["output_token_ids"]
        if (
            ids.is_floating_point()
            or not bool((ids[1:] > ids[:-1]).all())
            or int(ids.min()) < 0
            or int(ids.max()) >= target.vocab_size
        ):
            raise HeadLoadError(
                f"{path / HEAD_WEIGHTS}: output_token_ids must be ascending distinct token ids below "
                f"the vocabulary size {target.vocab_size}"
            )
    head.load_state_dict(weights, strict=False)  # the non-persistent inv_freq is not saved
    return head.to(device=device, dtype=dtype).eval()


def read_head_config(path: Path) -> tuple[ModelConfig, tuple[int, ...]]:
    """head.json's layer shape as a ModelConfig, and the target layers an EAGLE-3 head reads
    (() for EAGLE-1)."""
    file = path / HEAD_CONFIG
    if not path.is_dir():
        raise HeadLoadError(
            f"{path} is not a directory; speculative_method='eagle' needs the directory `specdec train-heads` wrote"
        )
    if not file.is_file():
        raise HeadLoadError(f"{path} has no {HEAD_CONFIG}: it is not an EAGLE head (`specdec train-heads` makes one)")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadLoadError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != HEAD_FORMAT or not isinstance(data.get("model"), dict):
        raise HeadLoadError(f"{file} is not a specdec EAGLE head config (format {HEAD_FORMAT!r})")
    fields = dict(data["model"])
    check_head_sizes(fields, file)
    fields["rope_scaling"] = tuple(tuple(pair) for pair in fields.get("rope_scaling") or ())
    fields["sliding_windows"] = tuple(fields.get("sliding_windows") or ())
    try:
        config = ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise HeadLoadError(f"{file}: its model shape is not valid ({e})") from None
    layers = data.get("feature_layers", [])
    if (
        not isinstance(layers, list)
        or not all(isinstance(i, int) and i >= 0 for i in layers)
        or layers != sorted(set(layers))
    ):
        raise HeadLoadError(f"{file}: feature_layers must be ascending distinct layer indices, got {layers!r}")
    return config, tuple(layers)


def check_head_sizes(fields: dict, file: Path) -> None:
    """Refuse a size in head.json's model (fields) that is not an integer or is past its bound
    (errors.CONFIG_BOUNDS, as a model's config.json), naming the field, its value and the bound,
    before anything of that size is made; a missing one is left to ModelConfig to name."""
    windows = fields.get("sliding_windows") or []
    if not isinstance(windows, list):
        raise HeadLoadError(f"{file}: sliding_windows must be a list (one per layer), got {windows!r}")
    sizes = [(name, fields[name], bounded) for name, bounded in HEAD_SIZES.items() if name in fields]
    sizes += [("sliding_windows", window, "sliding_window") for window in windows if window is not None]
    for name, value, bounded in sizes:
        least = 0 if name == "output_vocab_size" else 1
        if not (is_int(value) and value >= least):
            raise HeadLoadError(f"{file}: {name} must be an integer >= {least}, got {value!r}")
        message = size_out_of_bounds(
            bounded,
            value,
            str(file),
            named=None if name == bounded else name,
            remedy=f"{HEAD_CONFIG} is corrupt or not an EAGLE head's: train the head again (`specdec train-heads`)",
        )
        if message is not None:
            raise HeadLoadError(message)


def check_head_fits(config: ModelConfig, target: ModelConfig, path: Path) -> None:
    """A head drafts only for a target of its own sizes, vocabulary and layer type."""
    differing = [
        f"{name} {getattr(config, name)} (the target: {getattr(target, name)})"
        for name in MATCHING_FIELDS
        if getattr(config, name) != getattr(target, name)
    ]
    if differing:
        raise HeadLoadError(
            f"the EAGLE head {path} was trained for another target: its "
            + ", ".join(differing)
            + "; train one for this target with `specdec train-heads`"
        )


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise HeadLoadError(f"{file.parent} has no {file.name}")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise HeadLoadError(f"{file} is not a readable safetensors file ({e})") from None
