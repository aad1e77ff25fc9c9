"""The round loop: where the target, the drafter and the rejection sampler meet.

A round, for every running sequence at once:
  propose   the drafter drafts up to k tokens per row
  verify    one target forward over [last token, drafts] gives p at every draft position
            and one past it; rejection sampling keeps a prefix and adds one token
  emit      tokens are appended one by one, stopping at EOS / stop strings / max_tokens even
            inside an accepted run; finished rows leave the batch and free their slot

Invariant between rounds: the target's cache holds K/V for every token of a sequence but
the last, which is fed first in the next round's verify forward.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.kv_cache import CacheTooLarge, ragged_batch
from specdec.models.tokenizer import Tokenizer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingTensors, sample, warp
from specdec.sequence import Sequence
from specdec.verify import greedy_verify, rejection_sample


class Engine:
    def __init__(self, target: ModelRunner, drafter: Drafter | None, num_speculative_tokens: int,
                 eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None, max_num_seqs: int = 256):
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.cache = None
        self._sampling_key, self._sampling = None, None
        self.timings = {"prefill": 0.0, "draft": 0.0, "target": 0.0, "sampling": 0.0, "bookkeeping": 0.0}

    def prepare(self, seqs: list[Sequence]) -> int:
        """Size the caches for generating seqs (and compile for it, where the runners are to);
        returns how many run at once."""
        max_batch = min(self.max_num_seqs, len(seqs))
        # + k + 1: verify positions run k past the last token, and the last position is kept
        # free for padding (see kv_cache.ragged_batch)
        max_len = max(s.num_tokens + s.params.max_tokens for s in seqs) + self._usable_k(seqs) + 1
        waves = -(-len(seqs) // max_batch)
        self._reserve(max_batch, max_len, num_forwards=waves * max(s.params.max_tokens for s in seqs))
        return max_batch

    def run(self, seqs: list[Sequence]) -> None:
        """Generate every sequence to completion (continuous batching over free slots)."""
        max_batch = self.prepare(seqs)
        for key in self.timings:
            self.timings[key] = 0.0
        self._sampling_key = None  # an earlier call's requests may share ids with these
        start = time.perf_counter()
        waiting, running = deque(seqs), []
        free_slots = list(range(max_batch))[::-1]
        while waiting or running:
            admitted = []
            while waiting and free_slots:
                seq = waiting.popleft()
                seq.slot = free_slots.pop()
                admitted.append(seq)
            if admitted:
                self._prefill(admitted)
                running += admitted
            running = self._retire(running, free_slots, start)
            if running:
                self._round(running)
                running = self._retire(running, free_slots, start)

    def _reserve(self, max_batch: int, max_len: int, num_forwards: int) -> None:
        """Caches for the work ahead (at most num_forwards target forwards); the runners
        compile for it if they are to."""
        query_lengths = (self.k + 1,)  # every round verifies k drafts (fewer are padded)
        try:
            self.cache = self.target.prepare(max_batch, max_len, query_lengths, num_forwards, self.cache)
            if self.drafter is not None:
                self.drafter.reserve(max_batch, max_len, num_forwards)
        except CacheTooLarge as e:
            raise CacheTooLarge(f"{e}: {max_batch} sequences at once, each of up to {max_len:,} positions (prompt + "
                                "max_tokens + k + 1); lower max_tokens, or max_num_seqs") from None

    def _retire(self, running: list[Sequence], free_slots: list[int], start: float) -> list[Sequence]:
        still_running = []
        for seq in running:
            if seq.finished:
                seq.stats.seconds = time.perf_counter() - start
                seq.text = self._final_text(seq)
                free_slots.append(seq.slot)
                if self.drafter is not None:
                    self.drafter.release(seq)
            else:
                still_running.append(seq)
        return still_running

    def _prefill(self, batch: list[Sequence]) -> None:
        """One target forward over the new prompts; samples each one's first token."""
        t0 = time.perf_counter()
        device = self.target.device
        input_ids, positions, last = ragged_batch([s.prompt_token_ids for s in batch], [0] * len(batch), self.cache)
        self.cache.use_slots([s.slot for s in batch])
        logits = self.target.last_token_logits(input_ids.to(device), positions.to(device), self.cache, last)  # [B, V]
        probs = warp(logits, SamplingTensors.from_params([s.params for s in batch], device))
        first_tokens = sample(probs, [s.generator for s in batch]).tolist()
        for seq, token in zip(batch, first_tokens):
            seq.stats.record_round(0, 0, self._emit(seq, [token], num_from_draft=0))
        self.timings["prefill"] += time.perf_counter() - t0

    def _round(self, batch: list[Sequence]) -> None:
        device = self.target.device
        sampling = self._sampling_tensors(batch)
        k = self._usable_k(batch)
        t0 = time.perf_counter()
        draft = self.drafter.propose(batch, k, sampling) if k else Draft.empty(len(batch), device)
        t1 = time.perf_counter()
        room = torch.tensor([s.draft_room for s in batch], device=device)  # [B]
        num_draft = torch.minimum(draft.num_tokens, room)  # [B]
        input_ids, positions = self._verify_inputs(batch, draft)  # [B, k+1] each
        self.cache.use_slots([s.slot for s in batch])
        target_logits = self.target(input_ids, positions, self.cache)  # [B, k+1, V]
        t2 = time.perf_counter()
        output, num_accepted = self._verify(batch, sampling, draft, num_draft, target_logits)
        t3 = time.perf_counter()
        num_proposed, num_accepted_list = num_draft.tolist(), num_accepted.tolist()
        for row, seq in enumerate(batch):
            tokens = output[row, :num_accepted_list[row] + 1].tolist()
            emitted = self._emit(seq, tokens, num_from_draft=num_accepted_list[row])
            seq.stats.record_round(num_proposed[row], num_accepted_list[row], emitted)
        if self.drafter is not None:
            self.drafter.observe(batch, num_accepted)
        t4 = time.perf_counter()
        for key, seconds in (("draft", t1 - t0), ("target", t2 - t1), ("sampling", t3 - t2), ("bookkeeping", t4 - t3)):
            self.timings[key] += seconds

    def _usable_k(self, seqs: list[Sequence]) -> int:
        """The round's k: no wider than the most drafts any row has room for (a larger k would
        be drafted and verified for nothing; each row is also cut to its own room)."""
        return min(self.k, max(s.draft_room for s in seqs))

    def _verify(self, batch, sampling: SamplingTensors, draft: Draft, num_draft: torch.Tensor,
                target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling (greedy: prefix matching) -> output_token_ids [B, k+1], num_accepted [B]."""
        if sampling.all_greedy:  # no probabilities needed
            return greedy_verify(draft.token_ids, num_draft, target_logits.argmax(-1))
        B, T, V = target_logits.shape  # T = k + 1
        target_probs = warp(target_logits.reshape(B * T, V), sampling.repeat_rows(T)).view(B, T, V)
        return rejection_sample(draft.token_ids, num_draft, draft.probs, target_probs, [s.generator for s in batch],
                                sampling.greedy if sampling.any_greedy else None)

    def _sampling_tensors(self, batch: list[Sequence]) -> SamplingTensors:
        """The batch's settings as tensors, rebuilt only when the batch changes."""
        key = tuple(seq.request_id for seq in batch)
        if key != self._sampling_key:
            self._sampling_key = key
            self._sampling = SamplingTensors.from_params([s.params for s in batch], self.target.device)
        return self._sampling

    def _verify_inputs(self, batch: list[Sequence], draft: Draft) -> tuple[torch.Tensor, torch.Tensor]:
        """[last token, d_1..d_k] at positions [L-1 .. L-1+k] per row: [B, k+1] each."""
        device = self.target.device
        last_tokens = torch.tensor([s.last_token_id for s in batch], device=device)[:, None]  # [B, 1]
        input_ids = torch.cat([last_tokens, draft.token_ids], dim=1)  # [B, k+1]
        first_positions = torch.tensor([s.num_tokens - 1 for s in batch], device=device)[:, None]  # [B, 1]
        positions = first_positions + torch.arange(input_ids.shape[1], device=device)  # [B, k+1]
        return input_ids, positions

    def _emit(self, seq: Sequence, tokens: list[int], num_from_draft: int) -> int:
        """Append tokens to seq until one of them finishes it; returns how many were emitted.
        The first num_from_draft tokens are accepted drafts, the rest the target's own."""
        params = seq.params
        for count, token in enumerate(tokens, start=1):
            seq.output_token_ids.append(token)
            seq.output_from_draft.append(count <= num_from_draft)
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif params.stop and _stop_string_index(self._output_text(seq), params.stop) is not None:
                seq.finish_reason = "stop"
            elif seq.remaining_tokens <= 0:
                seq.finish_reason = "length"
            if seq.finished:
                return count
        return len(tokens)

    def _final_text(self, seq: Sequence) -> str:
        """The decoded output, cut before the first stop string."""
        text = self._output_text(seq)
        cut = _stop_string_index(text, seq.params.stop)
        return text if cut is None else text[:cut]

    def _output_text(self, seq: Sequence) -> str:
        """The output's text as it reads after the prompt (Tokenizer.decode_after)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode_after(seq.prompt_token_ids, seq.output_token_ids)


def _stop_string_index(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first of the stop strings starts in text, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None
