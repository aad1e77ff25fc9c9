"""The round loop: greedy speculative output is the target's own greedy output, token for
token, for every drafter, k and batch shape; stops cut runs exactly; finished rows leave."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import load_hf, make_tokenizer, save_tiny_model, token_ids
from helpers import random_prompts as shared_random_prompts
from specdec import LLM, SamplingParams
from specdec.models.cpu_linear import Bf16PackedLinear, can_pack


def random_prompts(n: int, seed: int, **kwargs) -> list[list[int]]:
    return shared_random_prompts(n, seed, lengths=(3, 30), **kwargs)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return LLM(str(tiny_pair["target"]), dtype="float32", speculative_method="none")


@pytest.mark.parametrize("method", ["self", "self_adaptive", "random_draft", "ngram", "lookup_then_draft"])
def test_greedy_speculative_equals_target_alone(tiny_pair, plain, method):
    speculative = {
        "self": dict(speculative_model=str(tiny_pair["target"])),
        "self_adaptive": dict(speculative_model=str(tiny_pair["target"]), draft_confidence_threshold=0.3),
        "random_draft": dict(speculative_model=str(tiny_pair["draft"])),
        "ngram": dict(speculative_method="ngram"),
        "lookup_then_draft": dict(speculative_model=str(tiny_pair["draft"]), speculative_method="lookup_then_draft"),
    }[method]
    speculative["speculative_k_policy"] = "fixed"
    prompts = random_prompts(4, seed=10, repeat=method == "ngram")
    expected = token_ids(plain.generate(prompts, GREEDY))
    for k in range(1, 9):  # at a fixed k: goodput would choose k by timings (tests/test_goodput.py)
        llm = LLM(str(tiny_pair["target"]), dtype="float32", num_speculative_tokens=k, **speculative)
        for prompt, want in zip(prompts[:1], expected[:1]):  # batch of one
            assert token_ids(llm.generate(prompt, GREEDY)) == [want], f"k={k} batch 1"
        outputs = llm.generate(prompts, GREEDY)  # ragged batch: prompts of different lengths
        assert token_ids(outputs) == expected, f"k={k} ragged batch"
        stats = [o.metrics for o in outputs]
        if method == "self":
            assert all(s.acceptance_rate == 1.0 for s in stats)
            assert all(len(s.acceptance_by_position) == k for s in stats)
        if method == "self_adaptive" and k >= 3:  # all accepted, but rows stop drafting where unsure
            assert all(s.acceptance_rate == 1.0 for s in stats)
            rounds = sum(s.num_target_forwards - 1 for s in stats)  # after each prefill
            assert 1.1 * rounds < sum(s.num_draft_tokens for s in stats) < 0.9 * k * rounds
        if method == "random_draft":
            assert sum(s.num_accepted_tokens for s in stats) < 0.5 * sum(s.num_draft_tokens for s in stats)
        if method == "ngram":
            assert sum(s.num_draft_tokens for s in stats) > 0


def test_lookup_then_draft_drafts_by_model_only_where_lookup_finds_nothing(tmp_path):
    """Over 12 tokens, random text soon repeats pairs of tokens, so prompt lookup (matches of
    at least 2 tokens) finds something in some rows and rounds and not in others: the draft
    model drafts for exactly the greedy rows it found nothing for; a round mixes both kinds of
    row; greedy output is still the target's. A sampled row with a match takes lookup first,
    and then by how each has fared on it (LookupThenDraftDrafter.takes_lookup)."""
    small = dict(vocab_size=12, tokenizer=False, init_std=0.5)
    target = save_tiny_model(tmp_path / "target", "llama", seed=5, **small)
    draft = save_tiny_model(tmp_path / "draft", "llama", seed=6, num_hidden_layers=1, **small)
    llm = LLM(
        str(target),
        speculative_model=str(draft),
        speculative_method="lookup_then_draft",
        num_speculative_tokens=4,
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_k_policy="fixed",
    )  # every row drafts every round
    drafter = llm.engine.drafter
    assert drafter.lookup.ngram_min == 2  # the method's default: a one-token match is not trusted
    rounds = []  # (rows lookup matched, rows the draft model drafted for), by request id

    def propose(batch, ks, sampling):
        rounds.append((set(), set()))
        return type(drafter).propose(drafter, batch, ks, sampling)

    def lookup_propose(batch, ks, sampling):
        draft = type(drafter.lookup).propose(drafter.lookup, batch, ks, sampling)
        rounds[-1][0].update(seq.request_id for seq, n in zip(batch, draft.num_tokens.tolist()) if n > 0)
        return draft

    def model_propose(batch, ks, sampling):
        rounds[-1][1].update(seq.request_id for seq in batch)
        return type(drafter.drafter).propose(drafter.drafter, batch, ks, sampling)

    drafter.propose, drafter.lookup.propose, drafter.drafter.propose = propose, lookup_propose, model_propose
    prompts = random_prompts(6, seed=20, vocab=12)
    plain = LLM(str(target), dtype="float32", skip_tokenizer_init=True, speculative_method="none")
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == token_ids(plain.generate(prompts, GREEDY))
    assert all(not (matched & drafted) for matched, drafted in rounds)
    assert any(matched and drafted for matched, drafted in rounds)  # both kinds of row in one round

    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    rounds.clear()
    outputs = llm.generate(prompts, [GREEDY, sampled] * 3)
    sampled_ids = {out.request_id for out in outputs[1::2]}
    assert all(not (matched - sampled_ids) & drafted for matched, drafted in rounds)  # greedy: lookup on a match
    assert any(matched - sampled_ids for matched, _ in rounds)  # greedy rows still looked up, beside sampled ones
    assert any(matched & sampled_ids for matched, _ in rounds) and any(drafted & sampled_ids for _, drafted in rounds)


def test_a_sampled_row_takes_lookup_while_it_fares_as_well_as_the_drafter():
    """A sampled row's looked-up tokens are kept with the target's probability of them: the row
    takes lookup first (both estimates start at the prior; lookup costs nothing), the drafter
    once its looked-up tokens are rejected, lookup again once the drafter fares worse; a greedy
    row always takes a match."""
    from types import SimpleNamespace

    from specdec.drafters.lookup_then_draft import DRAFTER, LOOKUP, LookupThenDraftDrafter
    from specdec.drafters.ngram import NgramDrafter

    behind = SimpleNamespace(needs_target_hidden=False, observe=lambda batch, accepted: None, release=lambda s: None)
    drafter = LookupThenDraftDrafter(NgramDrafter(2), behind)  # pyright: ignore[reportArgumentType]
    seq = SimpleNamespace(request_id="a")

    def round_of(source: str, accepted: int, proposed: int = 4) -> None:
        drafter.last_round[seq.request_id] = (source, proposed)
        drafter.observe([seq], torch.tensor([accepted]))  # pyright: ignore[reportArgumentType]

    assert drafter.takes_lookup(seq, greedy=False)  # pyright: ignore[reportArgumentType]
    round_of(LOOKUP, 0)
    assert not drafter.takes_lookup(seq, greedy=False) and drafter.takes_lookup(seq, greedy=True)  # pyright: ignore[reportArgumentType]
    round_of(DRAFTER, 4)
    assert not drafter.takes_lookup(seq, greedy=False)  # pyright: ignore[reportArgumentType]
    switched_back = 0
    for n in range(1, 20):  # the drafter's tokens now rejected: lookup's estimate drifts back and wins
        round_of(DRAFTER, 0)
        if drafter.takes_lookup(seq, greedy=False):  # pyright: ignore[reportArgumentType]
            switched_back = n
            break
    assert 2 <= switched_back <= 8  # not at the first rejection, nor never
    drafter.release(seq)  # pyright: ignore[reportArgumentType]
    assert seq.request_id not in drafter.rates


def test_lookup_then_draft_merges_point_masses_with_the_draft_models_distributions():
    from specdec.drafters.base import Draft
    from specdec.drafters.lookup_then_draft import _merge

    V = 6
    looked_up = Draft(torch.tensor([[3, 1, 0], [0, 0, 0], [5, 0, 0]]), torch.tensor([2, 0, 1]))
    drafted_probs = torch.softmax(torch.randn(1, 3, V, generator=torch.Generator().manual_seed(0)), dim=-1)
    drafted = Draft(torch.tensor([[4, 2, 2]]), torch.tensor([3]), drafted_probs)
    merged = _merge(looked_up, drafted, torch.tensor([1]))
    assert merged.token_ids.tolist() == [[3, 1, 0], [4, 2, 2], [5, 0, 0]]
    assert merged.num_tokens.tolist() == [2, 3, 1]
    assert torch.equal(merged.probs[1], drafted_probs[0])
    assert merged.probs[0, 0].tolist() == [0, 0, 0, 1, 0, 0] and merged.probs[2, 0].tolist() == [0, 0, 0, 0, 0, 1]
    greedy = _merge(looked_up, Draft(drafted.token_ids, drafted.num_tokens, None), torch.tensor([1]))
    assert greedy.probs is None and greedy.token_ids.tolist() == merged.token_ids.tolist()


def test_transformers_greedy_reference(tiny_pair):
    """The speculative output also equals transformers' own greedy generate."""
    hf = load_hf(tiny_pair["target"])
    llm = LLM(
        str(tiny_pair["target"]), speculative_model=str(tiny_pair["draft"]), num_speculative_tokens=3, dtype="float32"
    )
    for prompt in random_prompts(3, seed=11):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=25))[0]
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False)[0, len(prompt) :].tolist()
        if 1 in ref:  # transformers stops at EOS (id 1) and pads after it
            ref = ref[: ref.index(1) + 1]
        assert out.outputs[0].token_ids == ref


def test_metrics_plain_and_self_draft(tiny_pair, plain):
    prompt = random_prompts(1, seed=12)[0]
    out = plain.generate(prompt, GREEDY)[0]
    assert out.metrics.tokens_per_forward == 1.0
    assert out.metrics.num_target_forwards == GREEDY.max_tokens
    assert out.metrics.num_draft_tokens == 0
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=4,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    out = llm.generate(prompt, GREEDY)[0]
    # 1 prefill token, then rounds of 5 (4 accepted + bonus) until the budget clips the drafts
    assert out.metrics.num_emitted_tokens == 40
    assert out.metrics.num_target_forwards == 1 + 8
    assert out.metrics.tokens_per_forward == pytest.approx(40 / 9)
    from_draft = out.outputs[0].from_draft
    assert len(from_draft) == 40 and sum(from_draft) == out.metrics.num_accepted_tokens
    assert from_draft[:11] == [False] + [True] * 4 + [False] + [True] * 4 + [False]  # prefill, then rounds
    assert out.metrics.tokens_per_second > 0
    assert 0 < out.metrics.first_token_seconds < out.metrics.seconds  # TTFT: the prefill's token


def test_zero_speculative_tokens_is_plain_decoding(tiny_pair, plain):
    prompts = random_prompts(3, seed=13)
    llm = LLM(
        str(tiny_pair["target"]), speculative_model=str(tiny_pair["draft"]), num_speculative_tokens=0, dtype="float32"
    )
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == token_ids(plain.generate(prompts, GREEDY))
    assert all(o.metrics.tokens_per_forward == 1.0 for o in outputs)


def test_stop_token_inside_accepted_run(tiny_pair, plain):
    """With the target as its own draft every round accepts all k; a stop token in the
    middle of such a run must end the output right there."""
    prompt = random_prompts(1, seed=14)[0]
    reference = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=6,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    for cut in (3, 9, 17):
        stop_token = reference[cut]
        first = reference.index(stop_token)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=(stop_token,))
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.token_ids == reference[: first + 1]
        assert out.finish_reason == "stop"


def test_eos_inside_accepted_run(tiny_pair, plain, tmp_path):
    prompt = random_prompts(1, seed=15)[0]
    reference = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    eos = reference[7]
    model_dir = tmp_path / "with_eos"
    shutil.copytree(tiny_pair["target"], model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 1]}))
    llm = LLM(
        str(model_dir),
        speculative_model=str(model_dir),
        num_speculative_tokens=5,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.token_ids == reference[: reference.index(eos) + 1]
    assert out.finish_reason == "stop"
    ignoring = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert ignoring.token_ids == reference and ignoring.finish_reason == "length"
    last_allowed = reference.index(eos) + 1  # the EOS is also the last token max_tokens allows: a stop
    at_limit = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=last_allowed))[0].outputs[0]
    assert at_limit.token_ids == reference[:last_allowed] and at_limit.finish_reason == "stop"


def test_max_tokens_inside_accepted_run(tiny_pair, plain):
    prompt = random_prompts(1, seed=16)[0]
    reference = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=7,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    for max_tokens in (1, 2, 5, 13):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == reference[:max_tokens]
        assert out.outputs[0].finish_reason == "length"
        assert out.metrics.num_emitted_tokens == max_tokens


def test_stop_string_cuts_text_and_tokens(tiny_pair, plain):
    prompt = "def add(a, b):"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = plain.generate(prompt, params)[0].outputs[0]
    text = reference.text
    assert len(text) > 12, "the random model should produce some text"
    stop = text[8:11]
    cut = text.index(stop)
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=5,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop"
    n = len(out.token_ids)
    assert out.token_ids == reference.token_ids[:n]
    decode = llm.tokenizer.decode
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])  # nothing after the stop
    later = text[cut + 4 : cut + 7]  # a second stop string, listed first, found later in the text
    assert later and text.index(later) > cut
    both = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[later, stop]))
    assert both[0].outputs[0].text == text[:cut]  # cut at the earliest in the text, whatever the list order


def test_rows_leave_and_slots_are_reused(tiny_pair, plain):
    """Different max_tokens per request, more requests than slots: each output is what the
    request gives alone."""
    prompts = random_prompts(5, seed=17)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 30, 8, 1, 17)]
    expected = [plain.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    for kwargs in (
        dict(speculative_model=str(tiny_pair["draft"]), num_speculative_tokens=4),
        dict(speculative_method="ngram", num_speculative_tokens=4),
        dict(speculative_method="none"),
    ):
        llm = LLM(str(tiny_pair["target"]), max_num_seqs=2, dtype="float32", **kwargs)
        assert token_ids(llm.generate(prompts, params)) == expected


def test_a_reused_slot_starts_its_draft_cache_afresh(tiny_pair):
    """One slot, three requests in turn, the target as its own draft: every draft is accepted
    only if the draft's cache state left by one request is dropped for the next."""
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
        max_num_seqs=1,
        dtype="float32",
    )
    outputs = llm.generate(random_prompts(3, seed=21), GREEDY)
    assert [o.metrics.acceptance_rate for o in outputs] == [1.0, 1.0, 1.0]


def test_no_draft_is_verified_past_max_tokens(tiny_pair):
    """A row with r tokens left verifies at most r - 1 drafts (the last token is the bonus).
    The target as its own draft has every draft accepted, so each round emits its drafts and
    a bonus: after the prefill's token, drafts + rounds = max_tokens - 1 exactly."""
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["target"]),
        num_speculative_tokens=4,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    for max_tokens in (40, 7):
        out = llm.generate(
            random_prompts(1, seed=22), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )[0]
        rounds = out.metrics.num_target_forwards - 1  # after the prefill
        assert out.metrics.num_draft_tokens + rounds == max_tokens - 1 and len(out.outputs[0].token_ids) == max_tokens


def test_mixed_greedy_and_sampled_batch(tiny_pair, plain):
    """Greedy rows stay exact while sampled rows share their batch."""
    prompts = random_prompts(4, seed=18)
    greedy_expected = token_ids(plain.generate(prompts[:2], GREEDY))
    sampled = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
    llm = LLM(
        str(tiny_pair["target"]), speculative_model=str(tiny_pair["draft"]), num_speculative_tokens=3, dtype="float32"
    )
    outputs = llm.generate(prompts, [GREEDY, GREEDY, sampled, sampled])
    assert token_ids(outputs[:2]) == greedy_expected
    alone = [llm.generate(p, sampled)[0].outputs[0].token_ids for p in prompts[2:]]  # seeded: as alone (float32)
    assert token_ids(outputs[2:]) == alone and all(
        len(ids) == 40 or ids[-1] in llm.engine.output.eos_token_ids for ids in alone
    )


def test_late_admission_next_to_a_long_row(tiny_pair, plain):
    """A long prompt admitted while another row is near its end: the draft's catch-up pads
    the old row far past its length, which must stay inside the cache."""
    g = torch.Generator().manual_seed(19)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (30, 5, 30)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 25, 10)]
    expected = [plain.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["draft"]),
        num_speculative_tokens=2,
        max_num_seqs=2,
        dtype="float32",
    )
    assert token_ids(llm.generate(prompts, params)) == expected


def test_acceptance_by_position_counts_positions_never_accepted():
    from specdec.metrics import SpecStats

    stats = SpecStats()
    stats.record_round(2, 0, 1)
    assert stats.acceptance_by_position == [0.0, 0.0]
    stats.record_round(3, 1, 2)
    assert stats.acceptance_by_position == [0.5, 0.0, 0.0]
    merged = SpecStats.merge([stats, SpecStats()])
    assert merged.acceptance_by_position == [0.5, 0.0, 0.0]


def test_alpha_recovers_iid_acceptance_that_the_formula_assumes():
    """Rounds whose draft tokens are each accepted with probability 0.8 until the first
    rejection: α (accepted / judged) estimates 0.8, accepted / proposed follows
    E[accepted] / k, and τ follows (1 - α^(k+1)) / (1 - α)."""
    import random

    from specdec.metrics import SpecStats, expected_tokens_per_round

    rng, alpha, k = random.Random(0), 0.8, 5
    stats = SpecStats()
    for _ in range(20000):
        num_accepted = 0
        while num_accepted < k and rng.random() < alpha:
            num_accepted += 1
        stats.record_round(k, num_accepted, num_accepted + 1)
    assert stats.acceptance_rate == pytest.approx(alpha, abs=0.01)
    expected_accepted = alpha * (1 - alpha**k) / (1 - alpha)
    assert stats.proposed_acceptance_rate == pytest.approx(expected_accepted / k, abs=0.01)
    assert stats.tokens_per_forward == pytest.approx(expected_tokens_per_round(alpha, k), rel=0.01)
    merged = SpecStats.merge([stats, stats])
    assert merged.num_judged_tokens == 2 * stats.num_judged_tokens
    assert merged.acceptance_rate == stats.acceptance_rate


@pytest.mark.parametrize("draft_dtype, expected", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_draft_dtype_is_independent_of_the_target_and_never_changes_greedy_output(
    tiny_pair, draft_dtype, expected, monkeypatch
):
    """A small draft runs in float32 on the CPU by default (its big output layer in bfloat16),
    or in the dtype asked for; the target's greedy output stays its own either way."""
    monkeypatch.setattr("specdec.drafters.draft_model.LARGE_WEIGHT_BYTES", 70_000)  # the tiny draft's lm_head: 82 kB
    plain_bf16 = LLM(str(tiny_pair["target"]), dtype="bfloat16", speculative_method="none")
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["draft"]),
        num_speculative_tokens=3,
        dtype="bfloat16",
        draft_dtype=draft_dtype,
    )
    draft = llm.engine.drafter.runner.eager_model()  # the draft as it runs eagerly
    assert llm.target.model.dtype == torch.bfloat16 and draft.embed_tokens.weight.dtype == expected
    if draft_dtype == "auto" and can_pack(torch.bfloat16, torch.device("cpu")):
        assert isinstance(draft.lm_head, Bf16PackedLinear)  # the big matrix: its bytes matter
        assert not any(isinstance(m, Bf16PackedLinear) for m in draft.layers.modules())
    prompts = random_prompts(2, seed=31)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected_ids = [plain_bf16.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert got == expected_ids


def test_a_draft_lacking_the_targets_padded_ids_still_drafts(tmp_path):
    """A padded vocabulary: the target's embedding has 320 ids, the shared tokenizer makes fewer,
    and the draft's embedding stops at 313. Prompts holding the target's extra ids run (in a
    batch and sampled too), and greedy output is the target's alone."""
    target = save_tiny_model(tmp_path / "target", seed=1, init_std=0.3, vocab_size=320, tokenizer=False)
    draft = save_tiny_model(tmp_path / "draft", seed=2, init_std=0.3, vocab_size=313, tokenizer=False)
    for directory in (target, draft):
        make_tokenizer(313).save(str(directory / "tokenizer.json"))
    prompts = [p + [315, 319] + p for p in random_prompts(3, seed=33)]  # ids the draft cannot embed
    speculative = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, dtype="float32")
    alone = speculative.target_only()
    assert token_ids(speculative.generate(prompts, GREEDY)) == token_ids(alone.generate(prompts, GREEDY))
    sampled = speculative.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=4))
    assert all(len(out.outputs[0].token_ids) == 20 for out in sampled)


def test_adaptive_k_stops_a_greedy_row_alike_alone_or_beside_sampled_rows(tiny_pair):
    """A greedy row's confidence is the draft's plain softmax, not the point mass it is sampled
    from, also in a batch with sampled rows: it proposes as many draft tokens either way."""
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(tiny_pair["draft"]),
        num_speculative_tokens=4,
        dtype="float32",
        speculative_k_policy="fixed",
        draft_confidence_threshold=0.5,
    )
    greedy_prompt, sampled_prompt = random_prompts(2, seed=34)
    alone = llm.generate([greedy_prompt], GREEDY)[0]
    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=5)
    beside = llm.generate([greedy_prompt, sampled_prompt], [GREEDY, sampled])[0]
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids
    rounds = alone.metrics.num_target_forwards - 1  # after the prefill
    assert alone.metrics.num_draft_tokens < 0.9 * 4 * rounds  # the threshold does stop this row early
    assert beside.metrics.num_draft_tokens == alone.metrics.num_draft_tokens


def test_bad_draft_dtype_is_refused_by_name(tiny_pair):
    with pytest.raises(ValueError, match="draft_dtype must be one of"):
        LLM(str(tiny_pair["target"]), speculative_model=str(tiny_pair["draft"]), draft_dtype="float64")


def test_summary_shows_acceptance_only_where_something_was_drafted():
    from specdec.metrics import SpecStats

    plain = SpecStats()
    plain.record_round(0, 0, 1)
    assert "α" not in plain.summary() and "τ 1.00" in plain.summary()
    drafted = SpecStats()
    drafted.record_round(3, 1, 2)
    assert "α 0.500 (1 accepted/2 judged/3 proposed)  by position [1.00 0.00 0.00]" in drafted.summary()


def test_a_round_verifies_only_as_wide_as_its_longest_proposal(tiny_pair, plain, monkeypatch):
    """Prompt lookup at k = 6 proposes fewer tokens, or none, where its match is short or
    missing: the verify forward then feeds the last token and the longest row's proposal only
    (no match anywhere: a plain one-token step), and the output is still the target's."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.worker import ModelRunner

    llm = LLM(
        str(tiny_pair["target"]),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=6,
        speculative_k_policy="fixed",
    )
    events = []  # ("proposed", longest proposal) and ("forward", tokens per row), in order
    propose, forward = NgramDrafter.propose, ModelRunner.forward

    def recording_propose(self, batch, ks, sampling):
        draft = propose(self, batch, ks, sampling)
        events.append(("proposed", int(draft.num_tokens.max())))
        return draft

    def recording_forward(runner, batch, *args, **kwargs):
        events.append(("forward", batch.input_ids.shape[1]))
        return forward(runner, batch, *args, **kwargs)

    prompts = random_prompts(3, seed=31, repeat=True)
    expected = token_ids(plain.generate(prompts, GREEDY))
    monkeypatch.setattr(NgramDrafter, "propose", recording_propose)
    monkeypatch.setattr(ModelRunner, "__call__", recording_forward)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    rounds = [
        (events[i][1], events[i + 1][1])
        for i in range(len(events) - 1)
        if events[i][0] == "proposed" and events[i + 1][0] == "forward"
    ]  # (longest proposal, width)
    assert len(rounds) == sum(kind == "proposed" for kind, _ in events)
    assert all(width == 1 + longest for longest, width in rounds)
    assert {0, 6} <= {longest for longest, _ in rounds}  # rounds with no match and with a full one
    assert any(0 < longest < 6 for longest, _ in rounds)  # and with a short one
