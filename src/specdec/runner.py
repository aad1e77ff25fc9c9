"""ModelRunner: how one model executes (dtype, device, compilation, weight layout, static shapes).

The engine and the drafters call a runner where they would call the model: `forward`
(logits at every position: a decode step is T = 1, a verify forward T = k + 1) and
`last_token_logits` (a prefill, or a draft's catch-up). The runner knows nothing of drafts.

Two ways to run:
  eager     the model's own forward. On the CPU in bfloat16 the linear layers run from
            weights prepacked for oneDNN (cpu_linear.py), made once; a small float32 draft
            may prepack its biggest matrices in bfloat16 (bf16_pack_min_bytes).
  compiled  torch.compile (inductor) with frozen weights and max-autotune's C++ GEMM
            templates on the CPU (CUDA graphs, mode "reduce-overhead", on CUDA). Shapes are
            made static so nothing recompiles while generating: the cache is static (every
            forward reads all of its positions, masked), the batch is padded to the cache's
            slot count and the query length to the next of the runner's query buckets (padding
            rows write into a scratch slot, padding positions past the row's own). A forward
            longer than the largest bucket (a prefill) runs eagerly on the same cache.

compile: "off" (eager), "on" (compiled), or "auto": compiled for work of at least
AUTO_COMPILE_MIN_FORWARDS forwards (waves of requests x the longest max_tokens; the engine
says), eager below. The rule is the payback: on this project's 2-core CPUs a shape takes
~15-40 s to compile and saves ~2-5 ms per forward of a small model, so ~8,000 forwards pay for
it (a long generation, or a server's lifetime). Compiled graphs live in inductor's on-disk cache
(INDUCTOR_CACHE_DIR, unless TORCHINDUCTOR_CACHE_DIR says otherwise; delete it to clear it). A
compilation that fails falls back to eager with one warning.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from pathlib import Path

import torch

from specdec.kv_cache import KVCache
from specdec.models.cpu_linear import can_pack, pack_large_linears_in_bf16, pack_linears
from specdec.models.llama import LlamaModel
from specdec.platform import Platform, detect_platform

log = logging.getLogger("specdec")

COMPILE_MODES = ("auto", "on", "off")
AUTO_COMPILE_MIN_FORWARDS = 8192
MAX_COMPILED_QUERIES = 16  # longer forwards (prefills) run eagerly
MIN_STATIC_CACHE_LEN = 256  # a static cache's length is a power of two from here: few shapes to compile
INDUCTOR_CACHE_DIR = Path.home() / ".cache" / "specdec" / "inductor"
DYNAMO_RECOMPILE_LIMIT = 256  # each shape is one compile of LlamaModel.forward, target and draft alike

CPU_COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def check_compile_mode(compile: str) -> str:
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    return compile


class ModelRunner:
    """Runs one model on platform (detected from its device if None).
    bf16_pack_min_bytes: in a float32 model run eagerly on a CPU with native bfloat16, the
        linear layers with at least this many bytes of weight run in bfloat16 (a small draft's
        output layer; see cpu_linear.pack_large_linears_in_bf16); None: none do.
    name: what it is called in logs and warnings ("the target", "the draft")."""

    def __init__(self, model: LlamaModel, platform: Platform | None = None, compile: str = "off",
                 bf16_pack_min_bytes: int | None = None, name: str = "the model", pack_weights: bool = True):
        self.model = model
        self.platform = platform or detect_platform(model.device)
        self.compile_mode = check_compile_mode(compile)
        self.bf16_pack_min_bytes = bf16_pack_min_bytes
        self.pack_weights = pack_weights  # False: eager runs the model's own layers (to measure what packing is worth)
        self.name = name
        self.query_buckets: tuple[int, ...] = ()  # query lengths compiled for (empty: eager)
        self.compile_seconds = 0.0
        self._compiled = None  # the torch.compile'd forward, once compiling was chosen
        self._compile_failed = False
        self._eager_model: LlamaModel | None = None  # made on first eager use
        self._warm_shapes: set[tuple[int, int, int]] = set()  # (batch, queries, cache length) run compiled

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def config(self):
        return self.model.config

    # --- preparing a batch of work ---------------------------------------------------------

    def prepare(self, max_batch: int, max_len: int, query_lengths: tuple[int, ...], num_forwards: int,
                cache: KVCache | None = None) -> KVCache:
        """A cache for max_batch rows of up to max_len positions (cache, if it fits and suits the
        way this work runs, is kept). If the work is to run compiled, compile (or load) and run
        once the graphs for forwards of 1..max(query_lengths) tokens per row, bucketed up to
        query_lengths, and log how long that took."""
        compiled = self._will_compile(num_forwards)
        if compiled:
            max_batch, max_len = _batch_bucket(max_batch), _length_bucket(max_len)
        fits = (cache is not None and cache.static == compiled and cache.max_batch >= max_batch + compiled
                and cache.max_len >= max_len)
        if not fits:
            cache = None  # the old one's memory goes back before the new one takes its own
            cache = self.model.new_cache(max_batch + compiled, max_len, static=compiled)  # + a scratch slot
        self.query_buckets = tuple(sorted(set(query_lengths))) if compiled else ()
        if compiled:
            self._warm_up(cache)
        return cache

    def _will_compile(self, num_forwards: int) -> bool:
        if self._compile_failed or self.compile_mode == "off":
            return False
        if self.compile_mode == "auto" and num_forwards < AUTO_COMPILE_MIN_FORWARDS:
            return False
        if self._compiled is None:
            self._compiled = self._compile()
        return self._compiled is not None

    def _compile(self):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE_DIR))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DYNAMO_RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * DYNAMO_RECOMPILE_LIMIT)
        if self.device.type == "cuda":
            return torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False, fullgraph=True)
        return torch.compile(self.model.forward, dynamic=False, fullgraph=True, options=CPU_COMPILE_OPTIONS)

    def _warm_up(self, cache: KVCache) -> None:
        """Compile (or fetch from the on-disk cache) every shape this work will run, by running
        each once on the scratch slot."""
        shapes = [(cache.max_batch - 1, queries, cache.max_len) for queries in self.query_buckets]
        cold = [shape for shape in shapes if shape not in self._warm_shapes]
        if not cold:
            return
        start = time.perf_counter()
        self.model.rope_tables_for(cache.max_len)  # built before tracing: the graph only reads it
        for batch, queries, _ in cold:
            input_ids = torch.zeros(1, queries, dtype=torch.long, device=self.device)
            positions = torch.arange(queries, device=self.device)[None]
            self.forward(input_ids, positions, cache, slots=torch.tensor([cache.max_batch - 1]))
            if self._compiled is None:  # compiling failed: eager from now on
                return
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        log.info("%s: compiled for %d rows x %s tokens in %.1f s (cache: %s)", self.name, cold[0][0],
                 "/".join(str(q) for _, q, _ in cold), seconds, os.environ["TORCHINDUCTOR_CACHE_DIR"])

    # --- forwards ----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] -> logits [B, T, V] (float32), writing K/V into cache at
        the rows' slots (slots [B], or cache's current ones)."""
        bucket = self._query_bucket(input_ids.shape[1], cache)
        if bucket is None:
            return self.eager_model()(input_ids, positions, cache)
        B, T = input_ids.shape
        padded_ids, padded_positions, restore = self._pad(input_ids, positions, cache, bucket, slots)
        try:
            logits = self._run_compiled(padded_ids, padded_positions, cache)
        finally:
            cache.slots = restore
        if logits is None:  # compilation failed just now
            return self.forward(input_ids, positions, cache, slots)
        return logits[:B, :T]  # [B, T, V]

    __call__ = forward

    def last_token_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                          last_index: torch.Tensor) -> torch.Tensor:
        """Forward padded rows; logits after each row's last real token (last_index [B]): [B, V]."""
        if self._query_bucket(input_ids.shape[1], cache) is None:
            return self.eager_model().last_token_logits(input_ids, positions, cache, last_index)
        logits = self.forward(input_ids, positions, cache)  # [B, T, V]
        rows = torch.arange(input_ids.shape[0], device=logits.device)
        return logits[rows, last_index.to(logits.device)]

    def _query_bucket(self, num_queries: int, cache: KVCache) -> int | None:
        """The compiled query length a forward of num_queries tokens runs at, or None (eager)."""
        if self._compiled is None or not cache.static or not self.query_buckets:
            return None
        return next((bucket for bucket in self.query_buckets if bucket >= num_queries), None)

    def _pad(self, input_ids, positions, cache: KVCache, num_queries: int, slots: torch.Tensor | None):
        """Pad [B, T] to the compiled shape [cache.max_batch - 1, num_queries]: extra columns
        continue each row's positions (clamped to the cache's last one, which the engine keeps
        free), extra rows feed token 0 into the scratch slot (the cache's last). Returns the
        padded input_ids and positions, and the cache's slots to restore afterwards."""
        B, T = input_ids.shape
        rows, scratch = cache.max_batch - 1, cache.max_batch - 1
        restore = cache.slots
        row_slots = slots if slots is not None else cache.slots
        if row_slots is None:
            row_slots = torch.arange(B)
        row_slots = torch.as_tensor(row_slots, dtype=torch.long, device=self.device)
        extra = torch.arange(1, num_queries - T + 1, device=self.device)  # [T_pad - T]
        positions = torch.cat([positions, (positions[:, -1:] + extra).clamp(max=cache.max_len - 1)], dim=1)
        input_ids = torch.nn.functional.pad(input_ids, (0, num_queries - T))  # [B, T_pad]
        pad_rows = rows - B
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad_rows, num_queries)])  # [rows, T_pad]
        scratch_positions = torch.arange(num_queries, device=self.device).expand(pad_rows, num_queries)
        positions = torch.cat([positions, scratch_positions])  # [rows, T_pad]
        cache.slots = torch.cat([row_slots, row_slots.new_full((pad_rows,), scratch)])  # [rows]
        return input_ids, positions, restore

    def _run_compiled(self, input_ids, positions, cache: KVCache) -> torch.Tensor | None:
        """The compiled forward; None (and eager from now on) if it cannot be compiled."""
        try:
            logits = self._compiled(input_ids, positions, cache)
        except Exception as error:  # noqa: BLE001 - any failure to compile means: run eagerly
            self._fall_back(error)
            return None
        self._warm_shapes.add((input_ids.shape[0], input_ids.shape[1], cache.max_len))
        return logits

    def _fall_back(self, error: Exception) -> None:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"{self.name} could not be compiled ({type(error).__name__}: {message[:300]}); it runs "
                      "eagerly instead (compile='off' skips the attempt)", stacklevel=4)
        self._compiled, self._compile_failed, self.query_buckets = None, True, ()

    def eager_model(self) -> LlamaModel:
        """The model as eager mode runs it fastest: with prepacked CPU weights where they help.
        Under compile="off" the model itself is packed; otherwise a copy that shares its
        parameters (the compiled graphs need the plain layers)."""
        if self._eager_model is None:
            self._eager_model = self._packed_for_eager()
        return self._eager_model

    def _packed_for_eager(self) -> LlamaModel:
        device = self.device
        if not self.pack_weights:
            return self.model
        if can_pack(self.dtype, device):
            pack = pack_linears
        elif self.dtype == torch.float32 and self.bf16_pack_min_bytes is not None and can_pack(torch.bfloat16, device):
            def pack(model):
                pack_large_linears_in_bf16(model, self.bf16_pack_min_bytes)
        else:
            return self.model
        model = self.model if self.compile_mode == "off" else _sharing_copy(self.model)
        pack(model)
        return model


def _sharing_copy(model: LlamaModel) -> LlamaModel:
    """A copy of model's modules that shares its parameters and buffers (no weight is copied)."""
    memo = {id(tensor): tensor for tensor in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def _batch_bucket(batch: int) -> int:
    """The batch a compiled graph is made for: the next power of two."""
    return 1 << (batch - 1).bit_length()


def _length_bucket(length: int) -> int:
    """A static cache's length: the next power of two, at least MIN_STATIC_CACHE_LEN."""
    return max(MIN_STATIC_CACHE_LEN, 1 << (length - 1).bit_length())
