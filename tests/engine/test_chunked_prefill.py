"""Chunked prefill: a step prefills at most max_prefill_tokens (rows x the longest chunk), and at
most what max_prefill_seconds affords at the cost per token measured so far; a prompt longer than
that over several steps while the others decode, with the same tokens as a prefill in one piece;
a request aborted between chunks is fed no further."""

from __future__ import annotations

import pytest
import torch
from test_preemption import drafter_kwargs, serve_all

from helpers import random_prompts
from specdec import LLM, SamplingParams
from specdec.engine.prefill_budget import MIN_TOKENS, PrefillBudget

BUDGET = 24


def recorded_feeds(llm: LLM, monkeypatch) -> list[list[int]]:
    """Each prefill forward's row lengths, as the target's runner is fed them."""
    feeds: list[list[int]] = []
    feed = llm.runner.feed

    def recorded(chunks, *args, **kwargs):
        feeds.append([len(chunk) for chunk in chunks])
        return feed(chunks, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "feed", recorded)
    return feeds


@pytest.mark.parametrize("drafter", ["none", "draft_model", "eagle"])
def test_long_prompts_are_prefilled_in_chunks_within_the_budget_with_the_same_tokens(
    tiny_pair, tmp_path, drafter, monkeypatch
):
    """Four prompts of 40-100 tokens, greedy and seeded sampled, with a budget of 24 tokens a
    step: every prefill forward stays within it (rows x the longest chunk), the long prompts
    take several, and every request's tokens are those of a prefill in one piece."""

    def new_llm():  # its prefix cache empty (an engine keeps its prefixes from one prepare to the next)
        kwargs = drafter_kwargs(drafter, tiny_pair, tmp_path)
        return LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=4, **kwargs)

    prompts = random_prompts(4, seed=61, lengths=(40, 100))
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, **(dict(temperature=0) if i % 2 else dict(seed=i, top_p=0.9)))
        for i in range(4)
    ]
    whole, _ = serve_all(new_llm(), prompts, params, None, max_model_len=160)
    llm = new_llm()
    feeds = recorded_feeds(llm, monkeypatch)
    assert serve_all(llm, prompts, params, None, max_model_len=160, max_prefill_tokens=BUDGET)[0] == whole
    assert all(len(rows) * max(rows) <= BUDGET for rows in feeds)
    assert sum(map(sum, feeds)) == sum(map(len, prompts))  # every prompt token fed once
    assert len(feeds) >= sum(map(len, prompts)) // BUDGET


def test_a_request_aborted_between_chunks_is_fed_no_further(tiny_pair, monkeypatch):
    """A 120-token prompt with a budget of 16: after two steps it has had two chunks; aborted,
    it is fed nothing more, holds no block, and the engine is idle."""
    llm = LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=2, speculative_method="none")
    engine = llm.engine
    engine.prepare_to_serve(max_model_len=160, max_prefill_tokens=16)
    feeds = recorded_feeds(llm, monkeypatch)
    engine.add_request("long", random_prompts(1, seed=62, lengths=(120, 121))[0], SamplingParams(max_tokens=4))
    with torch.inference_mode():
        assert engine.step() == [] and engine.step() == []  # no token yet: its prefill is under way
        assert feeds == [[16], [16]]
        assert engine.abort("long")
        engine.step()
    assert feeds == [[16], [16]] and not engine.has_unfinished_requests()
    assert engine.capacity.blocks is not None and engine.capacity.blocks.num_held == 0


def test_the_time_bound_lowers_a_steps_prefill_to_what_it_affords(tiny_pair, monkeypatch):
    """A token bound of 512 and a time bound far below what any forward takes: the first step
    prefills within the token bound (no cost measured yet); every later one at most MIN_TOKENS,
    with the same tokens as a prefill in one piece."""

    def new_llm():  # its prefix cache empty (an engine keeps its prefixes from one prepare to the next)
        return LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=4, speculative_method="none")

    prompts = random_prompts(4, seed=63, lengths=(60, 120))
    params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=i) for i in range(4)]
    whole, _ = serve_all(new_llm(), prompts, params, None, max_model_len=160)
    llm = new_llm()
    feeds = recorded_feeds(llm, monkeypatch)
    served, _ = serve_all(
        llm, prompts, params, None, max_model_len=160, max_prefill_tokens=512, max_prefill_seconds=1e-9
    )
    assert served == whole
    assert len(feeds[0]) * max(feeds[0]) <= 512
    assert all(len(rows) * max(rows) <= MIN_TOKENS for rows in feeds[1:])
    assert sum(map(sum, feeds)) == sum(map(len, prompts))


def test_the_budget_affords_the_time_bound_at_the_measured_cost():
    """The reference: seconds / (a running mean of seconds per token), within the token bound,
    never below MIN_TOKENS; no time bound, or no cost measured yet: the token bound."""
    budget = PrefillBudget(max_tokens=512, max_seconds=0.25)
    assert budget.tokens() == 512  # nothing measured yet
    budget.record(400, 1.0)  # 2.5 ms a token: 0.25 s affords 100
    assert budget.tokens() == 100
    budget.record(100, 0.1)  # 1 ms a token: the mean moves 0.3 of the way, to 2.05 ms
    assert budget.seconds_per_token == pytest.approx(0.7 * 0.0025 + 0.3 * 0.001)
    assert budget.tokens() == int(0.25 / (0.7 * 0.0025 + 0.3 * 0.001))
    budget.record(10, 10.0)  # one very slow step: the budget floors at MIN_TOKENS
    assert budget.tokens() == MIN_TOKENS
    assert PrefillBudget(max_tokens=None, max_seconds=None).tokens() is None
    fast = PrefillBudget(max_tokens=64, max_seconds=1.0)
    fast.record(64, 0.001)
    assert fast.tokens() == 64  # the token bound holds when time affords more
    for bad in ({"max_seconds": 0.0}, {"max_seconds": float("nan")}, {"max_tokens": 0}):
        with pytest.raises(ValueError, match="must be"):
            PrefillBudget(**bad)
