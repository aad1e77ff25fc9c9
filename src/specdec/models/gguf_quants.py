"""GGUF's quantized tensor types, split into integer codes and scales, and packed for
specdec's kernel (kernels/qmatmul.cpp) without ever making a float copy of the weights.

Every type read here stores each weight as

    w = d * sc * (code - z) + dmin * mn

  code   an unsigned integer of 4, 5, 6 or 8 bits (8-bit Q8_0 values are stored + 128)
  sc     an integer scale per sub-block of S = 16 or 32 inputs (int8 or uint8; 1 if none)
  mn     an integer multiplier of dmin per sub-block (uint8; 1 if none)
  d, dmin  float16 per super-block of SB inputs (256 for the k-quants, 32 for the others)
  z      a constant of the type (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q8_0: 128, else 0)

so `split` only takes the bits apart (the values are kept exactly; test_gguf_quants.py checks
them against the `gguf` package's own dequantization). `pack` lays them out for the kernel:
16 output rows to a group, codes in 4 bits (Q4_x), 6 bits (Q5_x, Q6_K) or 8 bits (Q8_0).
Large tensors are split and packed a slab of rows at a time, so the temporaries stay small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 16  # output rows a kernel lane group holds
SLAB_ROWS = 4096  # rows split and packed at a time


@dataclass(frozen=True)
class TypeLayout:
    """How one GGUF type maps onto the kernel's form."""

    block_bytes: int  # bytes of one GGUF block
    block_size: int  # weights in one GGUF block
    bits: int  # stored code width: 4, 6 (5- and 6-bit codes) or 8
    sub_block: int  # S
    z: int
    sc_signed: bool = False
    has_sc: bool = False
    has_mn: bool = False
    has_dmin: bool = False

    @property
    def super_block(self) -> int:
        return self.block_size


LAYOUTS = {
    "Q4_0": TypeLayout(18, 32, 4, 32, 8),
    "Q4_1": TypeLayout(20, 32, 4, 32, 0, has_dmin=True),
    "Q5_0": TypeLayout(22, 32, 6, 32, 16),
    "Q5_1": TypeLayout(24, 32, 6, 32, 0, has_dmin=True),
    "Q8_0": TypeLayout(34, 32, 8, 32, 128),
    "Q4_K": TypeLayout(144, 256, 4, 32, 0, has_sc=True, has_mn=True, has_dmin=True),
    "Q5_K": TypeLayout(176, 256, 6, 32, 0, has_sc=True, has_mn=True, has_dmin=True),
    "Q6_K": TypeLayout(210, 256, 6, 16, 32, sc_signed=True, has_sc=True),
}


@dataclass
class Split:
    """One tensor's parts, row-major: codes [N, K] uint8; sc, mn [N, K/S]; d, dmin [N, K/SB] float16."""

    codes: np.ndarray
    sc: np.ndarray | None
    mn: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row ([n, 2] uint8) as float16 [n]."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Legacy 4-bit layout: qs [n, 16] -> codes [n, 32] (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """qh [n, 4] bytes = 32 bits little-endian -> [n, 32] bit j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K / Q5_K scales -> (sc [n, 8], mn [n, 8]), 6 bits each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def split_blocks(kind: str, blocks: np.ndarray) -> Split:
    """blocks [n, block_bytes] uint8 of one type -> its parts per block (codes [n, block_size])."""
    if kind == "Q4_0":
        return Split(_nibbles_32(blocks[:, 2:]), None, None, _f16(blocks[:, :2]), None)
    if kind == "Q4_1":
        return Split(_nibbles_32(blocks[:, 4:]), None, None, _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))
    if kind == "Q5_0":
        codes = _nibbles_32(blocks[:, 6:]) | (_high_bits_32(blocks[:, 2:6]) << 4)
        return Split(codes, None, None, _f16(blocks[:, :2]), None)
    if kind == "Q5_1":
        codes = _nibbles_32(blocks[:, 8:]) | (_high_bits_32(blocks[:, 4:8]) << 4)
        return Split(codes, None, None, _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))
    if kind == "Q8_0":
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Split(codes, None, None, _f16(blocks[:, :2]), None)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 256)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        if kind == "Q5_K":
            qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((qh & 1) << 4).reshape(-1, 256)
        return Split(codes, sc, mn, _f16(blocks[:, :2]), -_f16(blocks[:, 2:4]))  # w = d sc q - dmin mn
    if kind == "Q6_K":
        ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        codes = (ql & 0x0F).reshape(-1, 256) | ((qh & 3) << 4).reshape(-1, 256)
        sc = blocks[:, 192:208].copy()  # int8 bits
        return Split(codes, sc, None, _f16(blocks[:, 208:210]), None)
    raise ValueError(f"GGUF type {kind} has no integer layout here")


def dequantize_split(kind: str, parts: Split) -> np.ndarray:
    """float32 [n, block_size] values of split_blocks' parts: the formula above (for tests)."""
    layout = LAYOUTS[kind]
    n = parts.codes.shape[0]
    subs = layout.block_size // layout.sub_block
    scale = parts.d.astype(np.float32)[:, None]  # [n, 1]
    if layout.has_sc:
        sc = parts.sc.view(np.int8) if layout.sc_signed else parts.sc  # pyright: ignore[reportOptionalMemberAccess]
        scale = scale * sc.astype(np.float32)  # pyright: ignore[reportOptionalMemberAccess]  # [n, subs]
    codes = parts.codes.astype(np.float32).reshape(n, subs, layout.sub_block) - layout.z
    values = codes * np.broadcast_to(scale, (n, subs))[..., None]
    if layout.has_dmin:
        # sc, mn, dmin: there where the layout has them
        offset = parts.dmin.astype(np.float32)[:, None] * (parts.mn.astype(np.float32) if layout.has_mn else 1.0)  # pyright: ignore[reportOptionalMemberAccess]
        values = values + np.broadcast_to(offset, (n, subs))[..., None]
    return values.reshape(n, layout.block_size)


@dataclass
class PackedTensor:
    """A [N, K] GGUF tensor in the kernel's layout (N padded up to a multiple of GROUP)."""

    kind: str
    layout: TypeLayout
    rows: int  # N before padding
    cols: int  # K
    codes: torch.Tensor  # uint8 [G, K / step inputs, step bytes] (qmatmul.cpp's steps)
    sc: torch.Tensor | None  # uint8 [G, K/S, 16]
    mn: torch.Tensor | None
    d: torch.Tensor  # float16 [G, K/SB, 16]
    dmin: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.codes, self.sc, self.mn, self.d, self.dmin) if t is not None
        )


def take_rows(packed: PackedTensor, ids: torch.Tensor) -> PackedTensor:
    """Rows ids of packed as a PackedTensor of its own, the same bytes regrouped (the kernel's
    lanes: row r is lane r % GROUP of group r // GROUP in every field). Its padding rows repeat
    the last one (cut off after the product, as padding is)."""
    ids = ids.long().cpu()
    count = len(ids)
    padded = torch.cat([ids, ids[-1:].expand(-(-count // GROUP) * GROUP - count)])  # [G' x GROUP]
    group, lane = padded // GROUP, padded % GROUP

    def by_lane(t: torch.Tensor | None) -> torch.Tensor | None:  # [G, X, GROUP] -> [G', X, GROUP]
        if t is None:
            return None
        rows = t[group, :, lane]  # [G' x GROUP, X]
        return rows.view(-1, GROUP, rows.shape[1]).transpose(1, 2).contiguous()

    G, steps, step_bytes = packed.codes.shape
    lanes = packed.codes.view(G, steps, step_bytes // (4 * GROUP), GROUP, 4)  # 4 bytes per lane per 64
    codes = lanes[group, :, :, lane]  # [G' x GROUP, steps, chunks, 4]
    codes = codes.view(-1, GROUP, steps, step_bytes // (4 * GROUP), 4).permute(
        0, 2, 3, 1, 4
    )  # [G', steps, chunks, GROUP, 4]
    return PackedTensor(
        packed.kind,
        packed.layout,
        count,
        packed.cols,
        codes.reshape(-1, steps, step_bytes).contiguous(),
        by_lane(packed.sc),
        by_lane(packed.mn),
        by_lane(packed.d),  # pyright: ignore[reportArgumentType]
        by_lane(packed.dmin),
    )


def pack(kind: str, data: np.ndarray, rows: int, cols: int) -> PackedTensor:
    """A GGUF tensor's bytes (data: [rows, row_bytes] uint8) in the kernel's layout."""
    layout = LAYOUTS[kind]
    if cols % layout.block_size:
        raise ValueError(f"a {kind} tensor's rows must hold whole blocks of {layout.block_size}, got {cols}")
    groups = -(-rows // GROUP)
    per_row = cols // layout.block_size
    step_k, step_bytes = {4: (8, 64), 6: (16, 192), 8: (4, 64)}[layout.bits]
    codes = torch.empty(groups, cols // step_k, step_bytes, dtype=torch.uint8)
    sc = torch.empty(groups, cols // layout.sub_block, GROUP, dtype=torch.uint8) if layout.has_sc else None
    mn = torch.empty(groups, cols // layout.sub_block, GROUP, dtype=torch.uint8) if layout.has_mn else None
    d = torch.empty(groups, per_row, GROUP, dtype=torch.float16)
    dmin = torch.empty(groups, per_row, GROUP, dtype=torch.float16) if layout.has_dmin else None
    data = data.reshape(rows, per_row * layout.block_bytes)
    for start in range(0, groups * GROUP, SLAB_ROWS):
        stop = min(start + SLAB_ROWS, groups * GROUP)
        slab = _padded_rows(data, start, stop)  # [stop - start, row_bytes]
        parts = split_blocks(kind, slab.reshape(-1, layout.block_bytes))
        g0, g1 = start // GROUP, stop // GROUP
        codes[g0:g1] = torch.from_numpy(_pack_codes(parts.codes.reshape(stop - start, cols), layout.bits))
        for target, values in ((sc, parts.sc), (mn, parts.mn)):
            if target is not None:  # and values: the layout has them
                target[g0:g1] = torch.from_numpy(_by_group(values.reshape(stop - start, -1)))  # pyright: ignore[reportOptionalMemberAccess]
        d[g0:g1] = torch.from_numpy(_by_group(parts.d.reshape(stop - start, per_row)))
        if dmin is not None:
            dmin[g0:g1] = torch.from_numpy(_by_group(parts.dmin.reshape(stop - start, per_row)))  # pyright: ignore[reportOptionalMemberAccess]
    return PackedTensor(kind, layout, rows, cols, codes, sc, mn, d, dmin)


def _padded_rows(data: np.ndarray, start: int, stop: int) -> np.ndarray:
    """data[start:stop], with all-zero rows past the end (a zero block is the value 0... times
    zero scales: padding rows come out as 0 and are cut off after the product)."""
    rows = data[start : min(stop, data.shape[0])]
    if rows.shape[0] == stop - start:
        return np.ascontiguousarray(rows)
    padding = np.zeros((stop - start - rows.shape[0], data.shape[1]), np.uint8)
    return np.concatenate([rows, padding])


def _by_group(values: np.ndarray) -> np.ndarray:
    """[rows, X] -> [rows/16, X, 16]: one value per lane."""
    rows, x = values.shape
    return np.ascontiguousarray(values.reshape(rows // GROUP, GROUP, x).transpose(0, 2, 1))


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [rows, K] -> steps [rows/16, K/step inputs, step bytes] (see qmatmul.cpp's header)."""
    rows, cols = codes.shape
    if bits == 6:  # per 16 inputs: two 64-byte nibble planes, then 64 bytes of top 2 bits
        low = _pack_codes(codes & 0x0F, 4).reshape(rows // GROUP, cols // 16, 128)  # [g, step, 2 x 64]
        top = (codes >> 4).reshape(rows // GROUP, GROUP, cols // 16, 4, 4)  # [g, n, step, v, j]: input 4v + j
        top = (
            top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
        )  # [g, n, step, j]
        top = np.ascontiguousarray(top.transpose(0, 2, 1, 3)).reshape(rows // GROUP, cols // 16, 64)  # byte 4n + j
        return np.concatenate([low, top.astype(np.uint8)], axis=2)
    if bits == 8:
        return np.ascontiguousarray(codes.reshape(rows // GROUP, GROUP, cols // 4, 4).transpose(0, 2, 1, 3)).reshape(
            rows // GROUP, cols // 4, 64
        )
    halves = codes.reshape(rows // GROUP, GROUP, cols // 8, 2, 4)  # [g, n, chunk, lo/hi, j]
    packed = halves[:, :, :, 0, :] | (halves[:, :, :, 1, :] << 4)  # [g, n, chunk, j]
    return np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(rows // GROUP, cols // 8, 64)
