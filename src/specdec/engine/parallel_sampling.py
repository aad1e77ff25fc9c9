"""n completions of one request (SamplingParams.n), as vLLM's parallel sampling makes them.

A request with n > 1 runs as n sequences, its completions: the same prompt and parameters (n =
1), ids "{i}_{request id}", each sampled from its own random stream (a seeded request's
completion i from seed + i, as vLLM seeds them; without a seed, from the stream such requests
share) and each finishing on its own (its own stop string, EOS or length).

They share the prompt's cache blocks. Completion 0 is admitted first; the others wait (first come,
first served: so does every request behind them) until its prefill is done and its blocks are
registered in the prefix cache (scheduler.py, block_manager.py); then each takes the prompt's
whole blocks as they are (shared, reference-counted, never written again) and prefills only what
follows them: the prompt's last partial block, its own copy, computed again (at most 16
positions) rather than copied. Without prefix caching each completion prefills the whole prompt.

A request's outputs are its completions' (outputs.py): one RequestOutput under the request's id,
holding a CompletionOutput (index i) for each completion that moved, its metrics theirs merged,
finished once every completion has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from specdec.config import SamplingParams
from specdec.metrics import SpecStats
from specdec.outputs import RequestOutput
from specdec.sequence import Sequence


def fork(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    generator_for: Callable[[int | None], torch.Generator],
    **fields,
) -> list[Sequence]:
    """The sequences that run a request: itself where params.n is 1, else its n completions.
    generator_for(seed): the random stream of a sequence with that seed; fields: Sequence's other
    fields (prompt, stream_text, cache_scope)."""
    if params.n == 1:
        return [Sequence(request_id, list(prompt_token_ids), params, generator_for(params.seed), **fields)]
    completions: list[Sequence] = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        # the prompt's logprobs are the request's: the first completion computes them
        prompt_logprobs = params.prompt_logprobs if index == 0 else None
        completion_params = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
        completions.append(
            Sequence(
                f"{index}_{request_id}",
                list(prompt_token_ids),
                completion_params,
                generator_for(seed),
                parent_id=request_id,
                index=index,
                fork_of=completions[0] if completions else None,
                **fields,
            )
        )
    return completions


class RequestTable:
    """The unfinished requests: each sequence by its id, and the sequences of a request of n > 1
    completions by the request's id."""

    def __init__(self) -> None:
        self._sequences: dict[str, Sequence] = {}
        self._completions: dict[str, list[Sequence]] = {}

    def add(self, seqs: list[Sequence]) -> None:
        """A request's sequences (fork's), all or (a ValueError naming an id in use) none."""
        ids = [seq.parent_id for seq in seqs[:1] if seq.parent_id is not None] + [seq.request_id for seq in seqs]
        taken = next((i for i in ids if i in self._sequences or i in self._completions), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} is already running or waiting; give each a new id")
        self._sequences.update((seq.request_id, seq) for seq in seqs)
        if seqs[0].parent_id is not None:
            self._completions[seqs[0].parent_id] = seqs

    def remove(self, seq: Sequence) -> None:
        """A sequence out of the engine (finished or aborted)."""
        del self._sequences[seq.request_id]

    def pop(self, request_id: str) -> list[str]:
        """The ids of the sequences that run request_id (its own where it is no parent), forgetting it."""
        completions = self._completions.pop(request_id, None)
        return [request_id] if completions is None else [seq.request_id for seq in completions]

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs (each sequence's, under its request's id: OutputProcessor.new_output),
        one per request: a parent's completions that moved joined, in index order, finished once
        all its completions are (it is then forgotten)."""
        by_request: dict[str, RequestOutput] = {}  # a request's first output, its completions' joined into it
        for output in outputs:
            joined = by_request.setdefault(output.request_id, output)
            if joined is not output:  # each output's list of completions is its own (new_output's)
                joined.outputs += output.outputs
                joined.prompt_logprobs = joined.prompt_logprobs or output.prompt_logprobs
        for request_id, joined in by_request.items():
            completions = self._completions.get(request_id)
            if completions is None:
                continue
            joined.outputs.sort(key=lambda completion: completion.index)
            joined.metrics = SpecStats.merge([seq.stats for seq in completions])
            joined.finished = all(seq.finished for seq in completions)
            if joined.finished:
                del self._completions[request_id]
        return list(by_request.values())
