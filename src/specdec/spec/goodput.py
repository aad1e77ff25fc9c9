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
           pads it; where it runs flat rows, kv_cache.FlatRows, over each row's own tokens: it
           costs as B rows of their mean length, the cost width), plus sampling. Measured
           (RoundCosts), per batch size rounded up to a power of two: a calibration when the
           engine first prepares for that batch size and k, of every forward length 1..k + 1
           (past 9, each kernel tile's ends: _calibrated_lengths; a float32 matrix product over
           2 or 3 rows can cost more than one over 4 or 5: the cost is not a line in T), each
           timed warm (after untimed runs: the first calls of a shape pay for allocation, weight
           packing and kernel selection); then every round's own timing, by a median of the
           recent rounds at that size (CostCurve), which one disturbed round does not move.

Each round takes the plan (k, and the rows that draft) that maximises
    (B + sum over drafting rows of (E(α_i, min(k, room_i)) - 1)) / (verify(width) + draft(k) * n / B)
for B rows of which n draft, room_i being what row i can still emit: the rows share the round's
target forward, padded to k + 1 tokens a row if any row drafts (width k + 1), or, flat, of B
tokens plus the drafts (width 1 + n k / B), while the drafter's work is per row. So a row whose
drafts would not pay their way drafts nothing, the others draft k; at batch 1 this is the
sequence's own k. Flat, a row that drafts adds only its own tokens to the verify: drafting some
rows of a batch pays where padding every row to their k would not.

A drafter made of several (a lookup or suffix tree, a head behind it) says before the round
which of them could draft each row (Drafter.outlook: its source, whether it is free, and the
most tokens it gives); the policy picks one per row (pick: the one of the most expected tokens
per second for that row alone) and tells the drafter (Drafter.assign). α is estimated per
sequence and source, each source with its own pooled prior; a free row's tokens cost only the
verify's width (room_i also capped by what it gives), and the rows that pay draft steps may
draft fewer, k_c <= k: the plan is (k, k_c, the paying rows), the free rows drafting
min(k, room_i) each. A lookup's copy, accepted often and free, then gets a wide verify even
where the head's guesses would not pay for one.

A plan that drafts must promise MIN_GAIN (5%) more than plain decoding: the costs are measured
to a few percent, the acceptance rates estimated, and a thinner predicted gain is as likely a
loss. A useless draft (α near 0) or a high temperature makes k = 0 win, and the round costs a plain
decode step. k = 0 rounds teach nothing about α, so after enough of them in a row one row of one
round drafts (the rows take turns), to see whether drafting pays again: at the k whose plan
promises the most (usually 1; more where a longer verify costs less). How many is enough: the
probe's expected loss against a plain round (its wider verify and draft steps, less the tokens
its drafts are expected to add at the estimated α), in plain rounds, over PROBE_BUDGET, and
between PROBE_INTERVAL and MAX_PROBE_INTERVAL: a probe near the break-even point costs next to
nothing and comes soon (one unlucky round does not switch a good draft off for long), one of a
useless draft comes rarely, and drafting is never off for good. A probe costs more than a draft
step: a draft model first catches up on the tokens it skipped. That catch-up is not a draft
step's cost, so the round after k = 0 rounds teaches the draft's cost only where it was less than
thought.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from specdec.drafters.base import DRAFT, RowOutlook
from specdec.metrics import AcceptanceEstimate, expected_tokens_per_round

PROBE_INTERVAL = 4  # k = 0 rounds in a row before a probe, at least ...
MAX_PROBE_INTERVAL = 64  # ... and at most
PROBE_BUDGET = 0.02  # the probes' expected loss against plain decoding, as a share of the time
PLAIN_CHECK_INTERVAL = 64  # drafting rounds in a row before a plain one (its cost measured again)
MIN_GAIN = 1.05  # a plan that drafts must promise this many times plain decoding's tokens per second
PRIOR_DECAY = 0.99  # the same for the prior, every sequence's rounds pooled: a long memory
POOLED_PRIOR = 0.5  # where the prior itself starts, ...
POOLED_PRIOR_WEIGHT = 8.0  # ... with this weight
COST_WINDOW = 9  # the recent rounds at a size whose median is its running cost
CALIBRATION_WARM_UPS = 2  # untimed runs of a shape before it is timed
CALIBRATION_REPEATS = 3  # timed runs at most; the fastest counts ...
CALIBRATION_SECONDS = 0.5  # ... and no more once the timed runs took this long (a big batch's forward)
CALIBRATED_UP_TO = 9  # forward lengths timed one by one; past it, each tile's ends ...
TILE_ROWS = 8  # ... of this many rows (the CPU kernels' tile: qmatmul.cpp's MAX_TILE)
LINEAR_FROM_ROWS = 16  # from this batch bucket on, a forward's cost is about linear in its length:
# only the shortest and longest are timed, the lengths between interpolated (CostCurve)


@dataclass
class CostCurve:
    """Seconds of something done at size x (the target's forward of x tokens per row; the
    drafter's x draft tokens): scale(x) * calibrated(x). Neither is linear in x (a matmul over
    2 rows per sequence can cost as much as one over 6; a drafter pays a catch-up forward and
    per-call work before its first token), so calibrated holds measured sizes, read off the line
    through the nearest two between them. The rounds' own timings give each size's scale: the
    median of its last COST_WINDOW ratios (timing ÷ calibrated), the calibration counting as one
    ratio of 1 until the window is full, so that one disturbed round moves nothing and two
    agreeing ones move it (median_low). The scale covers what calibration leaves out (sampling,
    longer contexts, other batch sizes, a machine now busier); a size no round has run yet takes
    the median of the others' scales."""

    calibrated: dict[int, float]
    ratios: dict[int, deque] = field(default_factory=dict)  # by size: recent timings ÷ calibrated

    def seconds(self, x: float) -> float:
        """x may fall between sizes (a forward of flat rows costs as their mean length): the
        calibration's line there, scaled as the nearest size."""
        return self.scale(round(x)) * self.calibrated_seconds(x)

    def scale(self, x: int) -> float:
        if x in self.ratios:
            return statistics.median_low(self.ratios[x])
        scales = [statistics.median_low(ratios) for ratios in self.ratios.values()]
        return statistics.median_low(scales) if scales else 1.0

    def observe(self, x: float, seconds: float) -> None:
        """Doing it at size x took seconds (a fractional x counts for the nearest size's scale)."""
        ratios = self.ratios.setdefault(round(x), deque([1.0], maxlen=COST_WINDOW))
        ratios.append(seconds / max(self.calibrated_seconds(x), 1e-9))

    def calibrated_seconds(self, x: float) -> float:
        if x == int(x) and int(x) in self.calibrated:
            return self.calibrated[int(x)]
        below = max((t for t in self.calibrated if t < x), default=None)
        above = min((t for t in self.calibrated if t > x), default=None)
        if below is None or above is None:  # past the measured ones: the nearest two's slope
            near = sorted(self.calibrated, key=lambda t: abs(t - x))[:2]
            if len(near) == 1:
                return self.calibrated[near[0]]
            below, above = sorted(near)
        slope = (self.calibrated[above] - self.calibrated[below]) / (above - below)
        return max(0.0, self.calibrated[below] + slope * (x - below))

    def copy(self) -> CostCurve:
        return CostCurve(
            dict(self.calibrated), {x: deque(ratios, maxlen=COST_WINDOW) for x, ratios in self.ratios.items()}
        )


@dataclass
class RoundCosts:
    """Seconds of a round's parts, for one batch size: the target's forward of T tokens per row
    with its sampling (verify; T = 1 is a plain step), and the drafter's k tokens (draft)."""

    verify: CostCurve
    draft: CostCurve

    def seconds(self, k: int, verify_tokens: float) -> float:
        return self.verify.seconds(verify_tokens) + (self.draft.seconds(k) if k else 0.0)

    def copy(self) -> RoundCosts:
        return RoundCosts(self.verify.copy(), self.draft.copy())


def padded_width(num_rows: int, num_tokens: int, longest: int) -> float:
    """The cost width of a forward padded to its longest row (no buckets, no flat rows)."""
    return longest


class GoodputPolicy:
    """Picks each round's k (0..k_max) for the engine; see the module's docstring.

    cost_width(rows, tokens, longest): the tokens per row a target forward of rows rows, tokens
    real tokens in all and its longest row longest tokens, costs as (ModelRunner.cost_width: the
    longest, padded to a compiled runner's bucket; flat rows, their mean: a round's verify then
    costs its rows' own tokens, B + its drafts, not B x (k + 1)). clock: what calibration times
    with (tests pass their own)."""

    def __init__(self, k_max: int, cost_width=padded_width, clock=time.perf_counter):
        self.k_max = k_max
        self.cost_width = cost_width
        self.clock = clock
        self.costs: dict[int, RoundCosts] = {}  # by batch bucket
        self.estimates: dict[int, dict[str, AcceptanceEstimate]] = {}  # by slot, then source
        self.priors: dict[str, AcceptanceEstimate] = {}  # by source: every sequence's rounds, pooled
        self.k_counts: Counter[int] = Counter()  # rounds run at each k
        self._plain_rounds_in_a_row = 0
        self._drafting_rounds_in_a_row = 0
        self._num_probes = 0  # whose turn a probe is
        self._after_plain_rounds = True  # the round choose() last chose follows a k = 0 round (or none)
        self._last_k = 0
        self._calibrated: set = set()  # (batch bucket, T or "draft") measured, not copied

    # --- measuring --------------------------------------------------------------------------

    def calibrate(self, batch_size: int, k: int, time_target, time_draft) -> None:
        """Costs before any round of batch_size rows and up to k drafts: time_target(T) and
        time_draft() run one forward (batch_size rows of T tokens; one draft step), each timed
        warm (_warm_seconds). Every forward length 1..k + 1 (as the runner pads it; past
        CALIBRATED_UP_TO, those _calibrated_lengths names) not yet measured for this batch
        bucket is (a larger k later measures the lengths it adds; from
        LINEAR_FROM_ROWS rows, the shortest and longest only); the draft step once. Smaller
        batches, as requests finish, start from this shape."""
        bucket = _bucket(batch_size)
        costs = self._costs(batch_size) if self.costs else None
        if (bucket, "draft") not in self._calibrated:
            draft_step = _warm_seconds(time_draft, self.clock) if k else 0.0
            verify = costs.verify if costs is not None else CostCurve({})
            costs = self.costs[bucket] = RoundCosts(verify, CostCurve({1: draft_step, 2: 2 * draft_step}))
            self._calibrated.add((bucket, "draft"))
        assert costs is not None  # made with the draft step's calibration
        lengths = sorted({int(self.cost_width(1, t, t)) for t in _calibrated_lengths(k)})
        if bucket >= LINEAR_FROM_ROWS:
            lengths = sorted({lengths[0], lengths[-1]})
        for length in lengths:
            if (bucket, length) not in self._calibrated:
                costs.verify.calibrated[length] = _warm_seconds(functools.partial(time_target, length), self.clock)
                costs.verify.ratios.pop(length, None)  # ratios to a copied calibration mean nothing now
                self._calibrated.add((bucket, length))

    def observe_round(
        self,
        batch_size: int,
        k: int,
        verify_tokens: int,
        target_seconds: float,
        draft_seconds: float | None,
        num_verified: int | None = None,
    ) -> None:
        """A round's own timings (the round choose() was last asked for): the target's forward
        (with sampling) over verify_tokens tokens in its longest row, num_verified in all (None:
        every row's), and the drafter's k steps for every row (None: only some rows drafted,
        which says little of the whole batch's cost)."""
        costs = self._costs(batch_size)
        num_verified = batch_size * verify_tokens if num_verified is None else num_verified
        costs.verify.observe(self.cost_width(batch_size, num_verified, verify_tokens), target_seconds)
        if k and draft_seconds is not None:
            # after k = 0 rounds the draft also caught up on what it skipped: a timing that can
            # only say its steps cost less than thought (else a draft once timed dear would
            # stay so for good: probes follow k = 0 rounds)
            if not self._after_plain_rounds or draft_seconds < costs.draft.seconds(k):
                costs.draft.observe(k, draft_seconds)

    def verify_seconds(self, batch_size: int, num_tokens: int) -> float:
        """The running cost of a target forward of num_tokens tokens a row for batch_size rows."""
        width = self.cost_width(batch_size, batch_size * num_tokens, num_tokens)
        return self._costs(batch_size).verify.seconds(width)

    def start(self, slot: int) -> None:
        """A new sequence in slot: its estimates start from the priors."""
        self.estimates[slot] = {}

    def estimate(self, slot: int, source: str = DRAFT) -> AcceptanceEstimate:
        """The sequence in slot's acceptance estimate for what source drafts."""
        return self.estimates[slot].setdefault(source, AcceptanceEstimate())

    def prior(self, source: str = DRAFT) -> AcceptanceEstimate:
        """Every sequence's rounds drafted by source, pooled."""
        return self.priors.setdefault(source, AcceptanceEstimate(PRIOR_DECAY, POOLED_PRIOR_WEIGHT))

    def observe(
        self, slots: list[int], num_proposed: list[int], num_accepted: list[int], sources: list[str] | None = None
    ) -> None:
        """What each row's round proposed and had accepted, drafted by sources (None: DRAFT for
        all). A row's other sources drift back to their priors, as a row that proposed nothing."""
        sources = sources or [DRAFT] * len(slots)
        for slot, proposed, accepted, source in zip(slots, num_proposed, num_accepted, sources):
            if proposed:
                self.estimate(slot, source).observe(proposed, accepted)
                self.prior(source).observe(proposed, accepted)
            for other, estimate in self.estimates[slot].items():
                if other != source or not proposed:
                    estimate.relax()

    # --- choosing -----------------------------------------------------------------------------

    def choose(self, slots: list[int], rooms: list[int], outlooks: list[RowOutlook] | None = None) -> list[int]:
        """Each row's k this round (rows in slots, each with room draft tokens at most, drafted
        as outlooks say: None, every row by one drafter at its step's cost): the plan of the
        most expected tokens per second, or a probe (_probe); and after PLAIN_CHECK_INTERVAL
        drafting rounds in a row a plain one, so that the cost drafting is weighed against stays
        measured (a busier machine would otherwise show only in the costs of drafting rounds,
        read as drafting grown dear)."""
        outlooks = outlooks or [RowOutlook()] * len(slots)
        rooms = _capped(rooms, outlooks)
        ks = self.plan(slots, rooms, outlooks)
        if not any(ks) and min(self.k_max, max(rooms)) > 0:
            ks = self._probe(slots, rooms, outlooks, ks)
        elif self._drafting_rounds_in_a_row >= PLAIN_CHECK_INTERVAL:
            ks = [0] * len(ks)
        self._chose(max(ks))
        return ks

    def pick(self, slots: list[int], rooms: list[int], options: list[tuple[RowOutlook, ...]]) -> list[RowOutlook]:
        """Each row's drafter among its options (the first where several promise the same): the
        one of the most expected tokens per second for that row, drafting at its best k with the
        rest of the batch plain (its share of the draft steps where it pays for them)."""
        B = len(slots)
        costs = self._costs(B)

        def promise(slot: int, room: int, outlook: RowOutlook) -> float:
            alpha, cap = self._alpha(slot, outlook.source), _capped([room], [outlook])[0]
            best = B / costs.verify.seconds(1)
            for k in range(1, min(self.k_max, cap) + 1):
                draft = 0.0 if outlook.free else costs.draft.seconds(k) / B
                tokens = B + expected_tokens_per_round(alpha, k) - 1
                verify = costs.verify.seconds(self.cost_width(B, B + k, k + 1))  # this row's drafts alone
                best = max(best, tokens / (verify + draft))
            return best

        return [
            choices[0]
            if len(choices) == 1  # nothing to weigh (a row no lookup continues)
            else max(choices, key=lambda outlook: (promise(slot, room, outlook), -choices.index(outlook)))
            for slot, room, choices in zip(slots, rooms, options)
        ]

    def plan(self, slots: list[int], rooms: list[int], outlooks: list[RowOutlook] | None = None) -> list[int]:
        """Each row's k for the most expected tokens per second: the best drafting plan if it
        promises MIN_GAIN times plain decoding's, else 0 everywhere."""
        B = len(slots)
        outlooks = outlooks or [RowOutlook()] * B
        goodput, ks = self._best_drafting_plan(slots, _capped(rooms, outlooks), outlooks)
        if goodput > MIN_GAIN * B / self._costs(B).seconds(0, 1):
            return ks
        return [0] * B

    def _probe(self, slots: list[int], rooms: list[int], outlooks: list[RowOutlook], ks: list[int]) -> list[int]:
        """ks, or, after _probe_gap k = 0 rounds in a row, ks with one row (in turn) drafting at
        the best drafting plan's k: to see whether drafting pays again."""
        with_room = [row for row, room in enumerate(rooms) if room > 0]
        row = with_room[self._num_probes % len(with_room)]
        k = min(max(self._best_drafting_plan(slots, rooms, outlooks)[1]), rooms[row])
        if self._plain_rounds_in_a_row < self._probe_gap(slots, outlooks, row, k):
            return ks
        self._num_probes += 1
        return [k if r == row else 0 for r in range(len(ks))]

    def _probe_gap(self, slots: list[int], outlooks: list[RowOutlook], row: int, k: int) -> int:
        """k = 0 rounds in a row before a probe where row drafts k tokens: the probe's expected
        loss against a plain round (its forward over k + 1 tokens a row and the row's draft
        steps, less the tokens its drafts are expected to add), in plain rounds, ÷ PROBE_BUDGET;
        at least PROBE_INTERVAL, at most MAX_PROBE_INTERVAL."""
        B = len(slots)
        costs = self._costs(B)
        step = costs.verify.seconds(1)
        tokens = B + expected_tokens_per_round(self._alpha(slots[row], outlooks[row].source), k) - 1
        draft = 0.0 if outlooks[row].free else costs.draft.seconds(k) / B
        loss = (costs.verify.seconds(self.cost_width(B, B + k, k + 1)) + draft) / step - tokens / B
        return min(MAX_PROBE_INTERVAL, max(PROBE_INTERVAL, math.ceil(max(0.0, loss) / PROBE_BUDGET)))

    def _alpha(self, slot: int, source: str = DRAFT) -> float:
        """The sequence in slot's estimated acceptance rate of what source drafts (from that
        source's prior while it has few observations)."""
        return self.estimate(slot, source).rate(self.prior(source).rate(POOLED_PRIOR))

    def _best_drafting_plan(
        self, slots: list[int], rooms: list[int], outlooks: list[RowOutlook]
    ) -> tuple[float, list[int]]:
        """(expected tokens per second, each row's k) of the best plan that drafts ((0, all 0)
        if no row has room). For each verify width k + 1: the free rows draft min(k, room_i),
        and for each k_c <= k (only k_c = k where no row is free) the paying rows that gain most
        from drafting (E(α_i, min(k_c, room_i)) - 1 extra tokens) draft first, each adding its
        share of k_c draft steps (rows that do not draft spare the drafter a row) and its drafts
        to the verify forward: the whole batch's, costing as cost_width says (padded: the longest
        row's tokens a row; flat rows: B plus the drafts, over B)."""
        B = len(slots)
        costs = self._costs(B)
        verify_at = functools.cache(costs.verify.seconds)  # each width once a plan: a scale is a median
        alphas = [self._alpha(slot, outlook.source) for slot, outlook in zip(slots, outlooks)]
        free = [row for row, outlook in enumerate(outlooks) if outlook.free and rooms[row] > 0]
        paying = [row for row, outlook in enumerate(outlooks) if not outlook.free and rooms[row] > 0]
        best, best_ks = 0.0, [0] * B
        for k in range(1, min(self.k_max, max(rooms)) + 1):
            free_ks = {row: min(k, rooms[row]) for row in free}
            free_tokens = B + sum(expected_tokens_per_round(alphas[row], free_ks[row]) - 1 for row in free)
            free_drafts, free_longest = sum(free_ks.values()), max(free_ks.values(), default=0)
            if free:
                verify = verify_at(self.cost_width(B, B + free_drafts, free_longest + 1))
                if free_tokens / verify > best:
                    best, best_ks = free_tokens / verify, [free_ks.get(row, 0) for row in range(B)]
            for k_paying in range(1, k + 1) if free else (k,):
                gains = sorted(
                    ((expected_tokens_per_round(alphas[row], min(k_paying, rooms[row])) - 1, row) for row in paying),
                    reverse=True,
                )
                tokens, drafts, longest = free_tokens, free_drafts, free_longest
                draft = costs.draft.seconds(k_paying)
                for n, (gain, row) in enumerate(gains, start=1):
                    tokens += gain
                    drafts += min(k_paying, rooms[row])
                    longest = max(longest, min(k_paying, rooms[row]))
                    verify = verify_at(self.cost_width(B, B + drafts, longest + 1))
                    goodput = tokens / (verify + draft * n / B)
                    if goodput > best:
                        drafting = {row: min(k_paying, rooms[row]) for _, row in gains[:n]}
                        best, best_ks = goodput, [free_ks.get(row, drafting.get(row, 0)) for row in range(B)]
        return best, best_ks

    def _chose(self, k: int) -> int:
        self._after_plain_rounds = self._last_k == 0
        self._plain_rounds_in_a_row = self._plain_rounds_in_a_row + 1 if k == 0 else 0
        self._drafting_rounds_in_a_row = self._drafting_rounds_in_a_row + 1 if k else 0
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


def _capped(rooms: list[int], outlooks: list[RowOutlook]) -> list[int]:
    """Each row's room, cut to the most tokens its drafter would give."""
    return [room if outlook.most is None else min(room, outlook.most) for room, outlook in zip(rooms, outlooks)]


def _calibrated_lengths(k: int) -> list[int]:
    """The forward lengths calibration times for drafts of up to k tokens: every one up to
    CALIBRATED_UP_TO, then the ends of each kernel tile of TILE_ROWS rows and the first length
    past it (where a second pass begins), and k + 1; CostCurve draws lines between them (a wide
    tree's verify, 17 lengths for 16 nodes, would otherwise take seconds to time)."""
    return [t for t in range(1, k + 2) if t <= CALIBRATED_UP_TO or t % TILE_ROWS in (0, 1) or t == k + 1]


def _bucket(batch_size: int) -> int:
    """Batch sizes that cost about the same share their costs: the next power of two."""
    return 1 << (batch_size - 1).bit_length()


def _warm_seconds(run, clock) -> float:
    """The fastest of CALIBRATION_REPEATS timed calls of run() (fewer, at least one, once they
    took CALIBRATION_SECONDS), after CALIBRATION_WARM_UPS untimed ones: a shape's first calls
    allocate, pack weights and pick kernels, which its later calls (the rounds) do not pay."""
    for _ in range(CALIBRATION_WARM_UPS):
        run()
    best, spent = float("inf"), 0.0
    for _ in range(CALIBRATION_REPEATS):
        start = clock()
        run()
        seconds = clock() - start
        best, spent = min(best, seconds), spent + seconds
        if spent >= CALIBRATION_SECONDS:
            break
    return best
