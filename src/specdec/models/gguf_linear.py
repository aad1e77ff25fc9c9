"""Linear layers and an embedding that run from a GGUF file's quantized tensors as they are.

A GGUFLinear multiplies by one or several packed tensors stacked along its output (a fused
q/k/v projection whose parts are of different GGUF types, say), quantizing its input to int8
once for all of them (kernels/qmatmul.cpp). A GGUFEmbedding dequantizes only the rows it
gathers. Neither ever holds a float copy of its weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec.kernels import ops
from specdec.models.gguf_quants import GROUP, PackedTensor, take_rows

if TYPE_CHECKING:
    from specdec.models.llama import RMSNorm

PART_FIELDS = ("codes", "sc", "mn", "d", "dmin")


def _register(module: nn.Module, prefix: str, packed: PackedTensor) -> None:
    """packed's tensors as buffers of module (so that they count as its state and memory)."""
    for field in PART_FIELDS:
        module.register_buffer(f"{prefix}_{field}", getattr(packed, field), persistent=False)


class GGUFLinear(nn.Module):
    """y = x W^T + b, W = the parts stacked by rows ([N1 + N2 + ..., K]), each a PackedTensor."""

    def __init__(self, parts: list[PackedTensor], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.cols for p in parts}) != 1:
            raise ValueError(f"stacked parts must have one input size, got {[p.cols for p in parts]}")
        ops()  # the kernel built and loaded: forward calls torch.ops.specdec
        self.parts = list(parts)
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.padded_out = sum(p.codes.shape[0] * GROUP for p in parts)
        for i, part in enumerate(parts):
            _register(self, f"part{i}", part)
        self.register_buffer("bias", bias, persistent=False)
        # the output columns to keep where a part's rows were padded up to a whole group
        keep = None
        if self.padded_out != self.out_features:
            starts = torch.tensor([0] + [p.codes.shape[0] * GROUP for p in parts]).cumsum(0)
            keep = torch.cat([torch.arange(p.rows) + start for p, start in zip(parts, starts.tolist())])
        self.register_buffer("keep", keep, persistent=False)
        padded_bias = None  # the bias as the kernel adds it: float32, over the padded columns
        if bias is not None:
            padded_bias = torch.zeros(self.padded_out)
            padded_bias[keep if keep is not None else slice(None)] = bias.float()
        self.register_buffer("padded_bias", padded_bias, persistent=False)
        # per part: code bits, sub-block, super-block, code offset, signed sub-block scales
        self.layouts = [
            n
            for p in parts
            for n in (p.layout.bits, p.layout.sub_block, p.layout.super_block, p.layout.z, int(p.layout.sc_signed))
        ]
        # what the kernel does to the input first (fuse_input): none yet
        self.gated, self.eps, self._op_args = False, 0.0, None
        self.register_buffer("norm_weight", None, persistent=False)

    def fuse_input(self, norm: RMSNorm | None = None, gated: bool = False) -> None:
        """Take over what the layer's input went through: an RMSNorm (its weight and eps), and/or
        the gate of an MLP (the input is then [gate; up], [..., 2K], and the product's input
        silu(gate) * up). The kernel does it while quantizing the input, in float32: the ops
        these replace each cost a Python call per layer, per token."""
        self.gated, self._op_args = gated, None
        if norm is not None:
            self.norm_weight, self.eps = norm.weight.detach().float().contiguous(), float(norm.eps)

    @property
    def input_size(self) -> int:
        return 2 * self.in_features if self.gated else self.in_features

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> x W^T + b as float32 [M, out_features] (M = the leading dims' product)."""
        x2 = x.reshape(-1, self.input_size)  # [..., K] -> [M, K]
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if self._op_args is None:  # built once: a decode step makes ~110 of these calls
            fields = [[getattr(self, f"part{i}_{field}") for i in range(len(self.parts))] for field in PART_FIELDS]
            self._op_args = (*fields, self.layouts, self.padded_bias, self.norm_weight, self.eps, self.gated)
        y = torch.ops.specdec.qlinear(x2.contiguous(), *self._op_args)  # [M, N padded], float32, bias added
        return y if self.keep is None else y[:, self.keep]

    def _apply(self, fn, recurse=True):
        self._op_args = None  # the buffers may be new tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x).to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """W as float32 [N, K] (for tests and error measurements)."""
        return torch.cat([dequantize(p, torch.arange(p.rows)) for p in self.parts])

    def rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A layer of rows ids only (of a one-part layer), in the same quantized bytes: its outputs
        are bit for bit those columns of this layer's (a head's output layer over part of its
        target's vocabulary)."""
        if len(self.parts) != 1:
            raise ValueError("rows() takes rows of a layer of one part (an output layer)")
        bias: torch.Tensor | None = self.bias  # pyright: ignore[reportAssignmentType]  # a buffer
        if bias is not None:
            bias = bias[ids.to(bias.device)]  # [len(ids)]
        return GGUFLinear([take_rows(self.parts[0], ids)], bias)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (in the stacked W) as float32 [len(ids), K], without a float copy of the rest."""
        ids = ids.long().cpu()
        rows = torch.empty(len(ids), self.in_features)  # [len(ids), K]
        start = 0
        for part in self.parts:
            inside = (ids >= start) & (ids < start + part.rows)  # [len(ids)]
            if bool(inside.any()):
                rows[inside] = dequantize(part, ids[inside] - start)
            start += part.rows
        return rows

    def extra_repr(self) -> str:
        types = "+".join(p.kind for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class GGUFMLP(nn.Module):
    """A gated MLP, down(silu(gate) * up), of GGUFLinear layers: gate_up_proj's float32 output
    goes straight to down_proj, which applies the gate while it quantizes its input. The same
    names and function as llama.MLP."""

    def __init__(self, gate_up_proj: GGUFLinear, down_proj: GGUFLinear):
        super().__init__()
        if gate_up_proj.out_features != 2 * down_proj.in_features:
            raise ValueError(
                f"gate_up_proj gives {gate_up_proj.out_features} values, down_proj takes "
                f"[gate; up] of 2 x {down_proj.in_features}"
            )
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        down_proj.fuse_input(gated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.product(x)  # [M, 2I] float32
        return self.down_proj.product(gate_up).to(x.dtype).view(*x.shape[:-1], self.down_proj.out_features)


class GGUFEmbedding(nn.Module):
    """An embedding table held as a PackedTensor [vocabulary, hidden]; a lookup dequantizes
    the rows it gathers, in dtype."""

    def __init__(self, packed: PackedTensor, dtype: torch.dtype):
        super().__init__()
        ops()  # the kernel built and loaded: forward calls torch.ops.specdec
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.rows, packed.cols
        self.out_dtype = dtype
        _register(self, "table", packed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        layout = self.packed.layout
        rows = torch.ops.specdec.dequantize_rows(
            ids.reshape(-1).long(),
            self.packed.codes,
            self.packed.sc,
            self.packed.mn,
            self.packed.d,
            self.packed.dmin,
            self.packed.cols,
            layout.bits,
            layout.sub_block,
            layout.super_block,
            layout.z,
            layout.sc_signed,
        )  # [n, hidden]
        return rows.to(self.out_dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.packed.kind}"


def dequantize(packed: PackedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of a PackedTensor as float32 [len(ids), K], exactly the file's values (an id
    out of range is a RuntimeError)."""
    layout = packed.layout
    return ops().dequantize_rows(
        ids.long(),
        packed.codes,
        packed.sc,
        packed.mn,
        packed.d,
        packed.dmin,
        packed.cols,
        layout.bits,
        layout.sub_block,
        layout.super_block,
        layout.z,
        layout.sc_signed,
    )


def runs_gguf_kernels(model: nn.Module) -> bool:
    """Whether model holds quantized GGUF layers."""
    return any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())
