"""Token trees: a draft of several candidate continuations that share their prefixes.

Terms:
  node      one candidate token. A round's tree has N nodes (the node budget,
            num_speculative_tokens) numbered 0..N-1, each after its parent: parents [B, N]
            holds each node's parent's number, or ROOT for a child of the sequence's last token.
            A parent's number is always smaller than its children's (topological order).
  root      the sequence's last token, which every verify forward feeds first: column 0 of
            the verify forward, node i being column i + 1.
  depth     how many nodes lie on the way from the root to a node, itself included (the root's
            is 0): node tokens sit at position (last token's position) + depth.
  branch    a node's ancestors and itself: what its token attends to besides the sequence.
  shape     how a drafter grows a tree (TreeShape): "chain" (one token after another, the
            plain draft), "b1,b2,...": every node at depth d gets the b_d likeliest children
            (then the N likeliest nodes of all are kept), or "auto": EAGLE-2's dynamic tree,
            which at every depth expands only the AUTO_WIDTH likeliest nodes (of those that
            could still make the N likeliest), AUTO_BRANCHING children each, and keeps the N
            likeliest nodes. Likely = the product of the drafter's probabilities along the branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = -1  # parent number of the root's children
AUTO_WIDTH = 4  # "auto": nodes expanded per depth
AUTO_BRANCHING = 4  # "auto": children drafted per expanded node
MAX_BRANCHING = 64


@dataclass(frozen=True)
class TreeShape:
    """kind: "chain", "auto" or "static" (branching gives each depth's children per node)."""

    kind: str
    branching: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """ "chain", "auto", or branching factors "b1,b2,..." (each 1..MAX_BRANCHING)."""
        if not isinstance(text, str):
            raise ValueError(
                f"speculative_tree must be a string: 'chain', 'auto' or branching factors like '3,2,1'; got {text!r}"
            )
        if text in ("chain", "auto"):
            return cls(text)
        parts = [part.strip() for part in text.split(",")]
        if not all(part.isdigit() and 1 <= int(part) <= MAX_BRANCHING for part in parts):
            raise ValueError(
                f"speculative_tree must be 'chain', 'auto', or branching factors per depth, each 1 to "
                f"{MAX_BRANCHING}, like '3,2,1' (3 children of the last token, 2 of each of those, "
                f"...); got {text!r}"
            )
        return cls("static", tuple(int(part) for part in parts))

    @property
    def is_chain(self) -> bool:
        return self.kind == "chain"

    def max_depth(self, budget: int) -> int:
        """How deep a tree of budget nodes may grow."""
        return budget if self.kind == "auto" else min(budget, len(self.branching))

    def children_per_node(self, depth: int) -> int:
        """How many children a node at depth (0 = the root) gets."""
        return AUTO_BRANCHING if self.kind == "auto" else self.branching[depth]

    def nodes_to_expand(self, num_candidates: int) -> int:
        """How many of a depth's candidates are expanded."""
        return min(num_candidates, AUTO_WIDTH) if self.kind == "auto" else num_candidates

    def max_expanded(self, budget: int) -> int:
        """The most nodes a drafter feeds while growing a tree of budget nodes: at most budget at
        each depth but the last (tree_growth.py)."""
        width = AUTO_WIDTH if self.kind == "auto" else budget
        return max(0, self.max_depth(budget) - 1) * min(width, budget)

    def __str__(self) -> str:
        return self.kind if self.kind != "static" else ",".join(map(str, self.branching))


def branches(parents: torch.Tensor) -> torch.Tensor:
    """Which verify columns each column's token attends to: parents [B, N] -> [B, N+1, N+1]
    bool, entry [b, i, j] True where column j is column i or one of its ancestors (column 0,
    the root, is everyone's)."""
    B, N = parents.shape
    visible = torch.eye(N + 1, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)  # [B, N+1, N+1]
    visible[:, :, 0] = True
    rows = torch.arange(B, device=parents.device)
    for node in range(N):  # parents first: a node's branch is its parent's and itself
        visible[:, node + 1] |= visible[rows, parents[:, node] + 1]
    return visible


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Each verify column's depth [B, N+1] (the root's 0)."""
    return branches(parents).sum(-1) - 1


def likeliest_nodes(
    parents: torch.Tensor, scores: torch.Tensor, num_nodes: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's n likeliest nodes, as a tree of their own.

    parents [B, N], scores [B, N] (each node's branch score: a child never scores above its
    parent; -inf: not a node), num_nodes [B] (a row's nodes past it are padding). The n best
    scores are kept, a parent before its child among equal scores (its number is smaller), so
    every kept node's parent is kept. Returns (kept [B, n]: the kept nodes' numbers in parents,
    ascending, 0 past a row's count; parents [B, n] renumbered among the kept, ROOT past the
    count; num_nodes [B])."""
    B, N = parents.shape
    n = min(n, N)
    columns = torch.arange(N, device=parents.device)
    valid = columns[None, :] < num_nodes[:, None]  # [B, N]
    ranked_scores, ranked = torch.where(valid, scores, float("-inf")).sort(dim=1, descending=True, stable=True)
    is_kept = ranked_scores[:, :n] > float("-inf")  # [B, n]: a prefix of each row
    kept_count = is_kept.sum(1)  # [B]
    kept = torch.where(is_kept, ranked[:, :n], N).sort(dim=1).values  # [B, n]: ascending, padding (N) last
    new_number = torch.full((B, N + 1), ROOT, dtype=torch.long, device=parents.device)  # [B, N+1]: last = ROOT's
    new_number.scatter_(1, kept, torch.arange(n, device=parents.device).expand(B, n))
    new_number[:, N] = ROOT
    kept = torch.where(is_kept, kept, 0)
    old_parents = parents.gather(1, kept)  # [B, n]
    new_parents = new_number.gather(1, torch.where(old_parents == ROOT, N, old_parents))  # [B, n]
    return kept, torch.where(is_kept, new_parents, ROOT), kept_count
