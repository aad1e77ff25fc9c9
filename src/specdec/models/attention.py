"""Attention backends: how a layer's queries attend to the keys before them, given the layer's
new keys and values and the cache they go into. One backend per device, chosen once
(attention_for); a ModelRunner fixes its model's before anything runs (LlamaModel.use_attention),
so that a compiled forward holds no choice at all.

  KernelAttention  the CPU, where specdec's kernel (kernels/attention.cpp) is built: every
                   forward over the paged cache (a decode step, a verify forward, a prefill or a
                   chunk of one) attends with the kernel, which computes each query alone over its
                   own keys: a verify forward then gives bit for bit what the decode steps would,
                   and a row's values depend neither on the rows it shares a forward with (their
                   lengths, the padding up to the longest) nor on where its prefill was split into
                   chunks. PyTorch's attention does neither: it rounds a query by the block of
                   queries and keys it shares. A forward of up to FLOAT32_ATTENTION_MAX_QUERIES
                   queries over another cache (training's steps) attends with the same kernel, by
                   rows; longer ones and training itself (no cache), as TorchAttention does.
  TorchAttention   elsewhere (CUDA; a CPU where the kernel cannot be built): PyTorch's
                   scaled_dot_product_attention over the keys read from the cache, causal within
                   the input where there is no cache (training).

Shapes: q [B, T, H, D], k and v [B, T, Hkv, D], out [B, T, H, D]; mask [B, 1, T, S] or None;
positions [B, T]; num_keys: the cache positions 0..num_keys-1 the forward reads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.kv_cache import CacheRows, KVCache

FLOAT32_ATTENTION_MAX_QUERIES = 16


class TorchAttention:
    """PyTorch's scaled_dot_product_attention (see the module)."""

    reads_flat_rows = False  # whether it takes a forward of flat rows (kv_cache.FlatRows)

    def attend(self, layer: int, q, k, v, mask, positions, cache, num_keys: int) -> torch.Tensor:
        if cache is None:  # training: the keys are this sequence's own, causal by construction
            return self._sdpa(q, k, v, None, causal=True)
        keys, values = cache.write_and_read(layer, positions, k, v, num_keys)  # [B, S, Hkv, D] each
        return self._sdpa(q, keys, values, mask, causal=False)

    @staticmethod
    def _sdpa(q, keys, values, mask, causal: bool) -> torch.Tensor:
        """[B, T, H, D] from q [B, T, H, D] over keys and values [B, S, Hkv, D]. On the CPU,
        half precision over a few queries (a decode step or a verify forward) runs in float32:
        PyTorch's bf16 CPU kernel is several times slower there (docs/runner.md, "Attention").
        Decode steps and verify forwards of up to FLOAT32_ATTENTION_MAX_QUERIES tokens (k <= 15)
        both do, so they round alike; longer forwards keep the half-precision kernel, as fast there."""
        dtype, num_queries = q.dtype, q.shape[1]
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # [B, H(kv), T|S, D]
        if q.device.type == "cpu" and dtype != torch.float32 and num_queries <= FLOAT32_ATTENTION_MAX_QUERIES:
            q, keys, values = q.float(), keys.float(), values.float()
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None and causal, enable_gqa=q.shape[1] != keys.shape[1]
        ).to(dtype)  # [B, H, T, D]
        return out.transpose(1, 2)  # [B, T, H, D]


class KernelAttention(TorchAttention):
    """specdec's CPU kernel (see the module). Flat rows (q [1, N, H, D]: rows' runs one after
    another, kv_cache.FlatRows) attend each row's queries over its own slot's keys, the bits of
    the row run alone."""

    reads_flat_rows = True

    def attend(self, layer: int, q, k, v, mask, positions, cache, num_keys: int) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        if isinstance(cache, (KVCache, CacheRows)):  # any forward over the paged cache
            if num_keys > cache.max_len:
                raise ValueError(f"position {num_keys - 1} is past the cache length {cache.max_len}")
            cache.write(layer, positions, k, v)
            keys, values, blocks = cache.layer(layer, q.shape[0])  # the pool, read through each row's blocks
            flat = getattr(cache, "flat", None)
            if flat is not None:
                return torch.ops.specdec.attend_packed(
                    q, keys, values, blocks, flat.starts, flat.num_keys, mask, num_keys, scale
                )  # [1, N, H, D]
            return torch.ops.specdec.attend_paged(q, keys, values, blocks, mask, num_keys, scale)  # [B, T, H, D]
        if cache is not None and q.shape[1] <= FLOAT32_ATTENTION_MAX_QUERIES:  # another cache: its keys as read
            keys, values = cache.write_and_read(layer, positions, k, v, num_keys)  # [B, S, Hkv, D] each
            return torch.ops.specdec.attend(q, keys, values, mask, scale)  # [B, T, H, D]
        return super().attend(layer, q, k, v, mask, positions, cache, num_keys)


@functools.cache
def attention_for(device_type: str) -> TorchAttention:
    """The backend for a device type ("cpu", "cuda"): the kernel's on a CPU where it is built."""
    from specdec import kernels

    return KernelAttention() if device_type == "cpu" and kernels.available() else TorchAttention()
