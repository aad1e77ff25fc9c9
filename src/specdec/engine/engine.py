"""The engine: requests in, one speculative round per step, outputs out.

A step: admit waiting requests into free cache slots, with the cache blocks they need
(scheduler.py), and prefill them in chunks (a preempted one: swapped back in, or recomputed);
give every running request the blocks its round writes, preempting the youngest while they run
short (swapped out within the swap space, swap.py, else recomputed later); run one round over
every running request (spec/round.py, each row's k from spec/k_choice.py); append each row's new tokens, stopping at
EOS / stop strings / max_tokens even inside an accepted run (output_processor.py); retire the
finished requests, freeing their slots and blocks. Sizing the caches before requests run is
capacity.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter
from specdec.engine.capacity import Capacity
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.parallel_sampling import ParentRequests, fork
from specdec.engine.prefill_budget import PrefillBudget
from specdec.engine.scheduler import Scheduler
from specdec.engine.swap import DEFAULT_SWAP_SPACE_GIB, SwapSpace
from specdec.kv_cache import BLOCK_SIZE, swap_in, swap_out
from specdec.metrics import SpecStats
from specdec.models.tokenizer import Tokenizer
from specdec.outputs import RequestOutput
from specdec.sampling import request_generator
from specdec.sequence import Sequence
from specdec.spec.k_choice import KChoice
from specdec.spec.round import RoundResult, SpeculativeRound
from specdec.tree import TreeShape
from specdec.worker import ModelRunner

log = logging.getLogger("specdec")

TIMED_PARTS = ("prefill", "draft", "target", "sampling", "bookkeeping")


class Engine:
    """target: the target's runner; drafter: None for plain decoding; num_speculative_tokens:
    each round's largest k; k_policy "goodput" or "fixed", tree: see spec/k_choice.py.
    generator: the random stream of requests without a seed of their own. swap_space_bytes: where
    preempted sequences' cache entries may wait (swap.py; 0: preemption recomputes)."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        num_speculative_tokens: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: Tokenizer | None,
        max_num_seqs: int = 256,
        k_policy: str = "goodput",
        tree: TreeShape | None = None,
        generator: torch.Generator | None = None,
        enable_prefix_caching: bool = True,
        swap_space_bytes: int = int(DEFAULT_SWAP_SPACE_GIB * 2**30),
    ):
        self.target, self.drafter, self.max_num_seqs = target, drafter, max_num_seqs
        k = num_speculative_tokens if drafter is not None else 0
        self.k_choice = KChoice(k, k_policy, tree, drafter is not None and drafter.grows_trees, target.padded_queries)
        self.round = SpeculativeRound(
            target, drafter, self.k_choice.tree, k, self.k_choice.tree_width, eos_token_ids, tokenizer
        )
        self.capacity = Capacity(target, drafter, self.k_choice, self.round.return_hidden, enable_prefix_caching)
        self.output = OutputProcessor(tokenizer, eos_token_ids)
        self.scheduler = Scheduler()
        self.prefill_budget = PrefillBudget()
        self.swap = SwapSpace(swap_space_bytes)
        self.max_len: int | None = None  # the positions each sequence may use, once prepared
        self._unfinished: dict[str, Sequence] = {}  # by sequence id: waiting or running
        self.parents = ParentRequests()  # the requests of n > 1 completions under way
        # called with each sequence that leaves the batch finished or aborted, on the engine's thread
        # (a server's recorder); a listener that raises is logged and fails nothing
        self.finish_listeners: list[Callable[[Sequence], None]] = []
        self.stats = SpecStats()  # every request's rounds, merged (the server's metrics read it)
        self.shared_generator = generator if generator is not None else torch.Generator(target.device).manual_seed(0)
        self.timings: dict[str, float] = dict.fromkeys(TIMED_PARTS, 0.0)

    k = property(lambda self: self.k_choice.k)
    policy = property(lambda self: self.k_choice.policy, doc="The goodput policy, or None (k fixed, no drafter)")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        stream_text: bool = False,
        cache_scope: str | None = None,
    ) -> None:
        """Queue a request (prompt_token_ids checked by the caller: LLM.prompt_token_ids), as one
        sequence or, for params.n > 1, n (parallel_sampling.py); it starts at a step with a free
        slot. stream_text: each step's RequestOutput carries the request's new text too (its whole
        output is decoded at every step that adds tokens). cache_scope: the requests whose answers
        it may draft from, and they from its (Sequence)."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already running or waiting; give each a new id")
        seqs = fork(
            request_id,
            prompt_token_ids,
            params,
            lambda seed: request_generator(seed, self.shared_generator, self.target.device),
            prompt=prompt,
            stream_text=stream_text,
            cache_scope=cache_scope,
        )
        self.add_sequences(seqs)

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue the sequences that run one request (parallel_sampling.fork's; LLM.generate makes
        its own), all of them or, where one is refused, none."""
        for seq in seqs:
            if seq.request_id in self._unfinished:
                raise ValueError(f"request id {seq.request_id!r} is already running or waiting; give each a new id")
            needed = self.k_choice.positions_needed(seq)
            if self.max_len is not None and needed > self.max_len:
                raise ValueError(
                    f"a prompt of {len(seq.prompt_token_ids)} tokens + max_tokens={seq.params.max_tokens} "
                    f"needs {needed} cache positions, and the engine was prepared for {self.max_len}; "
                    "shorten the prompt or lower max_tokens"
                )
        for seq in seqs:
            self._unfinished[seq.request_id] = seq
            self.scheduler.add(seq)
        self.parents.add(seqs)

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots (swapped-out ones into their own), run the next
        chunks of the prefills under way (one that ends samples a new request's first token),
        run one round over every running request, retire the finished ones. Returns, for every
        request that moved, what is new since the last step (outputs.py)."""
        if self.max_len is None:  # sized for the requests waiting (prepare's, less its idle check)
            num_slots, self.max_len = self.capacity.for_requests(list(self.scheduler.waiting), self.max_num_seqs)
            self._start(num_slots)
        admitted = self.scheduler.admit()
        for seq in admitted:
            if not self._swap_in(seq):  # new, or recomputed: its prefill starts after its cached prefix
                seq.num_prefilled = seq.num_cached_tokens
                self.k_choice.start(seq)  # in a slot new to it
        prefilled = self._prefill()
        self._make_room()
        running = [seq for seq in self.scheduler.running if not seq.finished and not seq.prefilling]
        if running:
            result = self.round.run(running, self.k_choice.round_ks(running, self.drafter))
            self._emit(running, result)
            self.k_choice.observe(running, result)
        self.scheduler.register_full_blocks(None if self.drafter is None else self.drafter.cached_entries)
        for seq in self.scheduler.retire_finished():
            self._finish(seq)
        moved = list({seq.request_id: seq for seq in admitted + prefilled + running}.values())
        return self.parents.merge([output for output in map(self.output.new_output, moved) if output is not None])

    def _prefill(self) -> list[Sequence]:
        """The next chunks of the prefills under way, oldest first, within one step's prefill
        budget (prefill_budget.py: rows x the longest chunk, within the token bound and what the
        time bound affords; a prompt longer than it is prefilled over several steps, so that a
        step, and the wait to abort a request, stays short); a new sequence whose prefill ends
        gets its first token. Returns the sequences fed."""
        budget = self.prefill_budget.tokens()
        batch, chunk_lengths = [], []
        for seq in self.scheduler.running:
            if not seq.prefilling:
                continue
            remaining = len(seq.prefill_token_ids) - seq.num_written
            length = remaining if budget is None else min(remaining, budget)
            if batch and budget is not None and (len(batch) + 1) * max(*chunk_lengths, length) > budget:
                break
            batch.append(seq)
            chunk_lengths.append(length)
        if batch:
            result = self.round.prefill(batch, chunk_lengths)
            self.prefill_budget.record(len(batch) * max(chunk_lengths), result.seconds["prefill"])
            self._emit(batch, result)
        return batch

    def _make_room(self) -> None:
        """Every running sequence's blocks for its next round, oldest first; while the pool is
        short, the youngest running sequence is preempted."""
        preempted: set[int] = set()  # ids of the sequences preempted here (a swapped one keeps its slot)
        for seq in list(self.scheduler.running):
            while id(seq) not in preempted and not seq.finished and not self.scheduler.grow(seq):
                victim = self.scheduler.youngest()
                preempted.add(id(victim))
                self._preempt(victim)

    def _preempt(self, victim: Sequence) -> None:
        """Take victim out to wait, first in line: its blocks' entries swapped out (it keeps its
        slot and its drafter's state) where the swap space holds them, else its slot and the
        drafter's state freed, to be recomputed (scheduler.py)."""
        blocks, pool = self.capacity.blocks, self.capacity.pool
        assert blocks is not None and pool is not None  # only a pool of blocks runs short
        held = blocks.blocks_of(victim.slot)
        if self.swap.fits(len(held) * BLOCK_SIZE * self.capacity.position_bytes):
            self.swap.put(victim.request_id, swap_out(pool, held))
            self.scheduler.preempt(victim, keep_slot=True)
            return
        if self.drafter is not None:
            self.drafter.release(victim)
        self.scheduler.preempt(victim, keep_slot=False)

    def _swap_in(self, seq: Sequence) -> bool:
        """If seq was swapped out, its entries into the blocks it holds again; whether it was."""
        swapped = self.swap.pop(seq.request_id)
        if swapped is None:
            return False
        blocks, pool = self.capacity.blocks, self.capacity.pool
        assert blocks is not None and pool is not None  # it was swapped out of them
        swap_in(pool, blocks.blocks_of(seq.slot), swapped)
        return True

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted for lack of cache blocks since the engine was prepared."""
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, of those found) since it was prepared."""
        blocks = self.capacity.blocks
        return (0, 0) if blocks is None else (blocks.prefix_queries, blocks.prefix_hits)

    @property
    def cache_usage(self) -> float:
        """The fraction of the caches' blocks that sequences hold (0 before sizing)."""
        blocks = self.capacity.blocks
        return 0.0 if blocks is None else blocks.num_held / (blocks.num_blocks - 1)

    @property
    def cache_tokens(self) -> int:
        """The positions the caches' blocks hold for sequences."""
        return self.capacity.cache_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its completions), waiting or running; its slots are free for the
        next step. False if no such request is unfinished."""
        found = False
        for seq_id in self.parents.pop(request_id):
            seq = self.scheduler.remove(seq_id)
            if seq is not None:
                found = True
                self.swap.pop(seq_id)
                seq.finish_reason = "abort"
                self._finish(seq, ran=seq.slot >= 0)
        return found

    def request_ids(self, waiting: bool = True, running: bool = True) -> list[str]:
        """The unfinished requests' ids (a request of n completions once) among the waiting
        and/or the running ones."""
        seqs = (list(self.scheduler.waiting) if waiting else []) + (self.scheduler.running if running else [])
        return list(dict.fromkeys(seq.output_request_id for seq in seqs))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def prepare(self, seqs: list[Sequence]) -> int:
        """Size the caches for generating seqs (capacity.py); returns how many run at once."""
        self._check_idle()
        num_slots, self.max_len = self.capacity.for_requests(seqs, self.max_num_seqs)
        return self._start(num_slots)

    def prepare_to_serve(
        self,
        max_model_len: int,
        kv_cache_bytes: int | None = None,
        max_prefill_tokens: int | None = None,
        engines_sharing: int = 1,
        max_prefill_seconds: float | None = None,
    ) -> int:
        """Size the caches for serving requests of up to max_model_len tokens each (capacity.py;
        compiles only under compile="on": a compiled forward runs the whole batch of slots,
        however few requests there are). max_prefill_tokens, max_prefill_seconds: the bounds of
        one step's prefill (prefill_budget.py); engines_sharing: the engines on this machine
        splitting the default budget (replicas). Returns the slots."""
        self._check_idle()
        budget = PrefillBudget(max_prefill_tokens, max_prefill_seconds)  # checked before anything changes
        num_slots, self.max_len = self.capacity.for_serving(
            max_model_len, self.max_num_seqs, kv_cache_bytes, engines_sharing
        )
        return self._start(num_slots, budget)

    def warm_up(self, repeats: int = 2) -> None:
        """Every forward the rounds can take, untimed, before requests run (capacity.py)."""
        self.capacity.warm_up(self.scheduler.num_slots, repeats)

    def _check_idle(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("the engine has unfinished requests: finish or abort them before preparing again")

    def _start(self, num_slots: int, prefill_budget: PrefillBudget | None = None) -> int:
        self.scheduler.resize(num_slots, self.capacity.blocks, self._room)
        self.scheduler.num_preemptions = 0
        self.swap.clear()
        self.prefill_budget = prefill_budget or PrefillBudget()
        self.scheduler.max_prefill_tokens = self.prefill_budget.max_tokens
        self.timings.update(dict.fromkeys(TIMED_PARTS, 0.0))
        self.round.forget_batches()
        return num_slots

    def _room(self, seq: Sequence) -> int:
        """The positions seq holds blocks for before a forward: its tokens, what a round writes
        past them, and the one after (kv_cache.ragged_batch's padding)."""
        assert self.max_len is not None
        return min(seq.num_tokens + self.k_choice.margin(self.k_choice.k) + 1, self.max_len)

    def _emit(self, batch: list[Sequence], result: RoundResult) -> None:
        """Append each row's new tokens (stopping inside an accepted run) and count the round."""
        start = time.perf_counter()
        for row, seq in enumerate(batch):
            if not result.tokens[row]:  # a prefill under way
                continue
            forced = result.num_forced[row] if result.num_forced else 0
            emitted = self.output.append(
                seq, result.tokens[row], forced + result.num_accepted[row], logprobs=result.logprobs[row]
            )
            for stats in (seq.stats, self.stats):
                stats.record_round(
                    result.num_proposed[row],
                    result.num_accepted[row],
                    emitted,
                    k=result.ks[row],
                    depth=result.tree_depths[row],
                    num_forced=forced,
                )
        for part, seconds in result.seconds.items():
            self.timings[part] += seconds
        self.timings["bookkeeping"] += time.perf_counter() - start

    def _finish(self, seq: Sequence, ran: bool = True) -> None:
        """A sequence out of the batch (finished or aborted): its time, its final text; the
        drafter forgets it."""
        del self._unfinished[seq.request_id]
        seq.stats.seconds = time.perf_counter() - seq.arrival_time
        seq.text = self.output.final_text(seq)
        if ran and self.drafter is not None:
            self.drafter.release(seq)
        for listener in self.finish_listeners:
            try:
                listener(seq)
            except Exception:
                log.exception("a listener to finished requests failed on %s", seq.request_id)
