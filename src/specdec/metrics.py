"""SpecStats: what speculation did for one request (or, merged, for many).

  judged   a draft token the verifier decided on: every draft token before it in its round
           was accepted. Draft tokens after the first rejection are never judged.
  α        acceptance rate = accepted / judged draft tokens: the chance that a draft token is
           accepted, given the verifier reached it. This is the α of the speedup formula
           (1 - α^(k+1)) / ((1 - α)(k·c + 1)), which assumes each judged token is accepted
           independently with probability α.
  accepted / proposed   vLLM's "draft acceptance rate" (`proposed_acceptance_rate`); it is
           lower than α when k > 1, because unjudged drafts count as failures.
  τ        tokens emitted per target forward, bonus and the prefill's first token included
           (plain decoding: exactly 1.0)
  TTFT     time to first token: from the request's arrival at the engine to its first output
           token (its prefill, and any wait for it), which speculation does not shorten; the
           decode rate, the tokens after the first ÷ the seconds after it (1 / vLLM's TPOT), is
           what it speeds up
Acceptance by position i is the fraction of rounds that proposed a draft token at position i
(0-based) in which it was accepted. For a tree draft (tree.py), position i is depth i + 1:
proposed when the tree reaches that depth, accepted when the accepted branch does; a round's
judged tokens are its accepted ones, and one more where the branch stops above the tree's
deepest node. Rounds by k counts the rounds at each k the engine chose
for the request (index k; 0 = a plain decoding step; see goodput.py).
AcceptanceEstimate is one sequence's α as the rounds go, recent rounds weighing more: goodput.py
chooses k by it, lookup_then_draft.py whether lookup or the drafter drafts a sampled row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ESTIMATE_DECAY = 0.9  # per round, the weight of a sequence's older observations (AcceptanceEstimate)
PRIOR_WEIGHT = 4.0  # the prior's weight in a sequence's estimate, in judged draft tokens


@dataclass
class SpecStats:
    num_draft_tokens: int = 0  # proposed
    num_judged_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_target_forwards: int = 0
    num_forced_tokens: int = 0  # emitted where a grammar forced them (jump-forward), not drafted
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    rounds_by_k: list[int] = field(default_factory=list)
    seconds: float = 0.0  # wall time from the start of generate() to this request's end
    first_token_seconds: float = 0.0  # TTFT: wall time from the start of generate() to its first token

    def record_round(
        self,
        num_proposed: int,
        num_accepted: int,
        num_emitted: int,
        k: int | None = None,
        depth: int | None = None,
        num_forced: int = 0,
    ) -> None:
        """One target forward's outcome; k: the round's k for this request (None: the prefill);
        depth: a tree draft's depth (None: a chain, as deep as it is long); num_forced: tokens a
        grammar forced ahead of the drafter's (not counted as its proposals)."""
        self.num_target_forwards += 1
        self.num_forced_tokens += num_forced
        if k is not None:
            _grow(self.rounds_by_k, k + 1)
            self.rounds_by_k[k] += 1
        positions = num_proposed if depth is None else depth
        self.num_draft_tokens += num_proposed
        self.num_judged_tokens += num_accepted + (1 if num_accepted < positions else 0)
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        _grow(self.proposed_by_position, positions)
        _grow(self.accepted_by_position, positions)  # as long: positions never accepted count as 0
        for i in range(positions):
            self.proposed_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / judged; nan when nothing was judged."""
        return self.num_accepted_tokens / self.num_judged_tokens if self.num_judged_tokens else float("nan")

    @property
    def proposed_acceptance_rate(self) -> float:
        """accepted / proposed (vLLM's draft acceptance rate); nan when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """τ."""
        return self.num_emitted_tokens / self.num_target_forwards if self.num_target_forwards else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else float("nan") for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.num_emitted_tokens / self.seconds if self.seconds > 0 else float("nan")

    @classmethod
    def merge(cls, stats: list[SpecStats], one_after_another: bool = False) -> SpecStats:
        """Totals over requests; seconds (and first_token_seconds) is the longest (the requests ran
        together), or their sum where they ran one_after_another."""
        total = cls()
        for s in stats:
            total.num_draft_tokens += s.num_draft_tokens
            total.num_judged_tokens += s.num_judged_tokens
            total.num_accepted_tokens += s.num_accepted_tokens
            total.num_emitted_tokens += s.num_emitted_tokens
            total.num_target_forwards += s.num_target_forwards
            total.num_forced_tokens += s.num_forced_tokens
            for mine, theirs in (
                (total.proposed_by_position, s.proposed_by_position),
                (total.accepted_by_position, s.accepted_by_position),
                (total.rounds_by_k, s.rounds_by_k),
            ):
                _grow(mine, len(theirs))
                for i, n in enumerate(theirs):
                    mine[i] += n
            total.seconds = total.seconds + s.seconds if one_after_another else max(total.seconds, s.seconds)
            total.first_token_seconds = (
                total.first_token_seconds + s.first_token_seconds
                if one_after_another
                else max(total.first_token_seconds, s.first_token_seconds)
            )
        return total

    def summary(self) -> str:
        """One line; the acceptance figures only where something was drafted."""
        by_position = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
        drafted = (
            f"α {self.acceptance_rate:.3f} ({self.num_accepted_tokens} accepted/{self.num_judged_tokens} "
            f"judged/{self.num_draft_tokens} proposed)  by position [{by_position}]  "
            if self.num_draft_tokens
            else ""
        )
        return (
            f"tokens {self.num_emitted_tokens}  target forwards {self.num_target_forwards}  "
            f"τ {self.tokens_per_forward:.2f}  {drafted}{self.k_summary()}{self.seconds:.2f}s  "
            f"{self.tokens_per_second:.1f} tok/s"
        )

    def k_summary(self) -> str:
        """ "k chosen 0:12 5:40  " (rounds at each k), or "" where every round had the same k."""
        return f"k chosen {rounds_by_k_text(self.rounds_by_k)}  " if sum(n > 0 for n in self.rounds_by_k) > 1 else ""


def rounds_by_k_text(rounds_by_k: list[int]) -> str:
    """Rounds at each k as "0:12 5:40" (the k that ran, each with its count)."""
    return " ".join(f"{k}:{n}" for k, n in enumerate(rounds_by_k) if n)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): tokens per round if each draft is accepted with probability α."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """(1 - α^(k+1)) / ((1 - α)(k·c + 1)) over plain decoding, c = draft step / target step."""
    return expected_tokens_per_round(alpha, k) / (k * cost_ratio + 1)


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))


class AcceptanceEstimate:
    """α of one sequence: accepted ÷ judged draft tokens, older rounds' counts decayed by
    `decay` each round that judges some, plus prior_weight judged tokens at the prior's rate. A
    round that drafts nothing for the sequence decays its counts too (relax): the estimate drifts
    back to the prior, so that a run of rejections does not switch a sequence off for good."""

    def __init__(self, decay: float = ESTIMATE_DECAY, prior_weight: float = PRIOR_WEIGHT):
        self.decay = decay
        self.prior_weight = prior_weight
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
        return (self.accepted + self.prior_weight * prior) / (self.judged + self.prior_weight)
