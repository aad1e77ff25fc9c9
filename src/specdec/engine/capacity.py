"""Sizing the caches for the work ahead, before any request runs.

Two ways to size: for a known list of requests (LLM.generate: as many slots as run at once,
each as long as the longest needs) or for serving (slots of max_model_len, as many as
max_num_seqs and a memory budget allow). Either way the runners make their caches (and compile
for the work, where they are to), and the goodput policy measures its round costs here, never
inside a timed request.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter
from specdec.kv_cache import CacheTooLarge
from specdec.progress import stage
from specdec.sequence import Sequence
from specdec.spec.k_choice import KChoice
from specdec.worker import ForwardBatch, ModelRunner

CALIBRATION_CONTEXT = 128  # the positions the goodput policy's cost calibration runs at


class Capacity:
    """Sizes the target's and the drafter's caches for the rounds k_choice plans.
    return_hidden: the target's forwards return its hidden states too (for the drafter)."""

    def __init__(self, target: ModelRunner, drafter: Drafter | None, k_choice: KChoice, return_hidden: bool):
        self.target, self.drafter, self.k_choice, self.return_hidden = target, drafter, k_choice, return_hidden

    def for_requests(self, seqs: list[Sequence], max_num_seqs: int) -> tuple[int, int]:
        """Caches for generating seqs, at most max_num_seqs at once; returns (slots, positions
        per slot)."""
        max_batch = min(max_num_seqs, len(seqs))
        # room for the forwards of every k these requests can use, which calibration and warm-up
        # run (a k far beyond what they can emit is neither allocated nor timed)
        k = self.k_choice.sizing_k(seqs)
        max_len = max(s.num_tokens + s.params.max_tokens for s in seqs) + self.k_choice.margin(k) + 1
        waves = -(-len(seqs) // max_batch)
        self._reserve(max_batch, max_len, waves * max(s.params.max_tokens for s in seqs), k)
        return max_batch, self.target.max_len

    def for_serving(self, max_model_len: int, max_num_seqs: int, kv_cache_bytes: int | None) -> tuple[int, int]:
        """Caches for requests of up to max_model_len tokens (prompt and output) each, as many
        at once as max_num_seqs and kv_cache_bytes (the target's cache; None: no limit but the
        free memory) allow; the goodput policy measures its costs at every batch size a power of
        two up to that. Returns (slots, positions per slot)."""
        k = self.k_choice.k
        max_len = max_model_len + self.k_choice.margin(k) + 1
        num_slots = max_num_seqs
        if kv_cache_bytes is not None:
            per_slot = self.target.model.cache_bytes(1, max_len)
            num_slots = min(num_slots, kv_cache_bytes // per_slot)
            if num_slots < 1:
                raise CacheTooLarge(
                    f"one sequence of {max_len:,} positions needs {per_slot / 1e6:,.1f} MB of key/value "
                    f"cache, more than the budget of {kv_cache_bytes / 1e6:,.1f} MB; lower "
                    "max_model_len or raise the budget"
                )
        self._reserve(num_slots, max_len, 0, k)
        if self.k_choice.policy is not None:
            for batch_size in (1 << i for i in range(num_slots.bit_length())):
                self._calibrate(batch_size, max_len, k)
        return num_slots, self.target.max_len

    def _reserve(self, max_batch: int, max_len: int, num_forwards: int, k: int) -> None:
        """Caches for the work ahead (at most num_forwards target forwards, k drafts a round at
        most); the runners compile for it if they are to, and the policy measures its costs."""
        try:
            self.target.prepare(
                max_batch, max_len, self.k_choice.query_lengths(), num_forwards, return_hidden=self.return_hidden
            )
            if self.drafter is not None:
                self.drafter.reserve(max_batch, max_len, num_forwards)
        except CacheTooLarge as e:
            raise CacheTooLarge(
                f"{e}: {max_batch} sequences at once, each of up to {max_len:,} positions (prompt + "
                "max_tokens + k + 1); lower max_tokens, or max_num_seqs"
            ) from None
        if self.k_choice.policy is not None:
            self._calibrate(max_batch, max_len, k)

    def _calibrate(self, batch_size: int, max_len: int, k: int) -> None:
        """The goodput policy's costs at batch_size rows for every k up to k (once per batch
        bucket: goodput.py; a larger k later adds its lengths)."""
        policy, drafter = self.k_choice.policy, self.drafter
        assert policy is not None and drafter is not None  # goodput's k > 0: there is a drafter
        with stage(f"timing the round costs of {batch_size} row{'s' if batch_size > 1 else ''} for k by goodput"):
            policy.calibrate(
                batch_size,
                k,
                lambda num_tokens: self._time_target(batch_size, num_tokens, max_len),
                lambda: drafter.time_step(batch_size),
            )

    def warm_up(self, num_slots: int, repeats: int = 2) -> None:
        """Run, untimed, every target forward the rounds can take (1 to k + 1 tokens a row, all
        num_slots slots) and a draft step, `repeats` times each: the first calls of a shape
        allocate, pack weights and pick kernels, which a timed request should not pay. After
        sizing, before requests run (it writes where calibration does: _time_target)."""
        max_len = self.target.max_len
        with torch.inference_mode():
            for _ in range(repeats):
                for num_tokens in range(1, min(self.k_choice.k + 1, max_len - 1) + 1):  # the forwards the cache holds
                    self._time_target(num_slots, num_tokens, max_len)
                if self.drafter is not None:
                    self.drafter.time_step(num_slots)

    def _time_target(self, batch_size: int, num_tokens: int, max_len: int) -> None:
        """A target forward of num_tokens tokens per row for batch_size rows, in slots
        0..batch_size-1 before any sequence holds them, at positions from CALIBRATION_CONTEXT on
        (attention over as many keys as a typical prompt; what it writes there sits past every
        new sequence's length until that sequence overwrites it)."""
        device = self.target.device
        start = max(0, min(CALIBRATION_CONTEXT, max_len - num_tokens - 1))
        input_ids = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)  # [B, T]
        positions = start + torch.arange(num_tokens, device=device).expand(batch_size, num_tokens)  # [B, T]
        self.target(ForwardBatch.of(input_ids, positions, range(batch_size)), return_hidden=self.return_hidden)
