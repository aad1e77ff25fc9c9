"""k by goodput: the policy picks the k that Leviathan et al.'s expected tokens per second
say is best (written out here, apart from specdec.metrics), a useless draft switches
speculation off and a perfect one keeps k at its maximum, k = 0 rounds probe now and then,
its costs are calibrated warm and then follow the rounds' timings (against a simulated
machine: no timing in these tests), and the output is the target's whatever k each round took.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.drafters.base import DRAFT, RowOutlook
from specdec.metrics import PRIOR_WEIGHT, AcceptanceEstimate
from specdec.spec.goodput import (
    CALIBRATION_REPEATS,
    CALIBRATION_SECONDS,
    CALIBRATION_WARM_UPS,
    COST_WINDOW,
    LINEAR_FROM_ROWS,
    MAX_PROBE_INTERVAL,
    MIN_GAIN,
    PLAIN_CHECK_INTERVAL,
    PROBE_BUDGET,
    PROBE_INTERVAL,
    CostCurve,
    GoodputPolicy,
    RoundCosts,
)

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = [[5, 9, 31, 7, 7], list(range(40, 53)), [3] * 30]
K = 4


def expected_tokens(alpha: float, k: int) -> float:
    """1 + α + α² + ... + α^k: the round's tokens if each draft is accepted with probability α."""
    return sum(alpha**i for i in range(k + 1))


def linear(step: float, per_token: float, draft_step: float) -> RoundCosts:
    """Costs whose verify grows by per_token a token, step + (T - 1) * per_token, and whose
    drafter takes draft_step a token."""
    return RoundCosts(
        CostCurve({t: step + (t - 1) * per_token for t in range(1, K + 2)}),
        CostCurve({k: k * draft_step for k in range(1, K + 1)}),
    )


def policy_with(costs: RoundCosts, k_max: int = K) -> GoodputPolicy:
    policy = GoodputPolicy(k_max)
    policy.costs[1] = costs
    return policy


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("costs", [linear(1.0, 0.05, 0.1), linear(1.0, 0.3, 0.02), linear(1.0, 0.0, 0.6)])
def test_the_choice_maximises_expected_tokens_per_second(alpha, costs):
    policy = policy_with(costs)
    policy.start(0)
    estimate = policy.estimate(0)
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
    policy.estimate(0).accepted, policy.estimate(0).judged = 1e6, 1e6
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
        policy.estimate(slot).accepted, policy.estimate(slot).judged = alpha * 1e6, 1e6
    assert policy.plan(list(range(5)), rooms) == best_plan_by_brute_force(alphas, rooms, costs)


LOOKUP = "lookup"


def best_mixed_plan_by_brute_force(alphas, rooms, outlooks, costs: RoundCosts):
    """Every verify width k + 1, every k_c <= k the paying rows draft, every set of paying rows:
    the free rows draft min(k, room, most) at no draft cost, each paying row min(k_c, room) at
    its share of k_c draft steps; plain decoding's goodput counted MIN_GAIN times."""
    B = len(alphas)
    caps = [room if o.most is None else min(room, o.most) for room, o in zip(rooms, outlooks)]
    paying = [row for row, o in enumerate(outlooks) if not o.free and caps[row] > 0]
    best, best_plan = MIN_GAIN * B / costs.verify.seconds(1), [0] * B
    for k in range(1, K + 1):
        for k_c in range(1, k + 1):
            for drafting in itertools.product([False, True], repeat=len(paying)):
                ks = [min(k, cap) if o.free else 0 for cap, o in zip(caps, outlooks)]
                for row, d in zip(paying, drafting):
                    ks[row] = min(k_c, caps[row]) if d else 0
                if not any(ks):
                    continue
                tokens = B + sum(expected_tokens(a, n) - 1 for a, n in zip(alphas, ks))
                seconds = costs.verify.seconds(k + 1) + costs.draft.seconds(k_c) * sum(drafting) / B
                if tokens / seconds > best + 1e-12:
                    best, best_plan = tokens / seconds, ks
    return best_plan


@pytest.mark.parametrize("seed", range(8))
def test_free_rows_draft_without_paying_draft_steps_and_paying_rows_may_draft_fewer(seed):
    """A drafter of several says which drafts each row (a lookup, free, with so many tokens to
    give; a head at its step's cost): the plan is the brute-force best over the verify's width,
    the paying rows' k_c <= k and every set of paying rows, each row at its own source's α."""
    g = torch.Generator().manual_seed(100 + seed)
    B = 5
    free = (torch.rand(B, generator=g) < 0.5).tolist()
    mosts = torch.randint(1, 7, (B,), generator=g).tolist()
    outlooks = [RowOutlook(LOOKUP, True, most) if f else RowOutlook() for f, most in zip(free, mosts)]
    source_alphas = {LOOKUP: float(torch.rand(1, generator=g)), DRAFT: float(torch.rand(1, generator=g))}
    rooms = torch.randint(0, 7, (B,), generator=g).tolist()
    costs = linear(1.0, float(torch.rand(1, generator=g)) * 0.2, float(torch.rand(1, generator=g)) * 0.5)
    policy = policy_with(costs)
    for slot, outlook in enumerate(outlooks):
        policy.start(slot)
        estimate = policy.estimate(slot, outlook.source)
        estimate.accepted, estimate.judged = source_alphas[outlook.source] * 1e6, 1e6
    alphas = [source_alphas[o.source] for o in outlooks]
    assert policy.plan(list(range(B)), rooms, outlooks) == best_mixed_plan_by_brute_force(
        alphas, rooms, outlooks, costs
    )


def test_a_copied_row_drafts_wide_where_the_heads_rows_would_not_pay_for_it():
    """A dear head (a draft step 0.6 of a target step) at α 0.6 does not pay for itself; the same
    round's row whose context a lookup continues (α 0.9, 6 tokens) drafts them all, for free."""
    costs = linear(1.0, 0.02, 0.6)
    policy = policy_with(costs)
    for slot, (source, alpha) in enumerate([(DRAFT, 0.6), (LOOKUP, 0.9)]):
        policy.start(slot)
        policy.estimate(slot, source).accepted, policy.estimate(slot, source).judged = alpha * 1e6, 1e6
    outlooks = [RowOutlook(), RowOutlook(LOOKUP, free=True, most=6)]
    assert policy.choose([0, 1], [100, 100], outlooks) == [0, K]
    assert policy.choose([0, 1], [100, 100], [RowOutlook(), RowOutlook(LOOKUP, free=True, most=2)]) == [0, 2]
    assert policy.choose([0], [100]) == [0]  # the head alone: plain decoding


def test_each_row_is_drafted_by_the_drafter_of_more_expected_tokens_per_second():
    """A lookup that copies (α 0.9, free) beats the head (α 0.6, a step 0.1 of the target's); a
    coincidental match (α 0.2) gives way to the head rather than to a plain round; a match of one
    token at α 0.7 still beats the head's longer but dear drafts; a tie keeps the first offered."""
    policy = policy_with(linear(1.0, 0.02, 0.1))
    policy.start(0)
    head = RowOutlook()
    for source, alpha in ((DRAFT, 0.6), (LOOKUP, 0.9)):
        policy.estimate(0, source).accepted, policy.estimate(0, source).judged = alpha * 1e6, 1e6
    copy = RowOutlook(LOOKUP, free=True, most=6)
    assert policy.pick([0], [100], [(head, copy)]) == [copy]
    assert policy.pick([0], [100], [(head,)]) == [head]
    policy.estimate(0, LOOKUP).accepted = 0.2 * 1e6
    assert policy.pick([0], [100], [(copy, head)]) == [head]
    policy.estimate(0, LOOKUP).accepted = 0.7 * 1e6
    assert policy.pick([0], [100], [(head, RowOutlook(LOOKUP, free=True, most=1))]) == [RowOutlook(LOOKUP, True, 1)]
    policy.estimate(0, LOOKUP).accepted = 0.6 * 1e6
    same = RowOutlook(LOOKUP, free=False)
    assert policy.pick([0], [100], [(same, head)]) == [same] and policy.pick([0], [100], [(head, same)]) == [head]


def test_acceptance_is_learnt_per_source_and_pooled_per_source():
    """One sequence's lookup rounds accepted in full and its head rounds rejected: two
    estimates, two priors; the source not used in a round drifts back to its prior."""
    policy = policy_with(linear(1.0, 0.1, 0.1))
    policy.start(0)
    for _ in range(20):
        policy.observe([0], [4], [4], [LOOKUP])
        policy.observe([0], [4], [0], [DRAFT])
    assert policy._alpha(0, LOOKUP) > 0.9 and policy._alpha(0, DRAFT) < 0.2
    assert policy.prior(LOOKUP).rate(0.5) > 0.9 and policy.prior(DRAFT).rate(0.5) < 0.2
    before = policy.estimate(0, DRAFT).judged
    policy.observe([0], [4], [4], [LOOKUP])
    assert policy.estimate(0, DRAFT).judged < before  # relaxed: not judged this round
    policy.start(1)  # a new sequence starts from each source's pooled rate
    assert policy._alpha(1, LOOKUP) > 0.8 and policy._alpha(1, DRAFT) < 0.3


def test_one_good_row_among_useless_ones():
    """Alone, the good row drafts; among three useless rows its drafts do not pay for widening
    the batch's verify, and nobody drafts."""
    costs = linear(1.0, 0.2, 0.2)
    policy = policy_with(costs)
    for slot, alpha in enumerate([0.0, 0.0, 0.0, 0.95]):
        policy.start(slot)
        policy.estimate(slot).accepted, policy.estimate(slot).judged = alpha * 1e6, 1e6
    assert policy.choose([0, 1, 2, 3], [50] * 4) == [0] * 4
    alone = {k: expected_tokens(0.95, k) / costs.seconds(k, k + 1) * (MIN_GAIN if k == 0 else 1) for k in range(K + 1)}
    assert policy.choose([3], [50]) == [max(alone, key=alone.get)] and max(alone, key=alone.get) > 0


def test_a_probe_drafts_one_row_in_turn():
    policy = policy_with(linear(1.0, 0.01, 0.2))
    for slot in range(3):
        policy.start(slot)
        policy.estimate(slot).judged = 1e6  # α = 0
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
    policy.prior().accepted, policy.prior().judged = 90.0, 100.0  # the others accept 0.9
    policy.start(0)
    for _ in range(10):
        policy.observe([0], [4], [0])  # rejected at once, ten rounds running
    assert policy.plan([0], [100]) == [0]
    rounds = 1
    while policy.plan([0], [100]) == [0]:  # the plan, probes aside
        policy.observe([0], [0], [0])  # a plain round: nothing judged
        rounds += 1
    assert 1 < rounds < 16


def test_plain_rounds_probe_with_one_draft_now_and_then():
    policy = policy_with(linear(1.0, 0.01, 0.005))  # a probe costs little: one every PROBE_INTERVAL
    policy.start(0)
    policy.estimate(0).judged = 1e6  # α = 0
    choices = [policy.choose([0], [100])[0] for _ in range(3 * (PROBE_INTERVAL + 1))]
    assert choices.count(1) == 3 and set(choices) == {0, 1}
    assert choices[PROBE_INTERVAL] == 1 and choices[:PROBE_INTERVAL] == [0] * PROBE_INTERVAL
    assert policy.k_counts == {0: 3 * PROBE_INTERVAL, 1: 3}


def test_probes_come_further_apart_where_they_cost_more():
    """A probe widens the verify to 2 tokens (here 1.5 steps) and drafts a token (0.5 steps):
    it comes after enough plain rounds that probes take PROBE_BUDGET of the time."""
    policy = policy_with(linear(1.0, 0.5, 0.5))
    policy.start(0)
    policy.estimate(0).judged = 1e6
    choices = [policy.choose([0], [100])[0] for _ in range(80)]
    floor = math.ceil((0.5 + 0.5) / PROBE_BUDGET)
    assert floor > PROBE_INTERVAL and choices.index(1) == floor


def test_probes_never_stop_and_keep_to_their_budget():
    """Where a probe is dear (here it loses 2.5 plain rounds' time), probes come every
    MAX_PROBE_INTERVAL rounds, never further apart."""
    policy = policy_with(linear(1.0, 2.0, 0.5))
    policy.start(0)
    policy.estimate(0).judged = 1e6  # α = 0
    probes_at = []
    for round_index in range(1000):
        if policy.choose([0], [100])[0]:
            probes_at.append(round_index)
            policy.observe([0], [1], [0])  # rejected again
    gaps = [b - a - 1 for a, b in zip([-1] + probes_at, probes_at)]
    assert math.ceil(2.5 / PROBE_BUDGET) > MAX_PROBE_INTERVAL and set(gaps) == {MAX_PROBE_INTERVAL}


def test_probes_come_sooner_the_less_they_are_expected_to_lose():
    """A probe's expected loss counts the tokens its drafts are expected to add: near the
    break-even point it costs next to nothing and comes after PROBE_INTERVAL rounds, so that an
    unlucky round does not switch a good draft off for long."""
    gaps = {}
    for alpha in (0.0, 0.2, 0.4):
        policy = policy_with(linear(1.0, 0.3, 0.05))
        policy.start(0)
        policy.estimate(0).accepted, policy.estimate(0).judged = alpha * 1e6, 1e6
        choices = [policy.choose([0], [100])[0] for _ in range(100)]
        gaps[alpha] = choices.index(1)
        loss = 1.3 + 0.05 - expected_tokens(alpha, 1)
        assert gaps[alpha] == max(PROBE_INTERVAL, math.ceil(max(0.0, loss) / PROBE_BUDGET) if loss > 1e-9 else 0)
    assert gaps[0.0] > gaps[0.2] > gaps[0.4] == PROBE_INTERVAL


# Verify costs of a float32 target on these CPUs (SmolLM2-135M, in steps): a matrix product over
# 2 or 3 rows costs more than one over 4 or 5, so verify(T) is no line in T.
BUMPY = {1: 1.0, 2: 1.8, 3: 2.5, 4: 1.6, 5: 1.55, 6: 2.0}


def bumpy(draft_step: float = 0.04) -> RoundCosts:
    return RoundCosts(CostCurve(dict(BUMPY)), CostCurve({1: draft_step, 2: 2 * draft_step}))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.7, 0.9])
def test_bumpy_verify_costs_are_read_at_every_length(alpha):
    """The choice is the best k by each length's own cost (k = 3 or 4 over 1 or 2 here)."""
    policy = policy_with(bumpy(), k_max=5)
    policy.start(0)
    policy.estimate(0).accepted, policy.estimate(0).judged = alpha * 1e6, 1e6
    goodput = {k: expected_tokens(alpha, k) / (BUMPY[k + 1] + k * 0.04) for k in range(1, 6)}
    goodput[0] = MIN_GAIN * 1.0
    assert policy.choose([0], [100]) == [max(goodput, key=goodput.get)]


def test_a_probe_drafts_at_the_best_drafting_k():
    """Where a 2-token verify costs more than a 5-token one, a probe drafts 4 tokens, not 1 (at
    α = 0 every k promises one token: the cheapest round wins)."""
    policy = policy_with(bumpy(), k_max=5)
    policy.start(0)
    policy.estimate(0).judged = 1e6  # α = 0
    choices = [policy.choose([0], [100])[0] for _ in range(200)]
    cheapest = min(range(1, 6), key=lambda k: BUMPY[k + 1] + 0.04 * k)
    assert cheapest == 4 and {k for k in choices if k} == {4}


def test_calibration_times_every_length_warm():
    """Each forward length 1..k + 1 is timed after untimed runs (here the first two calls of a
    shape cost 50 times more, as a cold one can), the fastest of the timed ones kept (runs this
    short are timed CALIBRATION_REPEATS times); a larger k later times only the lengths it adds;
    the draft step once."""
    now = [0.0]
    calls = Counter()
    warm = {t: 0.01 + 0.001 * t for t in range(1, 10)}

    def time_target(num_tokens):
        calls[num_tokens] += 1
        now[0] += warm[num_tokens] * (50 if calls[num_tokens] <= CALIBRATION_WARM_UPS else 1)

    def time_draft():
        calls["draft"] += 1
        now[0] += 0.003 * (50 if calls["draft"] <= CALIBRATION_WARM_UPS else 1)

    policy = GoodputPolicy(5, clock=lambda: now[0])
    policy.calibrate(1, 2, time_target, time_draft)
    runs = CALIBRATION_WARM_UPS + CALIBRATION_REPEATS
    assert policy.costs[1].verify.calibrated == pytest.approx({t: warm[t] for t in (1, 2, 3)})
    assert policy.costs[1].draft.seconds(1) == pytest.approx(0.003)
    assert calls == {1: runs, 2: runs, 3: runs, "draft": runs}
    policy.calibrate(1, 4, time_target, time_draft)
    assert policy.costs[1].verify.calibrated == pytest.approx({t: warm[t] for t in range(1, 6)})
    assert calls == {1: runs, 2: runs, 3: runs, 4: runs, 5: runs, "draft": runs}
    policy.calibrate(1, 4, time_target, time_draft)  # nothing new
    assert sum(calls.values()) == 6 * runs


def test_a_big_batch_times_its_shortest_and_longest_forwards_once_each():
    """From LINEAR_FROM_ROWS rows a forward's cost is about linear in its length: k = 4 times
    lengths 1 and 5 only, the ones between interpolated; a run that takes CALIBRATION_SECONDS
    or more is timed once after its warm-ups."""
    now = [0.0]
    calls = Counter()
    warm = {t: 2.0 + 0.5 * t for t in range(1, 10)}  # seconds: a big batch's forward

    def time_target(num_tokens):
        calls[num_tokens] += 1
        now[0] += warm[num_tokens]

    policy = GoodputPolicy(5, clock=lambda: now[0])
    policy.calibrate(LINEAR_FROM_ROWS, 4, time_target, lambda: None)
    assert policy.costs[LINEAR_FROM_ROWS].verify.calibrated == pytest.approx({1: warm[1], 5: warm[5]})
    assert policy.costs[LINEAR_FROM_ROWS].verify.seconds(3) == pytest.approx(warm[3])
    assert calls == {1: CALIBRATION_WARM_UPS + 1, 5: CALIBRATION_WARM_UPS + 1}
    assert CALIBRATION_SECONDS <= warm[1]


def test_calibration_of_a_second_batch_size_replaces_what_it_started_from():
    policy = GoodputPolicy(2, clock=iter(range(10**6)).__next__)  # every timed call lasts 1
    policy.calibrate(1, 2, lambda num_tokens: None, lambda: None)
    policy.observe_round(1, k=0, verify_tokens=1, target_seconds=3.0, draft_seconds=None)
    policy.observe_round(1, k=0, verify_tokens=1, target_seconds=3.0, draft_seconds=None)
    assert policy.costs[1].verify.seconds(1) == pytest.approx(3.0)
    policy.observe_round(4, k=0, verify_tokens=1, target_seconds=3.0, draft_seconds=None)  # starts from bucket 1's
    assert 1 in policy.costs[4].verify.ratios
    policy.calibrate(4, 2, lambda num_tokens: None, lambda: None)  # measured now: its own
    assert policy.costs[4].verify.ratios == {} and policy.costs[4].verify.seconds(1) == pytest.approx(1.0)
    assert policy.costs[1].verify.seconds(1) == pytest.approx(3.0)


def test_running_costs_are_the_median_of_recent_rounds():
    """A size's scale is the median (low) of its last COST_WINDOW timing ÷ calibrated ratios, the
    calibration counting as a ratio of 1 until the window is full: one disturbed round moves
    nothing, two agreeing ones do; a size not run yet takes the median of the others' scales."""
    curve = CostCurve({1: 1.0, 2: 3.0, 6: 4.0})
    curve.observe(1, 10.0)  # one round disturbed by another process
    assert curve.seconds(1) == pytest.approx(1.0)
    curve.observe(1, 2.0)
    curve.observe(1, 2.0)  # ratios 1, 10, 2, 2: the median (low) is 2
    assert curve.seconds(1) == pytest.approx(2.0)
    assert curve.seconds(4) == pytest.approx(2.0 * 3.5)  # interpolated, at the others' scale
    curve.observe(6, 4.0)
    curve.observe(6, 4.0)
    assert curve.seconds(6) == pytest.approx(4.0) and curve.seconds(4) == pytest.approx(
        3.5 * 1.0
    )  # median low of 2 and 1
    for _ in range(COST_WINDOW):
        curve.observe(2, 1.5)  # the window full of ratio 0.5: the calibration's 1 is gone
    assert curve.seconds(2) == pytest.approx(1.5)
    assert curve.seconds(8) == pytest.approx(4.5)  # past the last: the last two's slope (scale of 6: 1)


def test_costs_learn_from_each_rounds_timing():
    """A round's timing is its own T's verify cost and its k's draft cost; after plain rounds
    (the draft catching up on what it skipped) a draft timing only lowers the estimate."""
    policy = policy_with(linear(1.0, 0.1, 0.2))
    policy.start(0)
    policy.choose([0], [100])  # a first round follows no drafting round
    for _ in range(2):
        policy.observe_round(1, k=0, verify_tokens=1, target_seconds=2.0, draft_seconds=0.0)
    verify, draft = policy.costs[1].verify, policy.costs[1].draft
    assert verify.seconds(1) == pytest.approx(2.0) and verify.seconds(4) == pytest.approx(2 * 1.3)
    for _ in range(2):  # after plain rounds: a dearer draft timing says nothing
        policy.observe_round(1, k=3, verify_tokens=4, target_seconds=2.6, draft_seconds=3 * 0.7)
    assert verify.seconds(4) == pytest.approx(2.6) and draft.ratios == {}
    for _ in range(2):  # ... a cheaper one does
        policy.observe_round(1, k=3, verify_tokens=4, target_seconds=2.6, draft_seconds=3 * 0.1)
    assert draft.seconds(3) == pytest.approx(0.3)
    policy.estimate(0).accepted = policy.estimate(0).judged = 1e6
    policy.choose([0], [100])  # a drafting round
    policy.choose([0], [100])  # ... after a drafting round: every timing counts
    for _ in range(4):  # ratios 1, 0.5, 0.5 and four of 3.5: their median
        policy.observe_round(1, k=3, verify_tokens=4, target_seconds=2.6, draft_seconds=3 * 0.7)
    assert draft.seconds(3) == pytest.approx(3 * 0.7)


class SimulatedMachine:
    """A batch-1 decode against known costs: verify[T] seconds for a forward of T tokens, draft
    seconds a draft token; each draft accepted with probability alpha (seeded). The policy is
    calibrated on these costs, then told each round's timing, as the engine tells it."""

    def __init__(self, verify: dict[int, float], draft: float, alpha: float, k_max: int = 5, seed: int = 0):
        self.verify, self.draft, self.alpha = dict(verify), draft, alpha
        self.random = random.Random(seed)
        self.policy = GoodputPolicy(k_max)
        self.policy.costs[1] = RoundCosts(CostCurve(dict(verify)), CostCurve({1: draft, 2: 2 * draft}))
        self.policy.start(0)

    def run(self, rounds: int) -> Counter:
        chosen = Counter()
        for _ in range(rounds):
            k = self.policy.choose([0], [100])[0]
            accepted = next((i for i in range(k) if self.random.random() >= self.alpha), k)
            self.policy.observe([0], [k], [accepted])
            self.policy.observe_round(1, k, k + 1, target_seconds=self.verify[k + 1], draft_seconds=k * self.draft)
            chosen[k] += 1
        return chosen


def test_simulated_decoding_settles_on_the_best_k():
    machine = SimulatedMachine(BUMPY, draft=0.04, alpha=0.8)
    goodput = {k: expected_tokens(0.8, k) / (BUMPY[k + 1] + k * 0.04) for k in range(1, 6)}
    machine.run(50)
    assert machine.run(200).most_common(1)[0][0] == max(goodput, key=goodput.get)


def test_one_disturbed_round_changes_nothing():
    machine = SimulatedMachine(BUMPY, draft=0.04, alpha=0.8)
    machine.run(50)
    k = machine.policy.choose([0], [100])[0]
    machine.policy.observe([0], [k], [k])
    machine.policy.observe_round(1, k, k + 1, target_seconds=20 * BUMPY[k + 1], draft_seconds=20 * k * 0.04)
    assert machine.policy.choose([0], [100])[0] == k


def test_the_policy_adapts_when_costs_change():
    """The draft turns 40 times dearer (another process took its core, say): drafting stops;
    cheap again, the probes find it out and drafting resumes."""
    machine = SimulatedMachine(BUMPY, draft=0.04, alpha=0.8)
    assert machine.run(100)[0] < 10
    machine.draft = 1.6
    machine.run(20)
    assert machine.run(100)[0] > 90
    machine.draft = 0.04
    machine.run(3 * MAX_PROBE_INTERVAL)
    assert machine.run(100)[0] < 10


def test_a_verify_dearer_than_thought_switches_drafting_off():
    """Verify forwards of more than one token cost 3 steps, where calibration said 1.1-1.5; a
    plain step costs what it did. Drafting rounds alone would read this as a machine grown
    slower (every size dearer): the plain round every PLAIN_CHECK_INTERVAL tells them apart."""
    calibrated = {t: 1.0 + 0.1 * (t - 1) for t in range(1, 7)}
    machine = SimulatedMachine(calibrated, draft=0.02, alpha=0.6)
    assert machine.run(50)[0] < 5
    machine.verify = {1: 1.0, **{t: 3.0 for t in range(2, 7)}}
    machine.run(PLAIN_CHECK_INTERVAL + 10)
    assert machine.run(100)[0] > 95


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    return {
        "target": save_tiny_model(root / "target", "llama", seed=31, init_std=0.3),
        "random_draft": save_tiny_model(root / "draft", "llama", seed=32, init_std=0.3, num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def target_alone(dirs):
    llm = LLM(str(dirs["target"]), dtype="float32", compile="off", speculative_method="none")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def fixed_costs(policy: GoodputPolicy, batch_size: int, k: int, time_target, time_draft) -> None:
    """GoodputPolicy.calibrate with costs of a typical small target and draft instead of
    timings: a verify of k+1 tokens 20% dearer than a step, a draft step a fifth of one."""
    policy.costs[1 << (batch_size - 1).bit_length()] = RoundCosts(
        CostCurve({1: 1e-3, k + 1: 1.2e-3}), CostCurve({1: 2e-4, k: k * 2e-4})
    )


@pytest.fixture
def costs_fixed(monkeypatch):
    """The policy's costs fixed (fixed_costs; rounds teach nothing), so that its choices rest on
    acceptance alone: on a loaded machine measured costs can make drafting look cheap for a
    while, which the cost tests above cover."""
    monkeypatch.setattr(GoodputPolicy, "calibrate", fixed_costs)
    monkeypatch.setattr(GoodputPolicy, "observe_round", lambda policy, *args, **kwargs: None)


def test_a_useless_draft_switches_speculation_off(dirs, target_alone, costs_fixed):
    """A random draft (α near 0) makes the policy plain-decode nearly every round."""
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["random_draft"]),
        num_speculative_tokens=K,
        dtype="float32",
        compile="off",
    )
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
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["target"]),
        draft_dtype="float32",
        num_speculative_tokens=K,
        dtype="float32",
        compile="off",
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == target_alone
    assert all(o.metrics.acceptance_rate == 1.0 for o in outputs if o.metrics.num_judged_tokens)


def test_fixed_policy_drafts_k_every_round(dirs, target_alone):
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["random_draft"]),
        num_speculative_tokens=K,
        dtype="float32",
        compile="off",
        speculative_k_policy="fixed",
    )
    output = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert output.outputs[0].token_ids == target_alone[0]
    rounds_by_k = output.metrics.rounds_by_k  # k, but less in the last rounds, where the row has no room
    assert rounds_by_k[K] == sum(rounds_by_k) - K and rounds_by_k[:K] == [1] * K


def test_bad_k_policy_is_refused(dirs, capsys):
    with pytest.raises(ValueError, match=r"speculative_k_policy must be one of \('goodput', 'fixed'\), got 'best'"):
        LLM(str(dirs["target"]), speculative_method="ngram", speculative_k_policy="best")
    with pytest.raises(ValueError, match="k_policy='fixed' with speculative_method='none'"):
        LLM(str(dirs["target"]), speculative_method="none", speculative_k_policy="fixed")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(dirs["target"]), "--ngram", "--k-policy", "best", "--prompt", "x"])
    assert "invalid choice: 'best'" in capsys.readouterr().err
    none = ["--speculative-method", "none", "--k-policy", "fixed"]
    assert main(["generate", "--model", str(dirs["target"]), *none, "--prompt", "x"]) == 2
    assert "--k-policy sets speculation, which --speculative-method none turns off" in capsys.readouterr().err


def test_probes_draft_for_one_row_of_a_sampled_batch(dirs, costs_fixed):
    """k = 0 rounds, then a probe: one row drafts (its draft distributions placed among rows
    that propose nothing), the batch's output stays whole."""
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["random_draft"]),
        num_speculative_tokens=K,
        dtype="float32",
        compile="off",
    )
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
    kwargs = dict(speculative_model=str(dirs["random_draft"]), num_speculative_tokens=K, dtype="float32", compile="off")
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


def flat_width(num_rows: int, num_tokens: int, longest: int) -> float:
    """A runner of flat rows (ModelRunner.cost_width, eager): a forward costs as its rows' mean."""
    return num_tokens / num_rows


@pytest.mark.parametrize(("cost_width", "drafts"), [(None, False), (flat_width, True)])
def test_with_flat_rows_one_good_row_of_a_batch_drafts_alone(cost_width, drafts):
    """Four rows, one whose drafts are accepted 0.9 of the time and three at 0.05, on a machine
    where a forward costs as its tokens do (4 rows of T tokens: 0.875 + 0.5 T; a plain step
    1.375 for 4 tokens) and a draft step is free. Padded, the good row drafting k pads every row
    to k + 1: at k 1, 4.9 expected tokens for 1.875, less than plain's rate; nobody drafts.
    Flat, its drafts add only themselves (0.125 each): at k 4, 7.1 tokens for 1.875, 1.3x plain;
    it alone drafts (the others' drafts would cost more than the 0.05 they add)."""
    B = 4
    costs = RoundCosts(
        CostCurve({t: 1 + 0.5 * (B * t - 1) / B for t in range(1, K + 2)}), CostCurve({k: 0.0 for k in range(1, K + 1)})
    )
    policy = GoodputPolicy(K) if cost_width is None else GoodputPolicy(K, cost_width)
    policy.costs[B] = costs
    for slot, alpha in enumerate([0.9, 0.05, 0.05, 0.05]):
        policy.start(slot)
        estimate = policy.estimate(slot)
        estimate.accepted, estimate.judged = alpha * 1e6, 1e6
    ks = policy.plan([0, 1, 2, 3], [100] * B)
    assert (ks[0] > 0) == drafts
    assert ks[1:] == [0, 0, 0]


def test_a_round_of_flat_rows_is_costed_at_its_mean_length():
    """observe_round with num_verified: a round of 4 rows, 10 real tokens, longest 4, under flat
    rows counts as width 2.5, between the calibrated 2 and 3; padded, as width 4."""
    curve = {t: float(t) for t in range(1, 6)}
    flat = GoodputPolicy(4, flat_width)
    padded = GoodputPolicy(4)
    for policy in (flat, padded):
        policy.costs[4] = RoundCosts(CostCurve(dict(curve)), CostCurve({1: 0.1}))
        for _ in range(COST_WINDOW):
            policy.observe_round(4, k=3, verify_tokens=4, target_seconds=5.0, draft_seconds=None, num_verified=10)
    assert flat.costs[4].verify.scale(2) == pytest.approx(2.0)  # 5 s where 2.5 was calibrated
    assert flat.verify_seconds(4, 2) == pytest.approx(4.0)
    assert padded.costs[4].verify.scale(4) == pytest.approx(1.25)  # 5 s where 4 was calibrated
