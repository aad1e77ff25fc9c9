"""The engine: requests in, one speculative round per step, outputs out.

A step: admit waiting requests into free cache slots, with the cache blocks they need
(scheduler.py), and prefill them in chunks (a preempted one: swapped back in, or recomputed);
give every running request the blocks its round writes, preempting the youngest while they run
short (preemption.py); run one round over
every running request (spec/round.py, each row's k from spec/k_choice.py); append each row's new tokens, stopping at
EOS / stop strings / max_tokens even inside an accepted run (output_processor.py); retire the
finished requests, freeing their slots and blocks. A request of n completions runs as n
sequences (parallel_sampling.py). Sizing the caches before requests run is capacity.py's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter
from specdec.engine.capacity import Capacity
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.parallel_sampling import RequestTable, fork
from specdec.engine.preemption import Preemption
from specdec.engine.prefill_budget import PrefillBudget
from specdec.engine.scheduler import Scheduler
from specdec.engine.swap import DEFAULT_SWAP_SPACE_GIB, SwapSpace
from specdec.metrics import SpecStats
from specdec.models.tokenizer import Tokenizer
from specdec.outputs import RequestOutput
from specdec.sampling import request_generator
from specdec.sequence import Sequence
from specdec.spec.k_choice import KChoice
from specdec.spec.round import SpeculativeRound
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
        self.k_choice = KChoice(k, k_policy, tree, drafter is not None and drafter.grows_trees, target.cost_width)
        self.round = SpeculativeRound(
            target, drafter, self.k_choice.tree, k, self.k_choice.tree_width, eos_token_ids, tokenizer
        )
        self.capacity = Capacity(target, drafter, self.k_choice, self.round.return_hidden, enable_prefix_caching)
        self.output, self.scheduler = OutputProcessor(tokenizer, eos_token_ids), Scheduler()
        self.preemption = Preemption(self.scheduler, self.capacity, drafter, SwapSpace(swap_space_bytes))
        self.prefill_budget, self.requests = PrefillBudget(), RequestTable()
        self.max_len: int | None = None  # the positions each sequence may use, once prepared
        # called with each sequence out of the batch, finished or aborted, on the engine's thread (a recorder)
        self.finish_listeners: list[Callable[[Sequence], None]] = []
        self.stats = SpecStats()  # every request's rounds, merged (the server's metrics read it)
        self.shared_generator = generator if generator is not None else torch.Generator(target.device).manual_seed(0)
        self.timings: dict[str, float] = dict.fromkeys(TIMED_PARTS, 0.0)

    k = property(lambda self: self.k_choice.k)
    policy = property(lambda self: self.k_choice.policy, doc="The goodput policy, or None (k fixed, no drafter)")
    num_running = property(lambda self: self.scheduler.num_running)
    num_waiting = property(lambda self: self.scheduler.num_waiting)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **fields) -> None:
        """Queue a request (prompt_token_ids checked by the caller: LLM.prompt_token_ids), as one
        sequence or, for params.n > 1, n (parallel_sampling.py); it starts at a step with a free
        slot. fields: Sequence's prompt, stream_text (each step's RequestOutput carries the
        request's new text too) and cache_scope (the requests whose answers it may draft from)."""
        generator_for = functools.partial(request_generator, shared=self.shared_generator, device=self.target.device)
        self.add_sequences(fork(request_id, prompt_token_ids, params, generator_for, **fields))

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue the sequences that run one request (parallel_sampling.fork's; LLM.generate makes
        its own), all of them or, where one is refused, none."""
        for seq in seqs:
            self.k_choice.check_fits(seq, self.max_len)
        self.requests.add(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots (swapped-out ones into their own), run the next
        chunks of the prefills under way (one that ends samples a new request's first token),
        run one round over every running request, retire the finished ones. Returns, for every
        request that moved, what is new since the last step (outputs.py)."""
        if self.max_len is None:  # sized for the requests waiting (prepare's, less its idle check)
            self._start(*self.capacity.for_requests(list(self.scheduler.waiting), self.max_num_seqs))
        admitted = self.scheduler.admit()
        for seq in admitted:
            if not self.preemption.swap_in(seq):  # new, or recomputed: its prefill starts after its cached prefix
                seq.num_prefilled = seq.num_cached_tokens
                self.k_choice.start(seq)  # in a slot new to it
        prefilled, chunk_lengths = self.prefill_budget.chunks(self.scheduler.running)
        if prefilled:  # a new sequence whose prefill ends gets its first token
            result = self.round.prefill(prefilled, chunk_lengths)
            self.prefill_budget.record(len(prefilled) * max(chunk_lengths), result.seconds["prefill"])
            self.output.emit(prefilled, result, self.stats, self.timings)
        self.preemption.make_room()
        running = [seq for seq in self.scheduler.running if not seq.finished and not seq.prefilling]
        if running:
            result = self.round.run(running, self.k_choice.round_ks(running, self.drafter))
            self.output.emit(running, result, self.stats, self.timings)
            self.k_choice.observe(running, result)
        self.scheduler.register_full_blocks(None if self.drafter is None else self.drafter.cached_entries)
        for seq in self.scheduler.retire_finished():
            self._finish(seq)
        moved = list({seq.request_id: seq for seq in admitted + prefilled + running}.values())
        return self.requests.merge([output for output in map(self.output.new_output, moved) if output is not None])

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its completions), waiting or running; its slots are free for the
        next step. False if no such request is unfinished."""
        aborted = [seq for seq_id in self.requests.pop(request_id) if (seq := self.scheduler.remove(seq_id))]
        for seq in aborted:
            seq.finish_reason = "abort"
            self._finish(seq, ran=seq.slot >= 0)
        return bool(aborted)

    def request_ids(self, waiting: bool = True, running: bool = True) -> list[str]:
        return self.scheduler.request_ids(waiting, running)  # a request of n completions once

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def prepare(self, seqs: list[Sequence]) -> int:
        """Size the caches for generating seqs (capacity.py); returns how many run at once."""
        self.scheduler.check_idle()
        return self._start(*self.capacity.for_requests(seqs, self.max_num_seqs))

    def prepare_to_serve(
        self,
        max_model_len: int,
        kv_cache_bytes: int | None = None,
        max_prefill_tokens: int | None = None,
        engines_sharing: int = 1,
        max_prefill_seconds: float | None = None,
    ) -> int:
        """Size the caches for serving requests of up to max_model_len tokens each (capacity.py).
        max_prefill_tokens, max_prefill_seconds: the bounds of one step's prefill
        (prefill_budget.py); engines_sharing: the engines on this machine splitting the default
        budget (replicas). Returns the slots."""
        self.scheduler.check_idle()
        budget = PrefillBudget(max_prefill_tokens, max_prefill_seconds)  # checked before anything changes
        return self._start(
            *self.capacity.for_serving(max_model_len, self.max_num_seqs, kv_cache_bytes, engines_sharing), budget
        )

    def _start(self, num_slots: int, max_len: int, prefill_budget: PrefillBudget | None = None) -> int:
        """Run from now on in num_slots slots of max_len positions each (all counts back to 0)."""
        self.max_len = max_len
        self.scheduler.resize(num_slots, self.capacity.blocks, lambda seq: self.k_choice.room(seq, self.max_len or 0))
        self.scheduler.num_preemptions = 0
        self.preemption.swap.clear()
        self.prefill_budget = prefill_budget or PrefillBudget()
        self.scheduler.max_prefill_tokens = self.prefill_budget.max_tokens
        self.timings.update(dict.fromkeys(TIMED_PARTS, 0.0))
        self.round.forget_batches()
        return num_slots

    def _finish(self, seq: Sequence, ran: bool = True) -> None:
        """A sequence out of the batch (finished or aborted): its time, its final text; the
        drafter forgets it."""
        self.requests.remove(seq)
        self.preemption.swap.pop(seq.request_id)  # an aborted one's, if it waited swapped out
        self.output.finish(seq)
        if ran and self.drafter is not None:
            self.drafter.release(seq)
        _notify(self.finish_listeners, seq)


def _notify(listeners: list[Callable[[Sequence], None]], seq: Sequence) -> None:
    """Each listener called with seq; one that raises is logged and fails nothing."""
    for listener in listeners:
        try:
            listener(seq)
        except Exception:
            log.exception("a listener to finished requests failed on %s", seq.request_id)
