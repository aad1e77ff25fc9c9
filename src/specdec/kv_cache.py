"""A preallocated key/value cache with one slot per sequence.

Each sequence owns a slot (a row of the cache) for its whole life. A forward pass names the
slots of its rows explicitly: it runs on `cache.rows(slots)`, the cache as those rows see it
(the runner makes it; a model given the cache itself runs rows 0..B-1), and writes each
token's K/V at the token's position.
Nothing is ever copied or rolled back: when draft tokens are rejected, their entries stay
at positions past the row's length, the causal mask (key position <= query position) hides
them, and the next round writes over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


class CacheTooLarge(ValueError):
    """A cache that would not fit in the memory this machine has free."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        static: bool = False,
    ):
        """static: every forward reads all max_len positions (masked past each query), and the
        slots are always gathered, so a forward's shapes depend on its batch and query length
        only, never on how long the sequences are: what a compiled graph needs. Otherwise a
        forward reads positions 0..max(positions) (fewer keys, but a new shape each step)."""
        shape = (max_batch, max_len, num_kv_heads, head_dim)  # [slots, positions, Hkv, D]
        check_fits(
            2 * num_layers * max_batch * max_len * num_kv_heads * head_dim * dtype.itemsize,
            torch.device(device),
            f"a key/value cache of {max_batch} slots x {max_len:,} positions",
        )
        # Zeros, not empty: masked entries still meet the value matmul with weight 0, and
        # uninitialised memory could hold NaN (0 * NaN = NaN).
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_batch, self.max_len, self.static = max_batch, max_len, static
        self._arange = torch.arange(max_batch, device=device)  # [max_batch]: rows 0..B-1 without an op per layer

    def rows(self, slots: torch.Tensor | Sequence[int]) -> CacheRows:
        """The cache as a forward whose row i reads and writes slot slots[i] sees it."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.keys[0].device)  # [B]
        if bool((slots < 0).any()) or bool((slots >= self.max_batch).any()):
            raise ValueError(f"cache slots must be in [0, {self.max_batch}), got {slots.tolist()}")
        if not self.static and torch.equal(slots, self._arange[: len(slots)]):
            return CacheRows(self, None)  # rows 0..B-1: plain slicing, no gather
        return CacheRows(self, slots)

    def num_keys(self, positions: torch.Tensor) -> int:
        """How many cache positions (0..num_keys-1) a forward at positions [B, T] reads."""
        return self.max_len if self.static else int(positions.max()) + 1

    def layer(self, layer: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return CacheRows(self, None).layer(layer, batch_size)

    def write_and_read(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return CacheRows(self, None).write_and_read(layer, positions, k, v, num_keys)

    def move(self, slots: torch.Tensor | list[int], sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """In every layer, copy each row's entries at positions sources [B, M] to destinations
        [B, M] (row i being slot slots[i]): what a tree's accepted branch needs to become the
        sequence's next positions. All are read before any is written; destinations must be
        distinct within a row (a no-op pair, source = destination, pads a short row)."""
        rows = torch.as_tensor(slots, dtype=torch.long, device=self.keys[0].device)[:, None]  # [B, 1]
        for keys, values in zip(self.keys, self.values):
            keys[rows, destinations] = keys[rows, sources]  # [B, M] entries
            values[rows, destinations] = values[rows, sources]


class CacheRows:
    """A KVCache as one forward sees it: its row i reads and writes slot slots[i] (slots None:
    rows 0..B-1, as a KVCache given to a model directly). A model takes either where it takes a
    cache."""

    def __init__(self, cache: KVCache, slots: torch.Tensor | None):
        self.cache, self.slots = cache, slots
        self.static, self.max_len = cache.static, cache.max_len

    def num_keys(self, positions: torch.Tensor) -> int:
        return self.cache.num_keys(positions)

    def layer(self, layer: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's keys and values [slots, positions, Hkv, D] and the slot of each of the
        forward's batch_size rows [B]."""
        rows = self.cache._arange[:batch_size] if self.slots is None else self.slots
        return self.cache.keys[layer], self.cache.values[layer], rows

    def write_and_read(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, Hkv, D] at positions [B, T]; return this layer's keys and values for
        the rows' slots at positions 0..num_keys-1: [B, num_keys, Hkv, D] each."""
        B = positions.shape[0]
        if num_keys > self.max_len:
            raise ValueError(f"position {num_keys - 1} is past the cache length {self.max_len}")
        keys, values, rows = self.layer(layer, B)
        keys[rows[:, None], positions] = k  # rows [B, 1] x positions [B, T] -> [B, T] entries
        values[rows[:, None], positions] = v
        if self.slots is None:
            return keys[:B, :num_keys], values[:B, :num_keys]
        return keys[self.slots, :num_keys], values[self.slots, :num_keys]


@dataclass(frozen=True)
class TreeAttention:
    """How a forward's tokens are stored and what they read when they are not one run of
    consecutive positions, each after the one before (a tree of candidate tokens, whose
    branches share their ancestors).

    write_positions [B, T]  the cache position each token's K/V is stored at (its RoPE
                            position, the model's `positions`, is its place in its own branch)
    tree_start [B]          every query reads the row's cache positions before tree_start...
    visible [B, T, R]       ...and position tree_start + r where visible[b, t, r] (its
                            branch: its ancestors, and itself, wherever they were written)
    """

    write_positions: torch.Tensor
    tree_start: torch.Tensor
    visible: torch.Tensor

    def mask(self, num_keys: int, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """[B, 1, T, num_keys] (True = attend); a sliding window (of more positions than any
        branch is deep) cuts the keys before tree_start by the query's RoPE position."""
        B, T, R = self.visible.shape
        keys = torch.arange(num_keys, device=positions.device)  # [S]
        before = keys[None, None, :] < self.tree_start[:, None, None]  # [B, 1, S]
        if window is not None:
            before = before & (keys[None, None, :] > positions[:, :, None] - window)  # [B, T, S]
        offset = keys[None, :] - self.tree_start[:, None]  # [B, S]: key position - tree_start
        in_tree = (offset >= 0) & (offset < R)  # [B, S]
        region = self.visible.gather(2, offset.clamp(0, R - 1)[:, None, :].expand(B, T, num_keys))  # [B, T, S]
        return (before | (region & in_tree[:, None, :]))[:, None]  # [B, 1, T, S]


def ragged_batch(
    chunks: list[list[int]], starts: list[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack rows of different lengths for one forward: row i feeds chunks[i] at positions
    starts[i], starts[i]+1, ... Returns input_ids [B, W], positions [B, W] and the index of
    each row's last real token [B].

    Padding slots (token 0) take the positions after the row's own, clamped to the cache's
    last position (max_len - 1): past every row's length, so real queries never read what they write,
    and the row's next real tokens overwrite it (the engine keeps the last position free).
    """
    width = max(len(chunk) for chunk in chunks)
    input_ids = torch.zeros(len(chunks), width, dtype=torch.long)
    positions = torch.zeros(len(chunks), width, dtype=torch.long)
    for row, (chunk, start) in enumerate(zip(chunks, starts)):
        input_ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        positions[row] = torch.arange(start, start + width).clamp(max=max_len - 1)
    last_index = torch.tensor([len(chunk) - 1 for chunk in chunks])
    return input_ids, positions, last_index


def check_fits(num_bytes: int, device: torch.device, what: str) -> None:
    """Raise CacheTooLarge before allocating num_bytes that the device does not have free
    (an allocation that size would fail deep in torch, or push the machine into swap until the
    kernel kills the process)."""
    free = free_memory_bytes(device)
    if free is not None and num_bytes > free:
        raise CacheTooLarge(f"{what} needs {_size(num_bytes)}, more than the {_size(free)} free on {device}")


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take: CUDA's free memory, or the CPU's MemAvailable (Linux);
    None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,} bytes"
