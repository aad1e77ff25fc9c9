"""A Sequence: one request's state while the engine runs it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.config import SamplingParams
from specdec.metrics import SpecStats


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # its own when params.seed is set, else the LLM's shared one
    prompt: str | None = None
    slot: int = -1  # its row in the KV caches' block table while running
    num_cached_tokens: int = 0  # leading positions found in the prefix cache when it was admitted (not prefilled)
    num_drafter_cached_tokens: int = 0  # of those, the ones whose entries a drafter's cache in the pool holds too
    num_prefilled: int | None = None  # while its prefill is under way (in chunks): the positions of
    # prefill_token_ids whose entries the target's cache holds; None once it is done (or not begun)
    output_token_ids: list[int] = field(default_factory=list)
    output_from_draft: list[bool] = field(default_factory=list)  # per output token: an accepted draft token?
    output_logprobs: list = field(default_factory=list)  # per output token, when params.logprobs asks: TokenLogprob
    # per prompt token, when params.prompt_logprobs asks (its prefill fills them): None for the first, then a
    # TokenLogprob each; reported in its first output once all are there
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_reported: bool = False
    text: str = ""  # filled when finished (cut before a stop string)
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.perf_counter)  # when the engine was given it
    num_tokens_reported: int = 0  # output tokens already returned by Engine.step
    text_reported: str = ""  # output text already returned by Engine.step (streaming text only)
    stream_text: bool = False  # Engine.step returns each step's new text (decoding the output each step)
    # whose requests may draft from this one's text (suffix decoding's shared tree): requests of one
    # scope share it, no other (a server's API key, under --suffix-cache-scope key); None: the one global scope
    cache_scope: str | None = None
    grammar: Any = None  # its structured output's state (grammar.GrammarState), made where it first samples
    # one of a request's n completions (SamplingParams.n, engine/parallel_sampling.py): the request's id,
    # its completion's index, and the sibling whose prompt blocks it waits for (None: it prefills its own)
    parent_id: str | None = None
    index: int = 0
    fork_of: Sequence | None = None

    @property
    def output_request_id(self) -> str:
        """The id its outputs are reported under: its request's (one of n completions), else its own."""
        return self.request_id if self.parent_id is None else self.parent_id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefill_token_ids(self) -> list[int]:
        """What a prefill feeds: a new sequence's prompt, whose next token it samples; a sequence
        recomputed after preemption, all its tokens but the last, which the next round feeds as
        it would have (so nothing is sampled twice and its generator's draws stay in step)."""
        return self.token_ids[:-1] if self.output_token_ids else self.prompt_token_ids

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled is not None

    @property
    def num_written(self) -> int:
        """The leading positions whose entries the target's cache holds: all but the last token's
        once prefilled, fewer while a prefill is under way."""
        return self.num_tokens - 1 if self.num_prefilled is None else self.num_prefilled

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def draft_room(self) -> int:
        """The most draft tokens worth proposing for it in a round: what it can still emit,
        less the token the round adds itself, and no more than its own num_speculative_tokens."""
        room = max(0, self.remaining_tokens - 1)
        cap = self.params.num_speculative_tokens
        return room if cap is None else min(room, cap)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
