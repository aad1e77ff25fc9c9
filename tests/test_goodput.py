"""k by goodput: the policy picks the k that Leviathan et al.'s expected tokens per second
say is best (written out here, apart from specdec.metrics), a useless draft switches
speculation off and a perfect one keeps k at its maximum, k = 0 rounds probe now and then,
and the output is the target's whatever k each round took.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import save_tiny_model

from specdec import LLM, SamplingParams
from specdec.goodput import (MAX_PROBE_INTERVAL, MIN_GAIN, PRIOR_WEIGHT, PROBE_BUDGET, PROBE_INTERVAL, AcceptanceEstimate, CostCurve,
                             GoodputPolicy, RoundCosts)
from specdec.cli import main

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = [[5, 9, 31, 7, 7], list(range(40, 53)), [3] * 30]
K = 4


def expected_tokens(alpha: float, k: int) -> float:
    """1 + α + α² + ... + α^k: the round's tokens if each draft is accepted with probability α."""
    return sum(alpha ** i for i in range(k + 1))


def linear(step: float, per_token: float, draft_step: float) -> RoundCosts:
    """Costs whose verify grows by per_token a token, step + (T - 1) * per_token, and whose
    drafter takes draft_step a token."""
    return RoundCosts(CostCurve({t: step + (t - 1) * per_token for t in range(1, K + 2)}),
                      CostCurve({k: k * draft_step for k in range(1, K + 1)}))


def policy_with(costs: RoundCosts, k_max: int = K) -> GoodputPolicy:
    policy = GoodputPolicy(k_max)
    policy.costs[1] = costs
    return policy


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("costs", [linear(1.0, 0.05, 0.1), linear(1.0, 0.3, 0.02), linear(1.0, 0.0, 0.6)])
def test_the_choice_maximises_expected_tokens_per_second(alpha, costs):
    policy = policy_with(costs)
    policy.start(0)
    estimate = policy.estimates[0]
    estimate.accepted, estimate.judged = alpha * 1e6, 1e6  # so many rounds that the prior does not count
    step, per_token = costs.verify.calibrated[1], costs.verify.calibrated[2] - costs.verify.calibrated[1]
    draft_step = costs.draft.calibrated[1]
    goodput = {k: expected_tokens(alpha, k) / (step + k * per_token + k * draft_step) for k in range(K + 1)}
    goodput[0] *= MIN_GAIN  # drafting must promise MIN_GAIN times plain decoding
    assert policy.choose([0], [100]) == [max(goodput, key=goodput.get)]


def test_room_caps_the_expected_tokens():
    """A row that can emit 2 more tokens gains nothing from a third draft."""
    policy = policy_with(linear(1.0, 0.1, 0.05))
    policy.start(0)
    policy.estimates[0].accepted, policy.estimates[0].judged = 1e6, 1e6
    assert policy.choose([0], [2]) == [2]


def best_plan_by_brute_force(alphas, rooms, costs: RoundCosts):
    """Every k and every set of drafting rows: (B + sum of their extra tokens) ÷ (verify of
    k + 1 tokens + the draft's k steps for their share of the batch); plain decoding's counted
    MIN_GAIN times."""
    B, best, best_plan = len(alphas), None, None
    for k in range(K + 1):
        for drafting in itertools.product([False, True], repeat=B):
            if (k == 0) != (not any(drafting)) or any(d and room == 0 for d, room in zip(drafting, rooms)):
                continue
            tokens = B + sum(expected_tokens(a, min(k, r)) - 1 for a, r, d in zip(alphas, rooms, drafting) if d)
            seconds = costs.verify.seconds(k + 1) + (costs.draft.seconds(k) * sum(drafting) / B if k else 0)
            value = tokens / seconds * (MIN_GAIN if k == 0 else 1)  # drafting must promise MIN_GAIN times plain
            if best is None or value > best + 1e-12:
                best, best_plan = value, [min(k, r) if d else 0 for r, d in zip(rooms, drafting)]
    return best_plan


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_best_of_every_k_and_set_of_drafting_rows(seed):
    """Rows share the verify; each drafting row costs its share of the draft: the plan is the
    brute-force best over every k and every subset of rows."""
    g = torch.Generator().manual_seed(seed)
    alphas = torch.rand(5, generator=g).tolist()
    rooms = torch.randint(0, 7, (5,), generator=g).tolist()
    costs = linear(1.0, float(torch.rand(1, generator=g)) * 0.3, float(torch.rand(1, generator=g)) * 0.5)
    policy = policy_with(costs)
    for slot, alpha in enumerate(alphas):
        policy.start(slot)
        policy.estimates[slot].accepted, policy.estimates[slot].judged = alpha * 1e6, 1e6
    assert policy.plan(list(range(5)), rooms) == best_plan_by_brute_force(alphas, rooms, costs)


def test_one_good_row_among_useless_ones():
    """Alone, the good row drafts; among three useless rows its drafts do not pay for widening
    the batch's verify, and nobody drafts."""
    costs = linear(1.0, 0.2, 0.2)
    policy = policy_with(costs)
    for slot, alpha in enumerate([0.0, 0.0, 0.0, 0.95]):
        policy.start(slot)
        policy.estimates[slot].accepted, policy.estimates[slot].judged = alpha * 1e6, 1e6
    assert policy.choose([0, 1, 2, 3], [50] * 4) == [0] * 4
    alone = {k: expected_tokens(0.95, k) / costs.seconds(k, k + 1) * (MIN_GAIN if k == 0 else 1) for k in range(K + 1)}
    assert policy.choose([3], [50]) == [max(alone, key=alone.get)] and max(alone, key=alone.get) > 0


def test_a_probe_drafts_one_row_in_turn():
    policy = policy_with(linear(1.0, 0.01, 0.2))
    for slot in range(3):
        policy.start(slot)
        policy.estimates[slot].judged = 1e6  # α = 0
    probes = [ks for ks in (policy.choose([0, 1, 2], [9, 0, 9]) for _ in range(3 * (PROBE_INTERVAL + 1))) if any(ks)]
    assert probes == [[1, 0, 0], [0, 0, 1], [1, 0, 0]]  # the row with no room skipped


def test_acceptance_estimate_decays_and_starts_from_the_prior():
    estimate = AcceptanceEstimate()
    assert estimate.rate(0.3) == pytest.approx(0.3)
    estimate.observe(num_proposed=4, num_accepted=4)  # 4 judged, 4 accepted
    estimate.observe(num_proposed=4, num_accepted=1)  # 2 judged, 1 accepted
    accepted, judged = 0.9 * 4 + 1, 0.9 * 4 + 2
    assert estimate.rate(0.3) == pytest.approx((accepted + PRIOR_WEIGHT * 0.3) / (judged + PRIOR_WEIGHT))
    estimate.observe(num_proposed=0, num_accepted=0)  # nothing judged: nothing learnt
    assert estimate.rate(0.3) == pytest.approx((accepted + PRIOR_WEIGHT * 0.3) / (judged + PRIOR_WEIGHT))


def test_a_sequence_not_drafting_drifts_back_to_the_prior():
    """A run of rejections switches a sequence's drafting off; while it drafts nothing its own
    counts fade, and with a good pooled rate it drafts again."""
    policy = policy_with(linear(1.0, 0.1, 0.2))
    policy.prior.accepted, policy.prior.judged = 90.0, 100.0  # the others accept 0.9
    policy.start(0)
    for _ in range(5):
        policy.observe([0], [4], [0])  # rejected at once, five rounds running
    assert policy.choose([0], [100]) == [0]
    rounds = 1
    while policy.choose([0], [100]) == [0]:
        policy.observe([0], [0], [0])  # a plain round: nothing judged
        rounds += 1
    assert 1 < rounds < PROBE_INTERVAL  # back before any probe


def test_plain_rounds_probe_with_one_draft_now_and_then():
    policy = policy_with(linear(1.0, 0.01, 0.5))  # a probe's wider verify costs little: every PROBE_INTERVAL
    policy.start(0)
    policy.estimates[0].judged = 1e6  # α = 0
    choices = [policy.choose([0], [100])[0] for _ in range(3 * (PROBE_INTERVAL + 1))]
    assert choices.count(1) == 3 and set(choices) == {0, 1}
    assert choices[PROBE_INTERVAL] == 1 and choices[:PROBE_INTERVAL] == [0] * PROBE_INTERVAL
    assert policy.k_counts == {0: 3 * PROBE_INTERVAL, 1: 3}


def test_probes_come_further_apart_where_their_wider_verify_costs_more():
    policy = policy_with(linear(1.0, 0.5, 0.5))  # a 2-token verify costs 1.5 steps
    policy.start(0)
    policy.estimates[0].judged = 1e6
    choices = [policy.choose([0], [100])[0] for _ in range(60)]
    floor = math.ceil(0.5 / PROBE_BUDGET)
    assert floor > PROBE_INTERVAL and choices.index(1) == floor


def test_probes_that_find_nothing_come_less_often():
    policy = policy_with(linear(1.0, 0.01, 0.2))
    policy.start(0)
    policy.estimates[0].judged = 1e6  # α = 0
    probes_at = []
    for round_index in range(2000):
        k = policy.choose([0], [100])[0]
        if k:
            probes_at.append(round_index)
            policy.observe([0], [1], [0])  # rejected again
    gaps = [b - a - 1 for a, b in zip([-1] + probes_at, probes_at)]
    assert gaps[:5] == [PROBE_INTERVAL, 2 * PROBE_INTERVAL, 4 * PROBE_INTERVAL, 8 * PROBE_INTERVAL,
                        MAX_PROBE_INTERVAL]
    assert set(gaps[4:]) == {MAX_PROBE_INTERVAL}
    policy.estimates[0].judged, policy.estimates[0].accepted = 1.0, 1.0
    policy.prior.judged, policy.prior.accepted = 1e6, 1e6  # drafting pays now: k > 0 straight away
    assert policy.choose([0], [100])[0] > 0


def test_costs_learn_from_each_rounds_timing():
    """A round's timing rescales its own T's verify cost and its k's draft cost (sizes not run
    yet take the mean scale)."""
    policy = policy_with(linear(1.0, 0.1, 0.2))
    policy.start(0)
    policy.choose([0], [100])  # a first round follows no drafting round
    policy.observe_round(1, k=0, verify_tokens=1, target_seconds=2.0, draft_seconds=0.0)
    verify, draft = policy.costs[1].verify, policy.costs[1].draft
    assert verify.scales == {1: pytest.approx(0.8 + 0.2 * 2.0)}
    assert verify.seconds(1) == pytest.approx(1.2) and verify.seconds(4) == pytest.approx(1.3 * 1.2)
    policy.observe_round(1, k=3, verify_tokens=4, target_seconds=2.6, draft_seconds=3 * 0.7)
    assert verify.scales[4] == pytest.approx(0.8 * 1.2 + 0.2 * 2.0) and verify.scales[1] == pytest.approx(1.2)
    assert verify.seconds(3) == pytest.approx(1.2 * (verify.scales[1] + verify.scales[4]) / 2)
    assert draft.scales == {}  # the round after plain rounds: the draft was catching up
    policy.estimates[0].accepted = policy.estimates[0].judged = 1e6
    policy.choose([0], [100])  # a drafting round
    policy.choose([0], [100])  # ... after a drafting round
    policy.observe_round(1, k=3, verify_tokens=4, target_seconds=2.6, draft_seconds=3 * 0.7)
    assert draft.scales == {3: pytest.approx(0.8 + 0.2 * 3.5)}
    assert policy.costs[1].seconds(3, 4) == pytest.approx(verify.seconds(4) + 0.6 * (0.8 + 0.2 * 3.5))
    policy.observe_round(3, k=0, verify_tokens=1, target_seconds=2.4, draft_seconds=0.0)  # a new bucket (4 rows)
    assert policy.costs[4].verify.scales[1] == pytest.approx(0.8 * 1.2 + 0.2 * 2.4)
    assert verify.scales[1] == pytest.approx(1.2)


def test_costs_between_measured_sizes_are_interpolated():
    curve = CostCurve({1: 1.0, 2: 3.0, 6: 4.0})
    assert curve.seconds(4) == pytest.approx(3.5)
    assert curve.seconds(8) == pytest.approx(4.5)  # past the last: the last two's slope
    curve.scales[4] = 2.0
    assert curve.seconds(4) == pytest.approx(7.0) and curve.seconds(1) == pytest.approx(2.0)  # the mean scale


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    return {"target": save_tiny_model(root / "target", "llama", seed=31, init_std=0.3),
            "random_draft": save_tiny_model(root / "draft", "llama", seed=32, init_std=0.3, num_hidden_layers=1)}


@pytest.fixture(scope="module")
def target_alone(dirs):
    llm = LLM(str(dirs["target"]), dtype="float32", compile="off")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def fixed_costs(policy: GoodputPolicy, batch_size: int, k: int, time_target, time_draft) -> None:
    """GoodputPolicy.calibrate with costs of a typical small target and draft instead of
    timings: a verify of k+1 tokens 20% dearer than a step, a draft step a fifth of one."""
    policy.costs[1 << (batch_size - 1).bit_length()] = RoundCosts(CostCurve({1: 1e-3, k + 1: 1.2e-3}),
                                                                  CostCurve({1: 2e-4, k: k * 2e-4}))


@pytest.fixture
def costs_fixed(monkeypatch):
    """The policy's costs fixed (fixed_costs; rounds teach nothing), so that its choices rest on
    acceptance alone: on a loaded machine measured costs can make drafting look cheap for a
    while, which the cost tests above cover."""
    monkeypatch.setattr(GoodputPolicy, "calibrate", fixed_costs)
    monkeypatch.setattr(GoodputPolicy, "observe_round", lambda policy, *args, **kwargs: None)


def test_a_useless_draft_switches_speculation_off(dirs, target_alone, costs_fixed):
    """A random draft (α near 0) makes the policy plain-decode nearly every round."""
    llm = LLM(str(dirs["target"]), speculative_model=str(dirs["random_draft"]), num_speculative_tokens=K,
              dtype="float32", compile="off")
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == target_alone
    for output in outputs:
        rounds_by_k = output.metrics.rounds_by_k
        assert sum(rounds_by_k) == output.metrics.num_target_forwards - 1  # every round but the prefill
        assert rounds_by_k[0] >= 0.75 * sum(rounds_by_k), rounds_by_k
    assert "k chosen 0:" in outputs[0].metrics.summary()


def test_the_target_as_its_own_draft_is_exact_whatever_k_each_round_takes(dirs, target_alone):
    """Every draft accepted, each costing a target step: a round of k drafts costs about k + 1
    steps for k + 1 tokens, so timing noise decides k from round to round; the output is the
    target's whatever it picked."""
    llm = LLM(str(dirs["target"]), speculative_model=str(dirs["target"]), draft_dtype="float32",
              num_speculative_tokens=K, dtype="float32", compile="off")
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == target_alone
    assert all(o.metrics.acceptance_rate == 1.0 for o in outputs if o.metrics.num_judged_tokens)


def test_fixed_policy_drafts_k_every_round(dirs, target_alone):
    llm = LLM(str(dirs["target"]), speculative_model=str(dirs["random_draft"]), num_speculative_tokens=K,
              dtype="float32", compile="off", speculative_k_policy="fixed")
    output = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert output.outputs[0].token_ids == target_alone[0]
    rounds_by_k = output.metrics.rounds_by_k  # k, but less in the last rounds, where the row has no room
    assert rounds_by_k[K] == sum(rounds_by_k) - K and rounds_by_k[:K] == [1] * K


def test_bad_k_policy_is_refused(dirs, capsys):
    with pytest.raises(ValueError, match=r"speculative_k_policy must be one of \('goodput', 'fixed'\), got 'best'"):
        LLM(str(dirs["target"]), speculative_method="ngram", speculative_k_policy="best")
    with pytest.raises(ValueError, match="without a drafter"):
        LLM(str(dirs["target"]), speculative_k_policy="fixed")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(dirs["target"]), "--ngram", "--k-policy", "best", "--prompt", "x"])
    assert "invalid choice: 'best'" in capsys.readouterr().err
    assert main(["generate", "--model", str(dirs["target"]), "--k-policy", "fixed", "--prompt", "x"]) == 2
    assert "--k-policy needs a drafter" in capsys.readouterr().err


def test_probes_draft_for_one_row_of_a_sampled_batch(dirs, costs_fixed):
    """k = 0 rounds, then a probe: one row drafts (its draft distributions placed among rows
    that propose nothing), the batch's output stays whole."""
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    llm = LLM(str(dirs["target"]), speculative_model=str(dirs["random_draft"]), num_speculative_tokens=K,
              dtype="float32", compile="off")
    outputs = llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 48 for o in outputs)
    drafting_rounds = [o.metrics.num_target_forwards - 1 - o.metrics.rounds_by_k[0] for o in outputs]
    assert llm.engine.policy.k_counts[1] >= 1 and min(drafting_rounds) < max(drafting_rounds)


def test_a_seeded_sampled_request_runs_at_the_fixed_k_and_keeps_its_tokens(dirs):
    """Which k a round takes depends on timings, and a sampled request's tokens depend on its
    rounds' k; a seeded request must get the same tokens alone, in a batch, and as under the
    fixed policy, so its rounds run at the fixed k."""
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=99, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    kwargs = dict(speculative_model=str(dirs["random_draft"]), num_speculative_tokens=K, dtype="float32",
                  compile="off")
    goodput = LLM(str(dirs["target"]), **kwargs)
    fixed = LLM(str(dirs["target"]), speculative_k_policy="fixed", **kwargs)
    expected = fixed.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    alone = goodput.generate(PROMPTS[:1], params)[0]
    batched = goodput.generate(PROMPTS, [params, unseeded, unseeded])[0]
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids == expected
    rounds_by_k = alone.metrics.rounds_by_k  # never switched off, though the draft is useless
    assert rounds_by_k[K] > 0 and rounds_by_k[0] <= 1  # k = 0 only in a last round with no room
    unseeded_alone = goodput.generate(PROMPTS[:1], unseeded)[0]
    assert unseeded_alone.metrics.rounds_by_k[0] > 0  # an unseeded one is
