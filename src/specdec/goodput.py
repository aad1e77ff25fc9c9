"""Choosing each round's k by goodput: the expected tokens per second of the round.

Terms:
  α_i      sequence i's acceptance rate: the chance that a draft token is accepted, given that
           every draft before it in its round was (metrics.py). Estimated from the sequence's own
           rounds, recent ones weighing more (AcceptanceEstimate), starting from the running rate
           of all sequences so far (the prior).
  E(α, k)  Leviathan et al.'s expected tokens of a round that drafts k tokens:
           (1 - α^(k+1)) / (1 - α); k = 0 (plain decoding) emits exactly 1.
  cost(k)  the seconds of a round that drafts k tokens for a batch of B rows: the drafter's k
           steps plus the target's forward over k + 1 tokens per row (padded as the runner
           pads it), plus sampling. Measured (RoundCosts), per batch size rounded up to a power
           of two: a short calibration when the engine first prepares for that batch size, then
           each round's own timing.

Each round takes the plan (k, and the rows that draft) that maximises
    (B + sum over drafting rows of (E(α_i, min(k, room_i)) - 1)) / (verify(k + 1) + draft(k) * n / B)
for B rows of which n draft, room_i being what row i can still emit: the rows share the round's
target forward, padded to k + 1 tokens a row if any row drafts, while the drafter's work is
per row. So a row whose drafts would not pay their way drafts nothing, the others draft k; at
batch 1 this is the sequence's own k. A plan that drafts must promise MIN_GAIN (10%) more than
plain decoding: the costs are measured to a few percent, the acceptance rates estimated, and a
thin predicted gain is as likely a loss (measured at batches of 16 and 32, sampled).
A useless draft (α near 0) or a high temperature makes k = 0 win, and the round costs a plain
decode step. k = 0 rounds teach nothing about α, so after PROBE_INTERVAL of them in a row one
row of one round drafts a single token (the rows take turns), to see whether drafting pays again
(further apart in a wide batch, whose forward a probe widens: PROBE_BUDGET); each probe that finds it does
not doubles the interval (up to MAX_PROBE_INTERVAL), one that finds it does resets it. A probe
costs more than a draft step: a draft model first catches up on the tokens it skipped. That
catch-up is not a draft step's cost, so the round after k = 0 rounds teaches the costs nothing
about drafting.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from specdec.metrics import expected_tokens_per_round

PROBE_INTERVAL = 16  # k = 0 rounds in a row before the first one-token probe
MAX_PROBE_INTERVAL = 256
PROBE_BUDGET = 0.02  # at most this share of the time on probes, as far as their verify goes
MIN_GAIN = 1.1  # a plan that drafts must promise this many times plain decoding's tokens per second
ESTIMATE_DECAY = 0.9  # per round, the weight of a sequence's older observations
PRIOR_DECAY = 0.99  # the same for the prior, every sequence's rounds pooled: a long memory
PRIOR_WEIGHT = 2.0  # the prior's weight, in judged draft tokens
COST_SMOOTHING = 0.2  # weight of each new timing in the running costs
CALIBRATION_REPEATS = 2


class AcceptanceEstimate:
    """α of one sequence: accepted ÷ judged draft tokens, older rounds' counts decayed by
    `decay` each round that judges some, plus PRIOR_WEIGHT judged tokens at the prior's rate. A
    round that drafts nothing for the sequence decays its counts too (relax): the estimate drifts
    back to the prior, so that a run of rejections does not switch a sequence off for good."""

    def __init__(self, decay: float = ESTIMATE_DECAY):
        self.decay = decay
        self.accepted = 0.0
        self.judged = 0.0

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        judged = num_accepted + (1 if num_accepted < num_proposed else 0)
        if judged:
            self.accepted = self.decay * self.accepted + num_accepted
            self.judged = self.decay * self.judged + judged

    def relax(self) -> None:
        self.accepted *= self.decay
        self.judged *= self.decay

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.judged + PRIOR_WEIGHT)


@dataclass
class CostCurve:
    """Seconds of something done at size x (the target's forward of x tokens per row; the
    drafter's x draft tokens): scale(x) * calibrated(x). Neither is linear in x (a matmul over
    2 rows per sequence can cost as much as one over 6; a drafter pays a catch-up forward and
    per-call work before its first token), so calibrated holds a few measured sizes, read off the
    line through the nearest two between them. The rounds' own timings correct each size's
    scale (sampling, which calibration leaves out; longer contexts; other batch sizes); a size
    no round has run yet takes the mean of the others' scales."""

    calibrated: dict[int, float]
    scales: dict[int, float] = field(default_factory=dict)

    def seconds(self, x: int) -> float:
        return self.scale(x) * self.calibrated_seconds(x)

    def scale(self, x: int) -> float:
        if x in self.scales:
            return self.scales[x]
        return sum(self.scales.values()) / len(self.scales) if self.scales else 1.0

    def observe(self, x: int, seconds: float) -> None:
        """Doing it at size x took seconds."""
        self.scales[x] = _smooth(self.scale(x), seconds / max(self.calibrated_seconds(x), 1e-9))

    def calibrated_seconds(self, x: int) -> float:
        if x in self.calibrated:
            return self.calibrated[x]
        below = max((t for t in self.calibrated if t < x), default=None)
        above = min((t for t in self.calibrated if t > x), default=None)
        if below is None or above is None:  # past the measured ones: the nearest two's slope
            near = sorted(self.calibrated, key=lambda t: abs(t - x))[:2]
            if len(near) == 1:
                return self.calibrated[near[0]]
            below, above = sorted(near)
        slope = (self.calibrated[above] - self.calibrated[below]) / (above - below)
        return max(0.0, self.calibrated[below] + slope * (x - below))

    def copy(self) -> "CostCurve":
        return CostCurve(dict(self.calibrated), dict(self.scales))


@dataclass
class RoundCosts:
    """Seconds of a round's parts, for one batch size: the target's forward of T tokens per row
    with its sampling (verify; T = 1 is a plain step), and the drafter's k tokens (draft)."""

    verify: CostCurve
    draft: CostCurve

    def seconds(self, k: int, verify_tokens: int) -> float:
        return self.verify.seconds(verify_tokens) + (self.draft.seconds(k) if k else 0.0)

    def copy(self) -> "RoundCosts":
        return RoundCosts(self.verify.copy(), self.draft.copy())


class GoodputPolicy:
    """Picks each round's k (0..k_max) for the engine; see the module's docstring.

    padded_tokens(T): the query length the target runs a T-token forward at (a compiled runner
    pads to its buckets)."""

    def __init__(self, k_max: int, padded_tokens=lambda num_tokens: num_tokens):
        self.k_max = k_max
        self.padded_tokens = padded_tokens
        self.costs: dict[int, RoundCosts] = {}  # by batch bucket
        self.estimates: dict[int, AcceptanceEstimate] = {}  # by slot
        self.prior = AcceptanceEstimate(PRIOR_DECAY)  # every sequence's rounds, pooled
        self.k_counts: Counter[int] = Counter()  # rounds run at each k
        self._plain_rounds_in_a_row = 0
        self._probe_interval = PROBE_INTERVAL
        self._num_probes = 0  # whose turn a probe is
        self._probing = False  # the round choose() last chose is a probe
        self._after_plain_rounds = True  # ... and follows a k = 0 round (or none)
        self._last_k = 0

    # --- measuring --------------------------------------------------------------------------

    def calibrate(self, batch_size: int, k: int, time_target, time_draft) -> None:
        """Costs before any round of batch_size rows and up to k drafts (once per batch bucket):
        time_target(T) and time_draft() run one forward (batch_size rows of T tokens; one draft
        step), the fastest of a few kept, at T = 1, 2 and k + 1 (others interpolated). Smaller
        batches, as requests finish, start from this shape."""
        bucket = _bucket(batch_size)
        if bucket in self.costs:
            return
        lengths = sorted({self.padded_tokens(t) for t in {1, min(2, k + 1), k + 1}})
        verify = {t: _fastest(lambda: time_target(t)) for t in lengths}
        draft_step = _fastest(time_draft) if k else 0.0
        self.costs[bucket] = RoundCosts(CostCurve(verify), CostCurve({1: draft_step, max(k, 2): max(k, 2) * draft_step}))

    def observe_round(self, batch_size: int, k: int, verify_tokens: int, target_seconds: float,
                      draft_seconds: float | None) -> None:
        """A round's own timings (the round choose() was last asked for): the target's forward
        (with sampling) over verify_tokens tokens per row, and the drafter's k steps for every
        row (None: only some rows drafted, which says little of the whole batch's cost)."""
        costs = self._costs(batch_size)
        costs.verify.observe(self.padded_tokens(verify_tokens), target_seconds)
        if k and draft_seconds is not None and not self._after_plain_rounds:  # after k = 0: catching up
            costs.draft.observe(k, draft_seconds)

    def start(self, slot: int) -> None:
        """A new sequence in slot: its estimate starts from the prior."""
        self.estimates[slot] = AcceptanceEstimate()

    def observe(self, slots: list[int], num_proposed: list[int], num_accepted: list[int]) -> None:
        for slot, proposed, accepted in zip(slots, num_proposed, num_accepted):
            if proposed:
                self.estimates[slot].observe(proposed, accepted)
                self.prior.observe(proposed, accepted)
            else:
                self.estimates[slot].relax()
        if self._probing:  # did drafting pay this time? then probe soon again, else later
            pays = any(self.plan(slots, [self.k_max] * len(slots)))
            self._probe_interval = PROBE_INTERVAL if pays else min(2 * self._probe_interval, MAX_PROBE_INTERVAL)

    # --- choosing -----------------------------------------------------------------------------

    def choose(self, slots: list[int], rooms: list[int]) -> list[int]:
        """Each row's k this round (rows in slots, each with room draft tokens at most): the
        plan of the most expected tokens per second; in a probe, one row (in turn) drafts one
        token."""
        ks = self.plan(slots, rooms)
        self._probing = not any(ks) and min(self.k_max, max(rooms)) > 0 and \
            self._plain_rounds_in_a_row >= max(self._probe_interval, self._probe_floor(len(slots)))
        if self._probing:  # see whether drafting pays again, at the price of one row's catch-up
            with_room = [row for row, room in enumerate(rooms) if room > 0]
            ks[with_room[self._num_probes % len(with_room)]] = 1
            self._num_probes += 1
        self._chose(max(ks))
        return ks

    def plan(self, slots: list[int], rooms: list[int]) -> list[int]:
        """Each row's k for the most expected tokens per second. For each k, the rows that gain
        most from drafting (E(α_i, min(k, room_i)) - 1 extra tokens) draft first, each adding
        its share of the draft's cost (rows that do not draft spare the drafter a row; the
        verify forward is the whole batch's, at k + 1 tokens if anyone drafts)."""
        B = len(slots)
        costs = self._costs(B)
        prior = self.prior.rate(0.5)
        alphas = [self.estimates[slot].rate(prior) for slot in slots]
        best, best_k, best_rows = MIN_GAIN * B / costs.seconds(0, 1), 0, []
        for k in range(1, min(self.k_max, max(rooms)) + 1):
            gains = sorted(((expected_tokens_per_round(alpha, min(k, room)) - 1, row)
                            for row, (alpha, room) in enumerate(zip(alphas, rooms)) if room > 0), reverse=True)
            verify, draft = costs.verify.seconds(self.padded_tokens(k + 1)), costs.draft.seconds(k)
            tokens = float(B)
            for n, (gain, _) in enumerate(gains, start=1):
                tokens += gain
                goodput = tokens / (verify + draft * n / B)
                if goodput > best:
                    best, best_k, best_rows = goodput, k, [row for _, row in gains[:n]]
        ks = [0] * B
        for row in best_rows:
            ks[row] = min(best_k, rooms[row])
        return ks

    def _probe_floor(self, batch_size: int) -> int:
        """The fewest plain rounds between probes for PROBE_BUDGET: a probe widens the whole
        batch's forward to 2 tokens a row, which costs a wide batch more."""
        costs = self._costs(batch_size)
        extra = costs.verify.seconds(self.padded_tokens(2)) / costs.verify.seconds(1) - 1
        return math.ceil(max(0.0, extra) / PROBE_BUDGET)

    def _chose(self, k: int) -> int:
        self._after_plain_rounds = self._last_k == 0
        self._plain_rounds_in_a_row = self._plain_rounds_in_a_row + 1 if k == 0 else 0
        self._last_k = k
        self.k_counts[k] += 1
        return k

    def _costs(self, batch_size: int) -> RoundCosts:
        """The costs of batch_size's bucket; a bucket not seen yet starts from the nearest one's."""
        bucket = _bucket(batch_size)
        if bucket not in self.costs:
            nearest = min(self.costs, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
            self.costs[bucket] = self.costs[nearest].copy()
        return self.costs[bucket]


def _bucket(batch_size: int) -> int:
    """Batch sizes that cost about the same share their costs: the next power of two."""
    return 1 << (batch_size - 1).bit_length()


def _smooth(old: float, new: float) -> float:
    return (1 - COST_SMOOTHING) * old + COST_SMOOTHING * new


def _fastest(run) -> float:
    """The fastest of CALIBRATION_REPEATS timed calls of run(), after one untimed."""
    run()
    best = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
