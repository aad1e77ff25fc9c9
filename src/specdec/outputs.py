"""What generation returns, in vLLM's shapes: a RequestOutput per request, holding one
CompletionOutput (specdec samples one completion per request).

LLM.generate returns each request's whole output. Engine.step returns, for each request that
moved, only what is new since its last RequestOutput (the tokens, and the text where the request
asked for streaming text), with finished set on the last one: a stream's deltas join into the
whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.metrics import SpecStats


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the most likely tokens' (id,
    log-probability) pairs, most likely first (SamplingParams.logprobs of them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens are more likely (vLLM's)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop token or string), "length" (max_tokens), "abort"; None: running
    from_draft: list[bool] = field(default_factory=list)  # per token id: accepted from the drafter?
    logprobs: list[TokenLogprob] | None = None  # per token id, when SamplingParams.logprobs asked for them


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: SpecStats = field(default_factory=SpecStats)
    finished: bool = True
    # per prompt token, when SamplingParams.prompt_logprobs asked for them: None for the first (no
    # token before it), then each token's TokenLogprob given the ones before; in the request's
    # first output that has them all (a stream's first tokens), and in its whole output
    prompt_logprobs: list[TokenLogprob | None] | None = None
