"""The step-based engine: requests join and leave between steps (continuous batching), each
with its own num_speculative_tokens, and abort frees a slot; the deltas step() returns join
into exactly what LLM.generate returns for the request alone."""

from __future__ import annotations

import pytest
import torch

from helpers import random_prompts as shared_random_prompts
from helpers import save_random_head
from specdec import LLM, SamplingParams


def random_prompts(n: int, seed: int, **kwargs) -> list[list[int]]:
    return shared_random_prompts(n, seed, lengths=(3, 20), **kwargs)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return LLM(str(tiny_pair["target"]), dtype="float32", speculative_method="none")


def speculative(tiny_pair, k: int = 3, max_num_seqs: int = 256) -> LLM:
    return LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=k,
        speculative_k_policy="fixed",
        max_num_seqs=max_num_seqs,
    )


def run_to_end(engine, joined: dict, late: list[tuple[int, str, list[int], SamplingParams]] = ()) -> list[int]:
    """Step until done, joining each request's deltas (token ids, text, finish reason) in joined;
    late (step, id, prompt, params): requests added before that step. Returns the running
    counts seen after each step."""
    running, step = [], 0
    with torch.inference_mode():
        while engine.has_unfinished_requests() or any(s >= step for s, *_ in late):
            for _, request_id, prompt, params in [entry for entry in late if entry[0] == step]:
                engine.add_request(request_id, prompt, params)
            for output in engine.step():
                ids, text, reason = joined.setdefault(output.request_id, ([], [], [None]))
                ids += output.outputs[0].token_ids
                text.append(output.outputs[0].text)
                reason[0] = output.outputs[0].finish_reason
                assert output.finished == (output.outputs[0].finish_reason is not None)
            running.append(engine.num_running)
            step += 1
    return running


def test_requests_joining_between_steps_get_what_they_get_alone(tiny_pair, plain):
    llm = speculative(tiny_pair, max_num_seqs=2)  # four requests, two slots: two wait
    prompts = random_prompts(5, seed=1)
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        GREEDY,
        SamplingParams(temperature=1.0, max_tokens=17, ignore_eos=True, seed=7),
        GREEDY,
    ]
    expected = [plain.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    # a seeded sampled request draws the same numbers whatever runs beside it (not plain decoding's)
    expected[3] = speculative(tiny_pair).generate(prompts[3], params[3])[0].outputs[0].token_ids
    llm.engine.prepare_to_serve(max_model_len=64)
    joined = {}
    late = [
        (0, "a", prompts[0], params[0]),
        (0, "b", prompts[1], params[1]),
        (0, "c", prompts[2], params[2]),
        (3, "d", prompts[3], params[3]),
        (5, "e", prompts[4], params[4]),
    ]
    running = run_to_end(llm.engine, joined, late)
    assert max(running) == 2 and running[-1] == 0
    for request_id, want in zip("abcde", expected):
        ids, _, reason = joined[request_id]
        assert ids == want, request_id
        assert reason == ["length"]


DRAFTERS = {
    "draft_model": lambda tiny_pair: dict(speculative_model=str(tiny_pair["target"])),
    "ngram": lambda tiny_pair: dict(speculative_method="ngram"),
    "eagle": lambda tiny_pair: dict(
        speculative_model=str(save_random_head(tiny_pair["target"], tiny_pair["target"].parent / "head", seed=3))
    ),
    "early_exit": lambda tiny_pair: dict(speculative_method="early_exit", early_exit_layer=1),
}


@pytest.mark.parametrize("method", DRAFTERS)
def test_each_request_speculates_at_most_its_own_k(tiny_pair, plain, method):
    llm = LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        **DRAFTERS[method](tiny_pair),
    )
    prompts = [prompt * 3 for prompt in random_prompts(4, seed=2)]  # repeats, for prompt lookup to find
    caps = [0, 1, None, 9]  # none, one a round, the engine's k, more than the engine's k
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=cap) for cap in caps]
    outputs = llm.generate(prompts, params)  # one batch, mixed
    expected = plain.generate(prompts, GREEDY)
    for cap, output, want in zip(caps, outputs, expected):
        assert output.outputs[0].token_ids == want.outputs[0].token_ids, cap
        largest_k = len(output.metrics.rounds_by_k) - 1  # rounds_by_k[k]: rounds at k
        assert largest_k == min(4, 4 if cap is None else cap), cap
        assert len(output.metrics.proposed_by_position) <= largest_k  # no draft past its own k
    assert outputs[0].metrics.num_draft_tokens == 0 and outputs[0].metrics.tokens_per_forward == 1.0
    assert outputs[2].metrics.num_draft_tokens > 0


def test_abort_frees_the_slot_and_drops_a_waiting_request(tiny_pair):
    llm = speculative(tiny_pair, max_num_seqs=1)
    engine = llm.engine
    engine.prepare_to_serve(max_model_len=64)
    prompts = random_prompts(3, seed=3)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with torch.inference_mode():
        for request_id, prompt in zip("xyz", prompts):
            engine.add_request(request_id, prompt, long)
        engine.step()
        assert (engine.num_running, engine.num_waiting) == (1, 2)
        assert engine.abort("y")  # waiting: never runs
        assert engine.abort("x")  # running: its slot is free at the next step
        assert not engine.abort("x") and not engine.abort("nobody")
        assert (engine.num_running, engine.num_waiting) == (0, 1)
        outputs = engine.step()
        assert [o.request_id for o in outputs] == ["z"] and engine.num_running == 1
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("x", prompts[0], GREEDY)  # a finished or aborted id can be used again
    assert engine.abort("x")


def test_streamed_text_joins_into_the_final_text_and_holds_back_stop_strings(tiny_pair, plain):
    prompt = "def add(a, b):"
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = free.text  # a stop string from its second half, first met there: the output streams before it
    stops = [text[i : i + 3] for i in range(len(text) // 2, len(text) - 3)]
    stop = next((s for s in stops if len(s.strip()) >= 2 and text.find(s) >= len(text) // 2), None)
    assert stop is not None, f"the test needs a visible stop string in the second half of {text!r}"
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = plain.generate(prompt, params)[0].outputs[0]
    llm = speculative(tiny_pair)
    llm.engine.prepare_to_serve(max_model_len=64)
    deltas = []
    with torch.inference_mode():
        llm.engine.add_request("s", llm.prompt_token_ids(prompt, params), params, stream_text=True)
        while llm.engine.has_unfinished_requests():
            deltas += [o.outputs[0].text for o in llm.engine.step()]
    assert "".join(deltas) == want.text and want.finish_reason == "stop"
    assert sum(1 for d in deltas if d) >= 2, deltas  # streamed, not all at the end
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_serving_sizes_the_cache_by_budget_and_refuses_what_does_not_fit(tiny_pair):
    """max_num_seqs slots, and as many 16-position blocks as the budget holds (the scratch block
    among them), a block's bytes being the target's cache's and the draft's (here the target
    again: twice the target's); a budget below one sequence of max_model_len is refused."""
    llm = speculative(tiny_pair, max_num_seqs=8)
    block_bytes = 2 * llm.runner.model.position_bytes * 16
    assert llm.engine.prepare_to_serve(max_model_len=64, kv_cache_bytes=13 * block_bytes + 5) == 8
    assert llm.engine.scheduler.num_slots == 8
    assert llm.engine.capacity.cache_tokens == 12 * 16  # 13 blocks, one the scratch block
    with pytest.raises(ValueError, match="needs .* cache positions"):
        llm.engine.add_request("long", list(range(2, 60)), SamplingParams(max_tokens=10))
    llm.engine.add_request("ok", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="already running or waiting"):
        llm.engine.add_request("ok", [5, 6, 7], GREEDY)
    llm.engine.abort("ok")
    one_sequence = -(-(64 + 3 + 1) // 16) * block_bytes  # max_model_len + k + 1 positions
    assert llm.engine.prepare_to_serve(max_model_len=64, kv_cache_bytes=one_sequence + block_bytes) == 8
    assert (
        llm.engine.capacity.cache_tokens == one_sequence // block_bytes * 16
    )  # the smaller budget, not the pool before
    with pytest.raises(ValueError, match="more than the budget of .*raise the budget"):
        llm.engine.prepare_to_serve(max_model_len=64, kv_cache_bytes=one_sequence)


def test_engines_sharing_a_machine_split_the_default_budget(tiny_pair, monkeypatch):
    """Without a budget, half the free memory (here 400 blocks' worth): 200 blocks for one engine,
    50 each for 4 (Ray Serve replicas on one machine), the scratch block among them."""
    llm = speculative(tiny_pair, max_num_seqs=64)
    block_bytes = llm.engine.capacity.position_bytes * 16
    monkeypatch.setattr("specdec.engine.capacity.free_memory_bytes", lambda device: 400 * block_bytes)
    for engines, blocks in ((1, 200), (4, 50)):
        llm.engine.prepare_to_serve(max_model_len=64, engines_sharing=engines)
        assert llm.engine.capacity.cache_tokens == (blocks - 1) * 16


@pytest.mark.parametrize("length", [1, 3])
def test_a_stop_string_late_in_a_long_output_cuts_it_where_it_first_appears(tiny_pair, plain, length):
    """The stop check reads only the output's last tokens: a stop string far past the window
    (4 x its length + 1 tokens) still cuts the text at its first occurrence."""
    prompt = "class Point:\n"
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0].outputs[0]
    late = next(
        i
        for i in range(len(free.text) * 3 // 4, len(free.text) - length)
        if free.text[i : i + length].isascii()
        and free.text[i : i + length].isprintable()
        and free.text[i : i + length].strip()
    )
    stop = free.text[late : late + length]
    cut = free.text.find(stop)
    assert cut > 0
    for llm in (plain, speculative(tiny_pair)):
        got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, stop=[stop]))[0]
        assert got.outputs[0].text == free.text[:cut] and got.outputs[0].finish_reason == "stop"
        assert len(got.outputs[0].token_ids) > 4 * length + 1  # past the window: the tail alone was read


def test_a_prefill_budget_starts_a_burst_over_several_steps():
    """Admission counts a prefill's tokens as the forward runs them (rows x the longest prompt);
    a prompt over the budget still starts, alone."""
    from specdec.engine.scheduler import Scheduler
    from specdec.sequence import Sequence

    scheduler = Scheduler(num_slots=8, max_prefill_tokens=40)
    for name, length in zip("abcde", (10, 10, 30, 5, 50)):
        scheduler.add(Sequence(name, list(range(length)), GREEDY, torch.Generator()))
    started = []
    while scheduler.waiting:
        started.append([seq.request_id for seq in scheduler.admit()])
    assert started == [["a", "b"], ["c"], ["d"], ["e"]]  # 3 x 30 and 2 x 30 > 40; 2 x 50 > 40


# ---------------------------------------------------------------------------------------------
# Cache blocks: requests hold what they use; a short pool preempts, never loses a request.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "draft_model", "eagle", "staged"])
def test_a_pool_too_small_for_every_request_preempts_and_keeps_each_output(tiny_pair, plain, tmp_path, drafter):
    """Six requests of up to 48 + 60 positions over a pool of 15 blocks (240 positions): they
    cannot all hold their blocks at once, so the youngest are preempted and prefilled anew
    later. Greedy, each output is still what the target alone gives it; no block is leaked."""
    kwargs = drafter_kwargs(drafter, tiny_pair, tmp_path)
    llm = LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=6, **kwargs)
    block_bytes = llm.engine.capacity.position_bytes * 16  # the target's and the drafter's
    llm.engine.prepare_to_serve(max_model_len=128, kv_cache_bytes=16 * block_bytes)
    prompts = shared_random_prompts(6, seed=31, lengths=(20, 48))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(plain.generate(prompts, params))}
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params)
    joined: dict = {}
    run_to_end(llm.engine, joined)
    assert {request_id: ids for request_id, (ids, _, _) in joined.items()} == expected
    assert llm.engine.scheduler.num_preemptions > 0
    blocks = llm.engine.capacity.blocks
    assert blocks is not None and blocks.num_free == blocks.num_blocks - 1 and blocks.num_held == 0


@pytest.mark.parametrize("drafter", ["none", "draft_model", "eagle", "staged"])
def test_a_shared_prefix_is_prefilled_once_and_outputs_are_the_same(tiny_pair, plain, tmp_path, drafter, monkeypatch):
    """Requests sharing a 50-token system prompt, each added after the one before has run a
    round, then a second turn of the first (its prompt, its answer, a new message) after it
    finished: from the second request on, the whole blocks found in the prefix cache are not
    prefilled (the system prompt's 3; the second turn's, up to its first answer's last entry
    written); greedy, every output is what the target alone gives it, and what the engine gives
    with prefix caching off."""
    kwargs = drafter_kwargs(drafter, tiny_pair, tmp_path)
    system = shared_random_prompts(1, seed=41, lengths=(50, 51))[0]
    prompts = [system + tail for tail in shared_random_prompts(4, seed=42, lengths=(2, 20))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = plain.generate(prompts[:1], params)[0].outputs[0].token_ids
    prompts.append(prompts[0] + first + [5, 6, 7])  # the first request's second turn
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(plain.generate(prompts, params))}
    # the first turn wrote entries up to its last token's, exclusive: its whole blocks before that
    second_turn_cached = (len(prompts[0]) + len(first) - 1) // 16 * 16
    draft_fed = {}
    for caching in (True, False):
        llm = LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=4, enable_prefix_caching=caching, **kwargs)
        llm.engine.prepare_to_serve(max_model_len=128)
        fed = recording(llm.runner, "feed", monkeypatch)
        if drafter == "draft_model":
            draft_fed[caching] = recording(llm.engine.drafter.runner, "ragged_batch", monkeypatch)
        late = [(2 * i, f"r{i}", prompt, params) for i, prompt in enumerate(prompts[:4])]
        late.append((40, "r4", prompts[4], params))  # after the first request finished
        joined: dict = {}
        run_to_end(llm.engine, joined, late)
        assert {request_id: ids for request_id, (ids, _, _) in joined.items()} == expected
        cached = [0, 48, 48, 48, second_turn_cached] if caching else [0] * 5
        assert fed == [len(prompt) - c for prompt, c in zip(prompts, cached)]
        assert llm.engine.capacity.prefix_cache_counts == ((sum(map(len, prompts)), sum(cached)) if caching else (0, 0))
    if drafter == "draft_model":  # the draft's cache skips the same cached prefixes (its entries are there)
        assert sum(draft_fed[False]) - sum(draft_fed[True]) == sum([0, 48, 48, 48, second_turn_cached])


@pytest.mark.parametrize("drafter", ["none", "draft_model", "eagle"])
def test_generate_calls_one_after_another_find_the_prefixes_of_the_calls_before(tiny_pair, plain, tmp_path, drafter):
    """A batch job sent through LLM.generate one request at a time: each call finds the whole
    blocks of the 50-token system prompt that an earlier call prefilled (vLLM's LLM keeps its
    prefix cache across calls too), until a longer request makes the engine size new caches
    (their entries empty): that call finds none, the one after it finds them again. Greedy,
    every output is what the target alone gives it."""
    kwargs = drafter_kwargs(drafter, tiny_pair, tmp_path)
    system = shared_random_prompts(1, seed=44, lengths=(50, 51))[0]
    prompts = [system + tail for tail in shared_random_prompts(4, seed=45, lengths=(2, 20))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    params[2] = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)  # longer: new caches
    expected = [plain.generate([prompt], p)[0].outputs[0].token_ids for prompt, p in zip(prompts, params)]
    llm = LLM(str(tiny_pair["target"]), dtype="float32", **kwargs)
    hits = []
    for prompt, p, want in zip(prompts, params, expected):
        before = llm.engine.capacity.prefix_cache_counts[1]
        assert llm.generate([prompt], p)[0].outputs[0].token_ids == want
        hits.append(llm.engine.capacity.prefix_cache_counts[1] - before)
    assert hits == [0, 48, 0, 48]


@pytest.mark.slow
def test_a_compiled_target_shares_prefixes_as_an_eager_one(tiny_pair, plain):
    """A compiled target reads the pool's blocks as an eager one does (one KV format): requests
    joining while another with the same 50-token system prompt runs find its 3 whole blocks in
    the prefix cache, and each gets what the target alone gives it."""
    system = shared_random_prompts(1, seed=41, lengths=(50, 51))[0]
    prompts = [system + tail for tail in shared_random_prompts(3, seed=43, lengths=(2, 20))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(plain.generate(prompts, params))}
    counts = {}
    for compile in ("on", "off"):
        llm = LLM(str(tiny_pair["target"]), dtype="float32", max_num_seqs=4, compile=compile, speculative_method="none")
        llm.engine.prepare_to_serve(max_model_len=128)
        assert llm.runner.cache.static == (compile == "on")
        assert llm.runner.reads_pool(llm.engine.capacity.pool)
        joined: dict = {}
        run_to_end(llm.engine, joined, [(2 * i, f"r{i}", prompt, params) for i, prompt in enumerate(prompts)])
        assert {request_id: ids for request_id, (ids, _, _) in joined.items()} == expected
        counts[compile] = llm.engine.capacity.prefix_cache_counts
    assert counts["on"] == counts["off"] and counts["on"][1] == 2 * 3 * 16  # 2 later requests x 3 blocks


def recording(runner, method: str, monkeypatch) -> list[int]:
    """A list that runner's method appends each row's number of tokens to (feed: the prefills;
    ragged_batch: a draft's catch-up)."""
    fed: list[int] = []
    call = getattr(runner, method)

    def recorded(chunks, *args, **kwargs):
        fed.extend(len(chunk) for chunk in chunks)
        return call(chunks, *args, **kwargs)

    monkeypatch.setattr(runner, method, recorded)
    return fed


def drafter_kwargs(drafter: str, tiny_pair, tmp_path) -> dict:
    """LLM's keywords for no drafter ("none"), a draft model, an (untrained) EAGLE head or staged
    drafts, k = 3."""
    if drafter == "none":
        return dict(speculative_method="none")
    if drafter == "draft_model":
        model = dict(speculative_model=str(tiny_pair["target"]))
    elif drafter == "staged":  # prompt lookup drafting for the draft model, drafting for the target
        model = dict(speculative_model=["[ngram]", str(tiny_pair["draft"])])
    else:
        head = save_random_head(tiny_pair["target"], tmp_path / "head", seed=3)
        model = dict(speculative_model=str(head), speculative_method="eagle")
    return dict(**model, num_speculative_tokens=3, speculative_k_policy="fixed")
