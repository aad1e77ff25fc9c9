"""How many of a grown tree's nodes a round verifies: as many as the verify's measured cost buys.

A drafter that grows trees (tree_growth.py) ranks its nodes; the round used to verify all N of
them. But a verify of w tokens a row costs V(w), measured on the machine (goodput.py's
CostCurve), and V is far from flat on a CPU: a kernel tile of 8 rows makes the 9th row cost a
second pass (docs/runner.md). So each round keeps each row's n likeliest nodes, n the same for
the batch (its verify is as wide as its widest row), chosen for the most expected tokens per
second.

Terms:
  p        a node's score as a probability: the drafter's probability of its whole branch
           (sharpened for greedy rows: tree_growth.py's GREEDY_TREE_TEMPERATURE)
  c_d      the calibration at depth d: how many nodes at depth d the target accepted per unit of
           their p, over recent rounds (decayed by DECAY a round), from a prior of 1 weighing
           PRIOR_WEIGHT. A row accepts at most one node a depth, the one on its accepted branch:
           row i accepted a node at depth d exactly when it accepted d or more tokens. So c_d =
           (rows with num_accepted >= d) / (the p of the verified nodes at depth d), summed over
           rounds. Nodes past the cut are never seen by the target; c_d of the verified ones,
           the likeliest, stands for them.
  A_i(n)   row i's expected accepted tokens with its n likeliest nodes verified: the sum of
           min(1, c_d p) over them
The round keeps the n (1 <= n <= N) of the most (B + sum_i A_i(n)) / V(n + 1). Never 0: the
drafter's work is spent by then, and a verified node keeps c_d measured. The output never
depends on the cut (any subset closed under parents is verified exactly), only the speed; a
round with a seeded sampled request verifies the whole tree, as its tokens depend on the tree.
"""

from __future__ import annotations

from collections import Counter

import torch

from specdec.drafters.base import Draft
from specdec.sequence import Sequence
from specdec.spec.goodput import GoodputPolicy
from specdec.tree import depths

DECAY = 0.98  # each round's weight in c_d, against the rounds before
PRIOR_WEIGHT = 4.0  # c_d starts at 1, as if this much p had been verified at depth d and accepted


class TreeWidth:
    """Cuts each round's tree to the width the verify buys; costs from policy (goodput.py),
    which the engine calibrates and feeds every round's timings."""

    def __init__(self, policy: GoodputPolicy):
        self.policy = policy
        self.accepted = torch.zeros(0, dtype=torch.float64)  # [D]: by depth - 1, decayed
        self.predicted = torch.zeros(0, dtype=torch.float64)  # [D]: the p verified at each depth, decayed
        self.kept_nodes: Counter[int] = Counter()  # rounds that verified n nodes, by n

    def cut(self, draft: Draft, batch: list[Sequence]) -> Draft:
        """draft's tree cut to each row's n likeliest nodes; draft itself where nothing is cut (an
        unranked tree, a chain, a seeded sampled request)."""
        if draft.parents is None or draft.scores is None or draft.token_ids.shape[1] == 0:
            return draft
        if any(s.params.seed is not None and not s.params.greedy for s in batch):
            return draft
        n = self.choose(draft)
        self.kept_nodes[n] += 1
        return draft if n >= draft.token_ids.shape[1] else draft.likeliest(n)

    def choose(self, draft: Draft) -> int:
        """The n of the most expected tokens per second (module docstring)."""
        assert draft.parents is not None and draft.scores is not None  # a ranked tree
        B, N = draft.token_ids.shape
        expected = self._accept_chances(draft)  # [B, N]
        order = draft.scores.cpu().argsort(dim=1, descending=True, stable=True)  # [B, N]: likeliest first
        by_rank = expected.gather(1, order).cumsum(dim=1).sum(dim=0)  # [N]: sum_i A_i(n) for n = 1..N
        tokens = B + by_rank  # [N]
        seconds = torch.tensor(
            [self.policy.verify_seconds(B, n + 1) for n in range(1, N + 1)], dtype=tokens.dtype
        )  # [N]
        return int((tokens / seconds).argmax()) + 1

    def observe(self, draft: Draft, node_depths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """What a round verified (draft, as cut; node_depths [B, N], as the verify placed its
        nodes) and accepted (num_accepted [B]): c_d's sums."""
        if draft.parents is None or draft.scores is None or draft.token_ids.shape[1] == 0:
            return
        chances = self._valid_p(draft)  # [B, N]
        valid = torch.arange(chances.shape[1])[None, :] < draft.num_tokens.cpu()[:, None]  # [B, N]
        node_depths = torch.where(valid, node_depths.cpu(), 0)  # [B, N]: 0 past a row's nodes
        D = int(node_depths.max())
        self._grow(D)
        at_depth = torch.arange(1, D + 1)[:, None, None] == node_depths[None]  # [D, B, N]
        predicted = (chances[None] * at_depth).sum(dim=(1, 2))  # [D]
        has_node = at_depth.any(dim=2)  # [D, B]: row i verified a node at depth d
        reached = num_accepted.cpu()[None, :] >= torch.arange(1, D + 1)[:, None]  # [D, B]
        self.accepted *= DECAY
        self.predicted *= DECAY
        self.accepted[:D] += (has_node & reached).sum(dim=1).double()
        self.predicted[:D] += predicted

    def calibration(self, depth: int) -> float:
        """c_d: accepted nodes at depth per unit of their p."""
        if depth > self.accepted.shape[0]:
            return 1.0
        return float((self.accepted[depth - 1] + PRIOR_WEIGHT) / (self.predicted[depth - 1] + PRIOR_WEIGHT))

    def _accept_chances(self, draft: Draft) -> torch.Tensor:
        """min(1, c_d p) of each node [B, N] (0 past a row's nodes)."""
        node_depths = self._node_depths(draft).cpu()  # [B, N]
        factors = torch.tensor(
            [1.0] + [self.calibration(d) for d in range(1, int(node_depths.max()) + 1)], dtype=torch.float64
        )  # [D + 1]: by depth
        return (factors[node_depths] * self._valid_p(draft)).clamp(max=1.0)

    @staticmethod
    def _valid_p(draft: Draft) -> torch.Tensor:
        """Each node's p [B, N], 0 past a row's nodes: float64, on the CPU (a few numbers)."""
        assert draft.scores is not None
        N = draft.token_ids.shape[1]
        scores, num_tokens = draft.scores.cpu().double(), draft.num_tokens.cpu()
        valid = torch.arange(N)[None, :] < num_tokens[:, None]  # [B, N]
        return torch.where(valid, scores.exp(), 0.0)

    @staticmethod
    def _node_depths(draft: Draft) -> torch.Tensor:
        """Each node's depth [B, N] (padding nodes, children of the root: 1)."""
        assert draft.parents is not None
        return depths(draft.parents)[:, 1:]

    def _grow(self, D: int) -> None:
        """Room for depths up to D."""
        missing = D - self.accepted.shape[0]
        if missing > 0:
            self.accepted = torch.cat([self.accepted, torch.zeros(missing, dtype=torch.float64)])
            self.predicted = torch.cat([self.predicted, torch.zeros(missing, dtype=torch.float64)])
