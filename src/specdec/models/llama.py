"""The Llama family in one file: Llama 2/3, Mistral, Qwen2, Qwen3.

They differ only in small switches, all read from the Hugging Face config:
  attention_bias  biases on q/k/v (Qwen2 always; Llama and Qwen3 when configured; on o too
                  for Llama/Qwen3)
  qk_norm         an RMSNorm over each head of q and k before RoPE (Qwen3)
  rope scaling    "llama3" (Llama 3.1+) and "linear" stretch the rotary frequencies
  sliding window  a layer attends only to the last `window` positions (Mistral, some Qwen)
  tied embeddings the output head reuses the input embedding matrix

The model knows nothing of speculation. `forward(input_ids [B, T], positions [B, T], cache)`
writes each token's K/V into the cache at its position and attends to every cached key at a
position <= the query's. Positions decide everything: entries past a row's length (say,
rejected draft tokens) sit at later positions, are masked, and are overwritten next time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kv_cache import BLOCK_SIZE, BlockPool, CacheRows, FlatTree, KVCache, TreeAttention, blocks_for
from specdec.models.attention import TorchAttention, attention_for


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] = ()  # sorted (key, value) pairs, hashable
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty = full attention everywhere
    output_vocab_size: int = 0  # > 0: the output layer predicts only that many tokens (output_token_ids)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not (0 <= self.output_vocab_size <= self.vocab_size):
            raise ValueError(
                f"output_vocab_size must be in [0, vocab_size {self.vocab_size}] (0: the whole "
                f"vocabulary), got {self.output_vocab_size}"
            )
        if self.output_vocab_size and self.tie_word_embeddings:
            raise ValueError(
                "an output layer over part of the vocabulary (output_vocab_size) cannot be tied to the "
                "embedding; set tie_word_embeddings to false"
            )

    @property
    def head_size(self) -> int:
        """How many tokens the output layer scores: output_vocab_size, or the whole vocabulary."""
        return self.output_vocab_size or self.vocab_size

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        output = 0 if self.tie_word_embeddings else self.head_size * h
        return v * h + output + self.num_layers * per_layer + h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In float32, cast back before the weight (as Hugging Face's). Conversions of a float32
        input are skipped: in a small model's decode step each op's dispatch is what costs."""
        is_float32 = x.dtype == torch.float32
        x32 = x if is_float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return self.weight * (x32 if is_float32 else x32.to(x.dtype))


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary frequencies theta^(-2i/d), stretched by the config's rope scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = dict(config.rope_scaling)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength, high_freq_wavelength = old_context / low, old_context / high
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(is_medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, 1, D]: Hugging Face's x * cos + rotate_half(x) * sin,
    where rotate_half(x) = [-x2, x1] for the halves x1, x2 of D. Written as
    roll(x) * [-sin1, sin2] with roll(x) = [x2, x1]: the same products bit for bit
    ((-a) * b = a * (-b)), in one op where rotate_half takes four."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # q, k and v projections as one matrix [q; k; v] (one matmul instead of three)
        self.qkv_proj = nn.Linear(h, q_dim + 2 * kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.backend: TorchAttention | None = None  # how it attends (attention.py); None: its device's

    def forward(
        self, x, cos, signed_sin, mask, positions, cache: KVCache | CacheRows | None, num_keys: int
    ) -> torch.Tensor:
        """num_keys: the cache positions 0..num_keys-1 this forward reads (cache path only)."""
        B, T, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim)  # [B, T, H+2Hkv, D]
        if self.q_norm is None or self.k_norm is None:  # no q/k norms (both or neither): q and k rotated together
            q, k = apply_rope(qkv[:, :, : H + Hkv], cos, signed_sin).split([H, Hkv], dim=2)  # [B, T, H|Hkv, D]
        else:
            q, k = self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H : H + Hkv])
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        v = qkv[:, :, H + Hkv :]  # [B, T, Hkv, D]
        backend = self.backend if self.backend is not None else attention_for(q.device.type)
        out = backend.attend(self.layer_index, q, k, v, mask, positions, cache, num_keys)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, -1))  # [B, T, H*D] -> [B, T, hidden]


def use_attention(model: nn.Module, backend: TorchAttention) -> None:
    """Every attention layer of model attends with backend from now on (attention.py: a runner
    fixes its model's once, before anything runs; elsewhere each forward takes its device's)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)  # [gate; up] as one matrix
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [..., 2I] -> 2 x [..., I]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, signed_sin, mask, positions, cache, num_keys) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, mask, positions, cache, num_keys)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Decoder layers and the final norm over input vectors: what a causal language model
    and a draft head built from the same layers (models/eagle.py) share. Subclasses make
    config, layers, norm and inv_freq."""

    config: ModelConfig
    layers: nn.ModuleList
    norm: RMSNorm
    inv_freq: torch.Tensor  # a buffer (_init_rope)
    feature_layers: tuple[int, ...] = ()  # the layers whose outputs are its features (LlamaModel.forward)

    def _init_rope(self) -> None:
        self.register_buffer("inv_freq", rope_inverse_frequencies(self.config), persistent=False)
        self._rope_cache = None  # ((dtype, device), cos [N, D], signed sin [N, D]) for positions 0..N-1

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def cache_bytes(self, max_batch: int, max_len: int) -> int:
        """The bytes of new_cache(max_batch, max_len): keys and values of every layer."""
        positions = (1 + max_batch * blocks_for(max_len)) * BLOCK_SIZE  # each slot's blocks, and the scratch block
        return positions * self.position_bytes

    @property
    def position_bytes(self) -> int:
        """The cache's bytes per position: a key and a value in every layer."""
        c = self.config
        return 2 * len(self.layers) * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def new_cache(
        self,
        max_batch: int,
        max_len: int,
        static: bool = False,
        pool: BlockPool | None = None,
    ) -> KVCache:
        """A cache for this model (kv_cache.KVCache): a block table of its own, or the pool's."""
        c = self.config
        return KVCache(
            len(self.layers),
            max_batch,
            max_len,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            static,
            table=None if pool is None else pool.table,
            num_blocks=None if pool is None else pool.num_blocks,
        )

    def transform(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | CacheRows | None,
        tree: TreeAttention | FlatTree | None = None,
        kept: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Input vectors x [B, T, hidden] at positions [B, T] -> final normed hidden states [B, T, hidden].
        tree (with a cache): where each token's K/V goes and what it reads, when that is not
        "position p, after everything before p" (kv_cache.TreeAttention).
        kept: a list to append the outputs [B, T, hidden] of the layers in self.feature_layers to,
        in layer order (features, see LlamaModel.forward)."""
        write_positions = positions if tree is None else tree.write_positions  # [B, T]
        num_keys = cache.num_keys(write_positions) if cache is not None else x.shape[1]
        cos, signed_sin = self._rope_tables(positions, num_keys)  # a tree's positions are <= where it writes
        needs_mask = cache is not None and (cache.static or not _reads_every_key(positions, num_keys))
        masks = {}
        for index, layer in enumerate(self.layers):
            window = self.config.window(layer.self_attn.layer_index)  # pyright: ignore[reportAttributeAccessIssue, reportArgumentType]
            if window not in masks:
                masks[window] = (
                    self._mask(positions, num_keys, window, needs_mask)
                    if tree is None
                    else tree.mask(num_keys, positions, window)
                )
            x = layer(x, cos, signed_sin, masks[window], write_positions, cache, num_keys)
            if kept is not None and index in self.feature_layers:
                kept.append(x)
        return self.norm(x)

    @staticmethod
    def _mask(positions: torch.Tensor, num_keys: int, window: int | None, needs_mask: bool) -> torch.Tensor | None:
        """The attention mask, or None where causality alone says it all (needs_mask False:
        training, which is plain causal, or a step that reads every key, see _reads_every_key)
        and no sliding window cuts."""
        if not needs_mask and (window is None or window >= num_keys):
            return None
        return attention_mask(positions, num_keys, window)

    def _rope_tables(self, positions: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (all < num_positions) -> cos, signed sin [B, T, 1, D] in the model's dtype
        (computed in float32), read from tables of every position so far (a decode step then
        costs two lookups)."""
        _, cos, signed_sin = self.rope_tables_for(num_positions)
        return cos[positions][:, :, None, :], signed_sin[positions][:, :, None, :]  # [B, T, 1, D] each

    def rope_tables_for(self, num_positions: int) -> tuple:
        """((dtype, device), cos [N, D], signed sin [N, D]) for positions 0..N-1, N >= num_positions,
        built once and grown by doubling."""
        key = (self.dtype, self.device)
        if self._rope_cache is None or self._rope_cache[0] != key or self._rope_cache[1].shape[0] < num_positions:
            size = max(num_positions, 2 * self._rope_cache[1].shape[0] if self._rope_cache else 1024)
            angles = torch.arange(size, device=self.device).float()[:, None] * self.inv_freq  # [N, D/2]
            cos = torch.cat((angles.cos(), angles.cos()), dim=-1)  # [N, D]
            signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)  # [N, D]: see apply_rope
            self._rope_cache = (key, cos.to(self.dtype), signed_sin.to(self.dtype))
        return self._rope_cache


class LlamaModel(DecoderStack):
    """Decoder-only transformer; parameter names follow Hugging Face's checkpoints."""

    output_token_ids: torch.Tensor  # a buffer, where config.output_vocab_size

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.head_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if config.output_vocab_size:  # which vocabulary id each output row scores, ascending
            self.register_buffer("output_token_ids", torch.arange(config.output_vocab_size))
        self._init_rope()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | CacheRows | None,
        return_hidden: bool = False,
        tree: TreeAttention | FlatTree | None = None,
    ):
        """input_ids, positions [B, T] -> logits [B, T, V] (float32); with return_hidden, also
        the features: (logits, features).
        Features: the final normed hidden states [B, T, hidden]; or, where feature_layers names
        n layers (set_feature_layers), those layers' outputs side by side, [B, T, n * hidden].
        cache=None (training) attends causally within input_ids; positions must be 0..T-1.
        tree: see transform."""
        if not return_hidden:
            return self.logits(self.hidden_states(input_ids, positions, cache, tree))
        hidden, features = self.hidden_and_features(input_ids, positions, cache, tree)
        return self.logits(hidden), features

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Make the features (forward's return_hidden) the outputs of these layers (indices from
        0, ascending), side by side; () makes them the final normed hidden states again."""
        layers = tuple(layers)
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.config.num_layers for i in layers):
            raise ValueError(
                f"feature layers must be distinct ascending layer indices below {self.config.num_layers}, got {layers}"
            )
        self.feature_layers = layers

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | CacheRows | None,
        tree: TreeAttention | FlatTree | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [B, T] -> final normed hidden states [B, T, hidden]."""
        return self.transform(self.embed_tokens(input_ids), positions, cache, tree)  # embeddings [B, T, hidden]

    def hidden_and_features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | CacheRows | None,
        tree: TreeAttention | FlatTree | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [B, T] -> the final normed hidden states [B, T, hidden] and the
        features (see forward)."""
        kept: list[torch.Tensor] = []
        hidden = self.transform(self.embed_tokens(input_ids), positions, cache, tree, kept)
        return hidden, (torch.cat(kept, dim=-1) if self.feature_layers else hidden)  # [B, T, n * hidden]

    def last_token_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | CacheRows,
        last_index: torch.Tensor,
        return_hidden: bool = False,
    ):
        """Forward padded rows; logits after each row's last real token (index last_index [B]):
        [B, V]. The output head runs on those positions only. With return_hidden, also every
        position's features (see forward): (logits, features)."""
        hidden, features = self.hidden_and_features(input_ids, positions, cache)  # [B, T, hidden], [B, T, F]
        rows = torch.arange(input_ids.shape[0], device=hidden.device)
        logits = self.logits(hidden[rows, last_index.to(hidden.device)])
        return (logits, features) if return_hidden else logits

    def first_layers(self, num_layers: int) -> LlamaModel:
        """This model cut after its first num_layers layers: the same embedding, layers, final norm
        and output layer (shared, not copied), the rest left out. Its caches hold those layers only."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        windows = self.config.sliding_windows[:num_layers]
        with torch.device("meta"):  # nothing allocated: every module is replaced by this model's below
            view = LlamaModel(dataclasses.replace(self.config, num_layers=num_layers, sliding_windows=windows))
        view.embed_tokens, view.norm, view.lm_head = self.embed_tokens, self.norm, self.lm_head
        view.layers = nn.ModuleList(self.layers[:num_layers])
        for name, buffer in self.named_buffers(recurse=False):
            setattr(view, name, buffer)
        return view

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in float32. An output layer over part of the
        vocabulary (output_vocab_size) gives the other tokens -inf: probability 0."""
        logits = self.lm_head(hidden).float()  # [..., head_size]
        if not self.config.output_vocab_size:
            return logits
        return scores_over_vocabulary(logits, self.output_token_ids, self.config.vocab_size)


def scores_over_vocabulary(scores: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scores [..., S] of the tokens token_ids [S] as logits over the whole vocabulary [..., V]:
    -inf (probability 0) for every other token."""
    every_token = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))  # [..., V]
    return every_token.index_copy(-1, token_ids, scores)


def _reads_every_key(positions: torch.Tensor, num_keys: int) -> bool:
    """One new token per row, every row at the last key position (a decode step of a batch
    of equal lengths): each query reads every key, so no mask is needed."""
    return positions.shape[1] == 1 and int(positions.min()) == num_keys - 1


def attention_mask(positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Which cached keys each query may read: key position <= query position (and within
    the sliding window). positions [B, T] -> mask [B, 1, T, num_keys] (True = attend)."""
    key_positions = torch.arange(num_keys, device=positions.device)  # [S]
    query_positions = positions[:, None, :, None]  # [B, 1, T, 1]
    mask = key_positions <= query_positions
    if window is not None:
        mask &= key_positions > query_positions - window
    return mask
