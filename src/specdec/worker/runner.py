"""ModelRunner: how one model executes (dtype, device, compilation, weight layout, static shapes).

The runner owns its model's key/value cache (made by `prepare`, sized for the work ahead).
The engine and the drafters hand it a ForwardBatch (tokens, positions and the cache slot of
each row, all explicit) where they would call the model: `forward` (logits at every position:
a decode step is T = 1, a verify forward T = k + 1) and `feed` (rows of different lengths, the
logits after each row's last token: a prefill, or a draft's catch-up). The runner knows nothing
of drafts.

Two ways to run:
  eager     the model's own forward. On the CPU in bfloat16 the linear layers run from
            weights prepacked for oneDNN (cpu_linear.py), made once; a small float32 draft
            may prepack its biggest matrices in bfloat16 (bf16_pack_min_bytes).
  compiled  torch.compile (inductor) with frozen weights and max-autotune's C++ GEMM
            templates on the CPU (CUDA graphs, mode "reduce-overhead", on CUDA). Shapes are
            made static so nothing recompiles while generating: the cache is static (every
            forward reads all positions of its slots' blocks, masked, through the block table:
            the same pool as eager forwards, shaped by kv_cache.pool_for(compiled=True)), the
            batch is padded to the cache's slot count and the query length to the next of the
            runner's query buckets (padding rows write into the scratch slot, padding positions
            past the row's own). A forward longer than the largest bucket (a prefill) runs
            eagerly on the same cache.

compile: "off" (eager), "on" (compiled), or "auto": compiled for work of at least
AUTO_COMPILE_MIN_FORWARDS forwards (waves of requests x the longest max_tokens; the engine
says), eager below. The rule is the payback: AUTO_COMPILE_MIN_FORWARDS is about how many
forwards of a small model it takes, on this project's 2-core CPUs, for what compiling saves per
forward to pay for a shape's compile time: a long generation, or a server's lifetime (the
timings are in docs/runner.md, "Compiling: what, when, and where the cache lives"). Compiled
graphs live in inductor's on-disk cache (INDUCTOR_CACHE_DIR, unless TORCHINDUCTOR_CACHE_DIR says
otherwise; delete it to clear it). A compilation that fails falls back to eager with one warning.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch

from specdec.config import COMPILE_MODES
from specdec.kv_cache import (
    BLOCK_SIZE,
    COMPILED_MAX_QUERIES,
    BlockPool,
    FlatRows,
    FlatTree,
    KVCache,
    TreeAttention,
    compiled_batch,
    compiled_length,
    ragged_batch,
)
from specdec.models.attention import attention_for
from specdec.models.cpu_linear import can_pack, pack_large_linears_in_bf16, pack_linears
from specdec.models.gguf_linear import runs_gguf_kernels
from specdec.models.llama import LlamaModel, use_attention
from specdec.models.quantized_linear import check_quantization, quantize_linears
from specdec.platform import Platform, detect_platform
from specdec.progress import stage
from specdec.worker.prefetch import choose_one_row_prefetch
from specdec.worker.ragged_groups import ragged_groups

log = logging.getLogger("specdec")

AUTO_COMPILE_MIN_FORWARDS = 8192
INDUCTOR_CACHE_DIR = Path.home() / ".cache" / "specdec" / "inductor"
DYNAMO_RECOMPILE_LIMIT = 256  # each shape is one compile of LlamaModel.forward, target and draft alike

# inductor reads this once, at its first compile (or first cache lookup) in the process
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE_DIR))

CPU_COMPILE_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    # autotuning's tables of timings on stderr: compiling says how long it took, once
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
# Half-precision graphs skip the weight prepacking (and with it the C++ GEMM templates, which need
# it): oneDNN's native bf16 matmuls are as fast (a step of the shipped target the same either way,
# a verify faster without), and prepacked oneDNN weights keep a graph out of inductor's on-disk
# graph cache, so a second process would compile it again. float32 keeps them: without, its step
# took more than twice as long (docs/runner.md, "Compiling: what, when, and where the cache lives").
HALF_PRECISION_COMPILE_OPTIONS = {**CPU_COMPILE_OPTIONS, "cpp.weight_prepack": False}


def check_compile_mode(compile: str) -> str:
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    return compile


@dataclass(frozen=True)
class ForwardBatch:
    """One forward's work: row i feeds input_ids[i] at positions[i] [B, T] and reads and writes
    the cache slot slots[i] [B]. tree: a forward over a tree of tokens (kv_cache.TreeAttention:
    where each token's K/V goes and what it reads), which runs eagerly. lengths: row i's first
    lengths[i] tokens are real and the rest padding, whose outputs nobody reads (None: all real);
    the runner may then run the real tokens alone, as one flat run (kv_cache.FlatRows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tree: TreeAttention | None = None
    lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.input_ids.shape != self.positions.shape or self.slots.shape != self.input_ids.shape[:1]:
            raise ValueError(
                f"a forward batch needs input_ids and positions [B, T] and slots [B]; got "
                f"{tuple(self.input_ids.shape)}, {tuple(self.positions.shape)}, {tuple(self.slots.shape)}"
            )
        B, T = self.input_ids.shape
        if self.lengths is not None and (len(self.lengths) != B or not all(0 < n <= T for n in self.lengths)):
            raise ValueError(f"lengths must give each of the {B} rows 1..{T} real tokens, got {self.lengths}")

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots,
        tree: TreeAttention | None = None,
        lengths: list[int] | tuple[int, ...] | None = None,
    ) -> ForwardBatch:
        """slots as a tensor on input_ids' device, from a list of ints or a tensor."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=input_ids.device)
        return cls(input_ids, positions, slots, tree, None if lengths is None else tuple(lengths))

    @property
    def num_padding(self) -> int:
        """How many of the batch's B x T tokens are padding."""
        return 0 if self.lengths is None else self.input_ids.numel() - sum(self.lengths)


def avoid_cudnn_attention() -> None:
    """On CUDA, take cuDNN out of scaled_dot_product_attention's choices (for the whole process:
    PyTorch's switch is global). A decode step or a verify forward reads a cache of a new length
    each step, and cuDNN builds a plan per shape: on an H100 (PyTorch 2.11) such a call with a
    mask took 10-60 ms instead of ~0.5 ms, so with the shipped pair a batch of 8 drafted at
    0.08x plain decoding and k by goodput chose no drafts at all. The memory-efficient and flash
    kernels take every shape at its cost (docs/runner.md, "CUDA")."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("CUDA: scaled_dot_product_attention without cuDNN (a plan per cache length)")


class ModelRunner:
    """Runs one model on platform (detected from its device if None).
    bf16_pack_min_bytes: in a float32 model run eagerly on a CPU with native bfloat16, the
        linear layers with at least this many bytes of weight run in bfloat16 (a small draft's
        output layer; see cpu_linear.pack_large_linears_in_bf16); None: none do.
    name: what it is called in logs and warnings ("the target", "the draft").
    quantization: None, "int8" or "int4": the model's linear layers are replaced, in place, by
        weight-only quantized ones (models/quantized_linear.py) before anything runs."""

    def __init__(
        self,
        model: LlamaModel,
        platform: Platform | None = None,
        compile: str = "off",
        bf16_pack_min_bytes: int | None = None,
        name: str = "the model",
        pack_weights: bool = True,
        quantization: str | None = None,
    ):
        self.model = model
        self._attention = attention_for(model.device.type)
        use_attention(model, self._attention)  # chosen once: nothing compiled chooses
        self.platform = platform or detect_platform(model.device)
        if model.device.type == "cuda":
            avoid_cudnn_attention()
        self.compile_mode = check_compile_mode(compile)
        self.quantization = check_quantization(quantization, model.device)
        if self.quantization is not None:
            with stage(f"{name}: quantizing its weights ({self.quantization})"):
                counts = quantize_linears(model, self.quantization)
            log.info(
                "%s: weights quantized (%s)",
                name,
                ", ".join(f"{n} linear layers {form}" for form, n in sorted(counts.items())),
            )
        self.bf16_pack_min_bytes = bf16_pack_min_bytes
        self.pack_weights = pack_weights  # False: eager runs the model's own layers (to measure what packing is worth)
        self.flat_rows = True  # False: ragged forwards run padded (to measure what flat rows are worth)
        self.name = name
        self.query_buckets: tuple[int, ...] = ()  # query lengths compiled for (empty: eager)
        self.compile_seconds = 0.0
        self._compiled: Callable[..., Any] | None = None  # the torch.compile'd forward, once compiling was chosen
        self._eager_only = False  # compiling failed, or measured slower: never try again
        self._runs_gguf_kernels = runs_gguf_kernels(model)
        if self._runs_gguf_kernels and model.device.type == "cpu":
            choose_one_row_prefetch(model, name)  # once a process, timed on this machine
        self._eager_model: LlamaModel | None = None  # made on first eager use
        self._warm_shapes: set[tuple[int, int, int]] = set()  # (batch, queries, cache length) run compiled
        self.return_hidden = False  # whether the work prepared for asks forwards for hidden states too
        self.cache: KVCache | None = None  # made by prepare

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def config(self):
        return self.model.config

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Make forwards with return_hidden give the outputs of these layers, side by side (a
        drafter's ask, before any work is prepared: the compiled graphs are traced for it)."""
        self.model.set_feature_layers(layers)
        if self._eager_model is not None and self._eager_model is not self.model:
            self._eager_model.set_feature_layers(layers)
        self._warm_shapes.clear()

    # --- preparing a batch of work ---------------------------------------------------------

    @property
    def _kv(self) -> KVCache:
        """The cache, which prepare makes before any forward."""
        assert self.cache is not None, f"{self.name}: prepare() makes the cache first"
        return self.cache

    @property
    def max_len(self) -> int:
        """The positions each slot of the cache holds (after prepare)."""
        return self._kv.max_len

    def prepare(
        self,
        max_batch: int,
        max_len: int,
        query_lengths: tuple[int, ...],
        num_forwards: int,
        return_hidden: bool = False,
        pool: BlockPool | None = None,
    ) -> None:
        """Make the cache for max_batch rows of up to max_len positions (the one held is kept if
        it fits and suits the way this work runs): in the pool's blocks, as its table says (None:
        each slot its own max_len positions). If the work is to run compiled (compiles() says so;
        then a pool must be shaped for it: kv_cache.pool_for(compiled=True)), the cache reads
        every position of every slot of the pool's table, and the graphs for forwards of
        1..max(query_lengths) tokens per row, bucketed up to query_lengths, are compiled (or
        loaded) and run once, and how long that took is logged. return_hidden: the work's
        forwards will ask for hidden states too (their graphs are the ones compiled)."""
        if return_hidden != self.return_hidden:
            self._warm_shapes.clear()
        self.return_hidden = return_hidden
        if not self.compiles(max_batch, max_len, query_lengths, num_forwards):
            self.query_buckets = ()
            self.cache = self._cache(max_batch, max_len, static=False, pool=pool)
            return
        if pool is not None and not pool.compiled:
            raise ValueError(f"{self.name} runs this work compiled: its pool must be made by pool_for(compiled=True)")
        if self._compiled is None:
            self._compiled = self._compile()
        if pool is None:  # slots of its own, the last the scratch slot
            self.cache = self._cache(compiled_batch(max_batch) + 1, compiled_length(max_len), static=True)
        else:
            self.cache = self._cache(pool.table.max_seqs, pool.table.max_blocks * BLOCK_SIZE, static=True, pool=pool)
        self.query_buckets = tuple(sorted({q for q in query_lengths if q <= COMPILED_MAX_QUERIES}))
        with torch.inference_mode():  # as the engine runs: a graph warmed up with autograd on would recompile
            self._warm_up()
        if self._compiled is None:  # it fell back to eager: a cache sized to the work
            self.cache = self._cache(max_batch, max_len, static=False, keep=False, pool=pool)

    def compiles(self, max_batch: int, max_len: int, query_lengths: tuple[int, ...], num_forwards: int) -> bool:
        """Whether prepare() for this work (num_forwards forwards at most) runs it compiled:
        compiling pays (compile "on", or "auto" and long work), or graphs already compiled run
        it as they are (then "auto" uses them for short work too: nothing to pay)."""
        if self._eager_only or self.compile_mode == "off":
            return False
        if not any(q <= COMPILED_MAX_QUERIES for q in query_lengths):
            return False
        if self._compiled_fits(max_batch, max_len, query_lengths):
            return True
        if self.compile_mode == "auto" and num_forwards < AUTO_COMPILE_MIN_FORWARDS:
            return False
        # GGUF weights under "auto": measured no faster, and minutes to compile a shape (docs/runner.md, "GGUF weights")
        return not (self.compile_mode == "auto" and self._runs_gguf_kernels)

    def reads_pool(self, pool: BlockPool | None) -> bool:
        """Whether the cache prepare() made keeps its entries in pool's blocks."""
        return pool is not None and self.cache is not None and self.cache.reads(pool)

    def _cache(
        self, num_slots: int, max_len: int, static: bool, keep: bool = True, pool: BlockPool | None = None
    ) -> KVCache:
        """The cache held if it is of this kind and big enough and reads the same pool (and keep),
        else a new one (the old one freed first)."""
        cache = self.cache
        if (
            keep
            and cache is not None
            and cache.static == static
            and cache.reads(pool)
            and cache.max_batch >= num_slots
            and cache.max_len >= max_len
        ):
            return cache
        self.cache = None
        return self.model.new_cache(num_slots, max_len, static=static, pool=pool)

    def _compiled_fits(self, max_batch: int, max_len: int, query_lengths) -> bool:
        """Whether graphs already compiled run this work as they are."""
        cache = self.cache
        return (
            self._compiled is not None
            and cache is not None
            and cache.static
            and cache.max_batch > max_batch
            and cache.max_len >= max_len
            and {q for q in query_lengths if q <= COMPILED_MAX_QUERIES} <= set(self.query_buckets)
        )

    def _compile(self):
        import torch._dynamo  # imported when first needed: with inductor, it costs memory and time

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DYNAMO_RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * DYNAMO_RECOMPILE_LIMIT
        )
        if self.device.type == "cuda":
            return torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False, fullgraph=True)
        return torch.compile(self.model.forward, dynamic=False, fullgraph=True)

    def _warm_up(self) -> None:
        """Compile (or fetch from the on-disk cache) every shape this work will run, checking
        each against eager on the scratch slot; under "auto", keep compiled only if it measures
        faster than eager."""
        cache = self._kv
        shapes = [(cache.max_batch - 1, queries, cache.max_len) for queries in self.query_buckets]
        cold = [shape for shape in shapes if shape not in self._warm_shapes]
        if not cold:
            return
        start = time.perf_counter()
        self.model.rope_tables_for(cache.max_len)  # built before tracing: the graph only reads it
        for _, queries, _ in cold:
            with stage(f"{self.name}: compiling for {cold[0][0]} rows x {queries} tokens (cached for next time)"):
                if not self._check_compiled(queries):
                    return  # eager from now on
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        log.info(
            "%s: compiled for %d rows x %s tokens in %.1f s (cache: %s)",
            self.name,
            cold[0][0],
            "/".join(str(q) for _, q, _ in cold),
            seconds,
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )
        if self.compile_mode == "auto":
            self._keep_the_faster()

    def _probe(self, queries: int) -> ForwardBatch:
        """A full compiled batch on the scratch slot (every row the same random tokens, so that
        all write the same keys and values there)."""
        rows = scratch = self._kv.max_batch - 1
        g = torch.Generator().manual_seed(queries)
        input_ids = torch.randint(0, self.config.vocab_size, (1, queries), generator=g).to(self.device)
        input_ids = input_ids.expand(rows, queries)  # [rows, queries]
        positions = torch.arange(queries, device=self.device).expand(rows, queries)  # [rows, queries]
        return ForwardBatch.of(input_ids, positions, [scratch] * rows)

    def _check_compiled(self, queries: int) -> bool:
        """Run the graph for `queries` tokens per row once (compiling it) and compare its logits
        with the plain model's on the same input (not the packed eager copy's: a draft's may
        round its output layer to bfloat16): a compiler bug must not change a result."""
        probe = self._probe(queries)
        outputs = self.forward(probe, return_hidden=self.return_hidden)
        if self._compiled is None:  # compiling failed
            return False
        compiled = outputs[0] if isinstance(outputs, tuple) else outputs  # (logits, hidden) with return_hidden
        # the model's own layers: the same weights the graph froze
        eager = self.model(probe.input_ids, probe.positions, self._kv.rows(probe.slots))
        error = _relative_error(compiled, eager)
        # quantized layers run in bf16 (int8, int4) or on int8 activations (GGUF): rounding flips
        exact_float32 = self.dtype == torch.float32 and self.quantization is None and not self._runs_gguf_kernels
        if not error <= (1e-3 if exact_float32 else 5e-2):  # NaN fails too
            self._fall_back(ArithmeticError(f"its logits differ from eager ones by {error:.1e} of their scale"))
            return False
        return True

    def _keep_the_faster(self) -> None:
        """ "auto": time the widest forward both ways (padded rows included); eager from now on
        if it is faster."""
        probe = self._probe(max(self.query_buckets))
        timings: dict[str, float] = {}
        for name, run in (("compiled", self.forward), ("eager", self._forward_eager)):
            run(probe, return_hidden=self.return_hidden)
            start = time.perf_counter()
            for _ in range(5):
                run(probe, return_hidden=self.return_hidden)
            timings[name] = (time.perf_counter() - start) / 5
        log.info(
            "%s: a forward of %d x %d tokens takes %.2f ms compiled, %.2f ms eager: runs %s",
            self.name,
            *probe.input_ids.shape,
            timings["compiled"] * 1e3,
            timings["eager"] * 1e3,
            min(timings, key=timings.__getitem__),
        )
        if timings["eager"] < timings["compiled"]:
            self._run_eagerly_from_now_on()

    # --- forwards ----------------------------------------------------------------------------

    @overload
    def forward(self, batch: ForwardBatch, return_hidden: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def forward(self, batch: ForwardBatch, return_hidden: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def forward(self, batch: ForwardBatch, return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, batch: ForwardBatch, return_hidden: bool = False):
        """batch -> logits [B, T, V] (float32) at every position, each row's K/V written into its
        slot. return_hidden: (logits, the final normed hidden states [B, T, hidden]). A tree's
        forward runs eagerly: graphs are compiled for runs of tokens."""
        bucket = self._query_bucket(batch.input_ids.shape[1])
        if bucket is None or batch.tree is not None:
            return self._forward_eager(batch, return_hidden)
        B, T = batch.input_ids.shape
        outputs = self._run_compiled(self._pad(batch, bucket), return_hidden)
        if outputs is None:  # compilation failed just now
            return self._forward_eager(batch, return_hidden)
        if return_hidden:
            return outputs[0][:B, :T], outputs[1][:B, :T]  # [B, T, V], [B, T, hidden]
        return outputs[:B, :T]  # [B, T, V]

    __call__ = forward

    def _forward_eager(self, batch: ForwardBatch, return_hidden: bool = False):
        if self._runs_flat(batch):
            return self._forward_flat(batch, return_hidden)
        return self.eager_model()(
            batch.input_ids, batch.positions, self._kv.rows(batch.slots), return_hidden=return_hidden, tree=batch.tree
        )

    # --- flat rows: a ragged batch's real tokens as one run, no padding -------------------------

    def _runs_flat(self, batch: ForwardBatch) -> bool:
        """Whether an eager forward of batch runs its real tokens only, as one flat run
        (kv_cache.FlatRows): where it has padding and the model's attention reads flat rows (each
        row's queries over its own slot's keys, in the pool: the bits of the row alone)."""
        return self.flat_rows and batch.num_padding > 0 and self._attention.reads_flat_rows

    def _flat_hidden(self, batch: ForwardBatch, return_hidden: bool):
        """The eager model over batch's real tokens as one run [1, N] (a tree's too, its layout
        kept: kv_cache.FlatTree): its final hidden states [1, N, hidden], the features [1, N, F]
        (return_hidden, else None) and which of [B, T] are real [B, T] (row-major: the run's order)."""
        assert batch.lengths is not None
        lengths = torch.tensor(batch.lengths, device=batch.positions.device)  # [B]
        written = batch.positions if batch.tree is None else batch.tree.write_positions  # [B, T]
        flat, real = FlatRows.of(written, lengths)
        input_ids, positions = batch.input_ids[real][None], batch.positions[real][None]  # [1, N] each
        tree = None if batch.tree is None else FlatTree(batch.tree, batch.positions, real)
        rows = self._kv.rows(batch.slots, flat)
        model = self.eager_model()
        if not return_hidden:
            return model.hidden_states(input_ids, positions, rows, tree), None, real
        hidden, features = model.hidden_and_features(input_ids, positions, rows, tree)
        return hidden, features, real

    def _forward_flat(self, batch: ForwardBatch, return_hidden: bool):
        """forward over the real tokens only: logits [B, T, V] (and features [B, T, F]), zero at
        the padding."""
        hidden, features, real = self._flat_hidden(batch, return_hidden)
        logits = _padded(self.eager_model().logits(hidden[0]), real)  # [N, V] -> [B, T, V]
        return (logits, _padded(features[0], real)) if features is not None else logits

    def _last_token_logits_flat(self, batch: ForwardBatch, return_hidden: bool):
        """last_token_logits over the real tokens only: the output layer on each row's last."""
        assert batch.lengths is not None
        hidden, features, real = self._flat_hidden(batch, return_hidden)
        last = torch.tensor(batch.lengths, device=hidden.device).cumsum(0) - 1  # [B]: each row's last in the run
        logits = self.eager_model().logits(hidden[0, last])  # [B, V]
        return (logits, _padded(features[0], real)) if features is not None else logits

    @overload
    def last_token_logits(
        self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: Literal[False] = False
    ) -> torch.Tensor: ...
    @overload
    def last_token_logits(
        self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def last_token_logits(
        self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def last_token_logits(self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: bool = False):
        """Forward padded rows; logits after each row's last real token (last_index [B]): [B, V].
        return_hidden: (those logits, every position's hidden states [B, T, hidden])."""
        if self._query_bucket(batch.input_ids.shape[1]) is None:  # long: eager, flat or in groups of similar lengths
            if self._runs_flat(batch):
                return self._last_token_logits_flat(batch, return_hidden)
            groups = ragged_groups((last_index + 1).tolist())
            if len(groups) == 1:
                return self._last_token_logits_eager(batch, last_index, return_hidden)
            return self._last_token_logits_in_groups(batch, last_index, return_hidden, groups)
        outputs = self.forward(batch, return_hidden=return_hidden)  # [B, T, V] (, hidden)
        logits, hidden = outputs if isinstance(outputs, tuple) else (outputs, None)
        rows = torch.arange(batch.input_ids.shape[0], device=logits.device)
        last_logits = logits[rows, last_index.to(logits.device)]
        return (last_logits, hidden) if return_hidden else last_logits

    def _last_token_logits_eager(self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: bool):
        return self.eager_model().last_token_logits(
            batch.input_ids, batch.positions, self._kv.rows(batch.slots), last_index, return_hidden
        )

    def _last_token_logits_in_groups(
        self, batch: ForwardBatch, last_index: torch.Tensor, return_hidden: bool, groups: list[list[int]]
    ):
        """last_token_logits as one eager forward per group of rows (ragged_groups.py), each as
        wide as its longest row; the results in the rows' order (hidden: zero past a group's width)."""
        W = batch.input_ids.shape[1]
        logits_parts, hidden_parts = [], []
        for group in groups:
            rows = torch.tensor(group, device=batch.input_ids.device)  # [G]
            width = int(last_index[group].max()) + 1
            part = ForwardBatch(
                batch.input_ids[rows, :width], batch.positions[rows, :width], batch.slots[rows]
            )  # [G, width]
            outputs = self._last_token_logits_eager(part, last_index[group], return_hidden)
            part_logits, part_hidden = (
                outputs if isinstance(outputs, tuple) else (outputs, None)
            )  # [G, V], [G, width, F]
            logits_parts.append(part_logits)
            if part_hidden is not None:
                hidden_parts.append(torch.nn.functional.pad(part_hidden, (0, 0, 0, W - width)))  # [G, W, F]
        grouped = torch.tensor([row for group in groups for row in group])  # [B]: the rows in group order
        order = grouped.argsort().to(logits_parts[0].device)  # [B]: each row's place in group order
        logits = torch.cat(logits_parts)[order]  # [B, V]
        return (logits, torch.cat(hidden_parts)[order]) if return_hidden else logits  # hidden [B, W, F]

    @overload
    def feed(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], return_hidden: Literal[False] = False
    ) -> torch.Tensor: ...
    @overload
    def feed(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], return_hidden: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def feed(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], return_hidden: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def feed(self, chunks: list[list[int]], starts: list[int], slots: list[int], return_hidden: bool = False):
        """Rows of different lengths in one forward (a prefill): row i feeds chunks[i] from
        position starts[i] into slot slots[i]. -> the logits after each row's last token [B, V]
        (return_hidden: and every position's hidden states [B, W, hidden])."""
        batch, last_index = self.ragged_batch(chunks, starts, slots)
        return self.last_token_logits(batch, last_index, return_hidden)

    def ragged_batch(
        self, chunks: list[list[int]], starts: list[int], slots: list[int]
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """The ForwardBatch of feed(chunks, starts, slots) and each row's last real index [B]."""
        input_ids, positions, last_index = ragged_batch(chunks, starts, self._kv.max_len)  # [B, W], [B, W], [B]
        lengths = [len(chunk) for chunk in chunks]
        return ForwardBatch.of(input_ids.to(self.device), positions.to(self.device), slots, lengths=lengths), last_index

    def move(self, slots: list[int], sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy each row's K/V entries at positions sources [B, M] to destinations [B, M] in the
        slots [B] (kv_cache.KVCache.move: a tree's accepted branch into the sequence's next positions)."""
        self._kv.move(slots, sources, destinations)

    def cost_width(self, num_rows: int, num_tokens: int, longest: int) -> float:
        """The tokens per row a forward of num_rows rows (num_tokens real tokens in all, the
        longest row longest) costs as, what its layers multiply over num_rows: compiled, the
        longest padded to its bucket; eager with flat rows, the rows' mean; else the longest."""
        bucket = self._query_bucket(longest)
        if bucket is not None:
            return bucket
        if self.flat_rows and self._attention.reads_flat_rows:
            return num_tokens / num_rows
        return longest

    def _query_bucket(self, num_queries: int) -> int | None:
        """The compiled query length a forward of num_queries tokens runs at, or None (eager)."""
        if self._compiled is None or self.cache is None or not self.cache.static or not self.query_buckets:
            return None
        return next((bucket for bucket in self.query_buckets if bucket >= num_queries), None)

    def _pad(self, batch: ForwardBatch, num_queries: int) -> ForwardBatch:
        """batch [B, T] padded to the compiled shape [cache.max_batch - 1, num_queries]: extra
        columns continue each row's positions (clamped to the cache's last one, which the engine
        keeps free), extra rows feed token 0 into the scratch slot (the cache's last: a compiled
        pool's scratch slot, or a cache of its own's last)."""
        input_ids, positions = batch.input_ids, batch.positions
        B, T = input_ids.shape
        max_batch, max_len = self._kv.max_batch, self._kv.max_len
        rows = scratch = max_batch - 1
        extra = torch.arange(1, num_queries - T + 1, device=self.device)  # [T_pad - T]
        positions = torch.cat([positions, (positions[:, -1:] + extra).clamp(max=max_len - 1)], dim=1)
        input_ids = torch.nn.functional.pad(input_ids, (0, num_queries - T))  # [B, T_pad]
        pad_rows = rows - B
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad_rows, num_queries)])  # [rows, T_pad]
        scratch_positions = torch.arange(num_queries, device=self.device).expand(pad_rows, num_queries)
        positions = torch.cat([positions, scratch_positions])  # [rows, T_pad]
        slots = torch.cat([batch.slots, batch.slots.new_full((pad_rows,), scratch)])  # [rows]
        return ForwardBatch(input_ids, positions, slots)

    def _run_compiled(self, batch: ForwardBatch, return_hidden: bool = False) -> Any:
        """The compiled forward's outputs; None (and eager from now on) if it cannot be compiled."""
        compiled = self._compiled
        assert compiled is not None, "a compiled query bucket without a compiled forward"
        try:
            with self._inductor_config():
                outputs = compiled(batch.input_ids, batch.positions, self._kv.rows(batch.slots), return_hidden)
        except Exception as error:  # noqa: BLE001 - any failure to compile means: run eagerly
            self._fall_back(error)
            return None
        self._warm_shapes.add((batch.input_ids.shape[0], batch.input_ids.shape[1], self._kv.max_len))
        return outputs

    def _run_eagerly_from_now_on(self) -> None:
        self._compiled, self._eager_only, self.query_buckets = None, True, ()

    def _inductor_config(self):
        """Inductor's settings for this runner's (re)compilations, which happen inside calls.
        Patched around each call: torch.compile(options=...) does not reach freezing, without
        which the C++ GEMM templates are not used and a step is more than twice as slow
        (docs/runner.md, "Compiling: what, when, and where the cache lives")."""
        if self.device.type == "cuda":
            return contextlib.nullcontext()
        import torch._inductor.config

        return torch._inductor.config.patch(
            CPU_COMPILE_OPTIONS if self.dtype == torch.float32 else HALF_PRECISION_COMPILE_OPTIONS
        )

    def _fall_back(self, error: Exception) -> None:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"{self.name} could not be compiled ({type(error).__name__}: {message[:300]}); it runs "
            "eagerly instead (compile='off' skips the attempt)",
            stacklevel=4,
        )
        self._run_eagerly_from_now_on()

    def eager_model(self) -> LlamaModel:
        """The model as eager mode runs it fastest: with prepacked CPU weights where they help.
        Under compile="off" the model itself is packed; otherwise a copy that shares its
        parameters (the compiled graphs need the plain layers)."""
        if self._eager_model is None:
            with stage(f"{self.name}: packing its weights for this CPU"):
                self._eager_model = self._packed_for_eager()
        return self._eager_model

    def _packed_for_eager(self) -> LlamaModel:
        device = self.device
        if not self.pack_weights:
            return self.model
        bf16_min_bytes = (  # the large linears of a float32 model packed in bfloat16, or None
            self.bf16_pack_min_bytes if self.dtype == torch.float32 and can_pack(torch.bfloat16, device) else None
        )
        packs_own_dtype = can_pack(self.dtype, device)
        if not packs_own_dtype and bf16_min_bytes is None:
            return self.model
        model = self.model if self.compile_mode == "off" else _sharing_copy(self.model)
        if bf16_min_bytes is not None:
            pack_large_linears_in_bf16(model, bf16_min_bytes)
        if packs_own_dtype:
            pack_linears(model)  # the rest in the model's dtype
        return model


def _padded(flat: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """flat [N, F], the real entries of a batch [B, T] in row-major order (real [B, T] bool) ->
    [B, T, F], zero at the padding."""
    padded = flat.new_zeros(*real.shape, flat.shape[-1])  # [B, T, F]
    padded[real] = flat
    return padded


def _sharing_copy(model: LlamaModel) -> LlamaModel:
    """A copy of model's modules that shares its parameters and buffers (no weight is copied)."""
    memo = {id(tensor): tensor for tensor in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| over the finite logits ÷ their largest magnitude; infinite where the
    two disagree on which logits are -inf (a draft's unscored tokens), NaN if got holds NaN."""
    finite = expected.isfinite()
    if not torch.equal(finite, got.isfinite()) and not bool(got.isnan().any()):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    return float((got[finite] - expected[finite]).abs().max() / expected[finite].abs().max().clamp(min=1e-6))
