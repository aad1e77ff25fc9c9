"""TreeGrowth: a batch's draft trees, grown depth by depth from a model-based drafter's logits.

Every candidate node has a score: the log of the product of the drafter's probabilities
along its branch, a guess at the chance that the target accepts the whole branch. Those
probabilities are the drafter's softmax at the request's temperature (a sampled child is
accepted with the target's probability of it: verify.py), and for a greedy request at
GREEDY_TREE_TEMPERATURE: a greedy target accepts the drafter's likeliest token far more often
than the drafter's plain probability of it says (a drafter trained on the target's soft
labels spreads its mass as the target does, while the target's argmax mostly is the
drafter's). On the shipped pair the sharpened probabilities grew trees that emit more tokens
per round than the plain softmax's (docs/runner.md, "Draft trees"). Growth, for a node budget N:
  start     the root's children: the likeliest tokens of the drafter's next-token logits
  expand    of the deepest candidates, those that could still be among the N likeliest
            nodes (a child never scores above its parent, so a node below the N-th best
            score so far cannot have a descendant among them either), the likeliest few (the
            shape's width) are fed to the drafter together, one forward for the depth, each
            attending to its own branch; their logits give their children
  finish    the N likeliest candidates form the tree (a parent always scores at least its
            child and comes first among equals, so every chosen node's parent is chosen)
A row's nodes never run deeper than its max_depth (the engine's: what it can still emit). A
request's logits processors (penalties, a grammar: spec/processors.py) process the drafter's logits
after each node as the target's are after it, so that no child is one the target cannot take.

The drafter feeds the expanded nodes in order into its own cache, from a position it chooses
(tree_start): expanded node f is written at tree_start + f, which `visible` describes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters.base import Draft
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.tree import ROOT, TreeShape


@dataclass
class Frontier:
    """The nodes one drafting forward feeds, W per row.

    candidates [B, W]   their candidate numbers (invalid entries: any, with valid False)
    tokens [B, W]       their tokens (0 where invalid)
    depth               their depth (all the same)
    parent_fed [B, W]   each one's parent's expanded-node number (-1: the root)
    fed [B, W]          their own expanded-node numbers: written at tree_start + fed
    visible [B, W, F]   which expanded nodes 0..F-1 each attends to (its branch)
    valid [B, W]        False: padding (a row with fewer nodes worth expanding)
    """

    candidates: torch.Tensor
    tokens: torch.Tensor
    depth: int
    parent_fed: torch.Tensor
    fed: torch.Tensor
    visible: torch.Tensor
    valid: torch.Tensor


GREEDY_TREE_TEMPERATURE = 0.25


class TreeGrowth:
    def __init__(
        self,
        batch: list[Sequence],
        shape: TreeShape,
        budget: int,
        max_depths: list[int],
        sampling: SamplingTensors,
        device: torch.device,
    ):
        self.shape, self.budget, self.device = shape, budget, device
        self.batch, self.processors = batch, sampling.processors
        B = len(batch)
        self.temperature = torch.where(sampling.greedy, GREEDY_TREE_TEMPERATURE, sampling.temperature).to(
            device
        )  # [B]: of the scores
        self.rooms = torch.tensor(max_depths, device=device)  # [B]: the deepest allowed
        self.max_depth = min(shape.max_depth(budget), max(max_depths))
        # candidates, as columns, depth by depth
        self.tokens = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, M]
        self.parents = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, M]: candidate numbers, ROOT
        self.scores = torch.zeros(B, 0, device=device)  # [B, M]: log-probabilities; -inf = none
        self.fed_of = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, M]: expanded-node number, -1
        self.level_start, self.depth = 0, 0  # the deepest candidates' first column, and their depth
        self.branch = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)  # [B, F, F]: expanded nodes' branches

    def start(self, logits: torch.Tensor) -> None:
        """The root's children from the drafter's next-token logits [B, V]."""
        B = logits.shape[0]
        root = torch.full((B, 1), ROOT, dtype=torch.long, device=self.device)  # [B, 1]
        self._add_children(logits[:, None], root, torch.zeros(B, 1, device=self.device))

    def frontier(self) -> Frontier | None:
        """The next nodes to expand, or None when growth is over."""
        if self.depth == 0 or self.depth >= self.max_depth:
            return None
        B, M = self.scores.shape
        level_scores = self.scores[:, self.level_start :]  # [B, C]
        expandable = level_scores >= self._nth_best_score()[:, None]  # [B, C]
        width = min(self.shape.nodes_to_expand(level_scores.shape[1]), self.budget)
        ranked, order = torch.where(expandable, level_scores, float("-inf")).topk(width, dim=1)  # [B, W]
        valid = ranked > float("-inf")  # [B, W]
        if not bool(valid.any()):
            return None
        candidates = self.level_start + order  # [B, W]
        parent_candidates = self.parents.gather(1, candidates)  # [B, W]
        parent_fed = torch.where(
            parent_candidates == ROOT, -1, self.fed_of.gather(1, parent_candidates.clamp(min=0))
        )  # [B, W]
        F = self.branch.shape[1]
        fed = F + torch.arange(width, device=self.device).expand(B, width)  # [B, W]
        self.fed_of = self.fed_of.scatter(1, candidates, torch.where(valid, fed, -1))
        self._extend_branches(parent_fed)
        tokens = torch.where(valid, self.tokens.gather(1, candidates), 0)
        return Frontier(candidates, tokens, self.depth, parent_fed, fed, self.branch[:, F:], valid)

    def grow(self, frontier: Frontier, logits: torch.Tensor) -> None:
        """The frontier's children from the drafter's logits after each of its nodes [B, W, V]."""
        parent_scores = torch.where(frontier.valid, self.scores.gather(1, frontier.candidates), float("-inf"))
        self._add_children(logits, frontier.candidates, parent_scores)

    def draft(self) -> Draft:
        """The budget's likeliest nodes as a tree draft (tree.py's numbering), padded to budget
        columns."""
        B, M = self.scores.shape
        candidates = Draft(
            self.tokens, torch.full((B,), M, device=self.device), parents=self.parents, scores=self.scores
        )
        chosen = candidates.likeliest(min(self.budget, M))  # [B, N]: a parent before its child
        assert chosen.parents is not None and chosen.scores is not None  # a ranked tree's cut
        padded = self.budget - chosen.token_ids.shape[1]
        token_ids = torch.nn.functional.pad(chosen.token_ids, (0, padded))  # [B, budget]
        parents = torch.nn.functional.pad(chosen.parents, (0, padded), value=ROOT)  # [B, budget]
        scores = torch.nn.functional.pad(chosen.scores, (0, padded), value=float("-inf"))  # [B, budget]
        return Draft(token_ids, chosen.num_tokens, parents=parents, scores=scores)

    def _add_children(self, logits: torch.Tensor, parents: torch.Tensor, parent_scores: torch.Tensor) -> None:
        """Each parent's likeliest children: logits [B, W, V], parents [B, W] (candidate numbers),
        parent_scores [B, W] (-inf: no children)."""
        B, W, _ = logits.shape
        depth = self.depth + 1
        if self.processors is not None:  # after each parent's branch, as the target's logits there
            logits = self.processors(logits, self.batch, self.tokens, self._on_branch(parents))
        top_logprobs, top_tokens = torch.log_softmax(logits.float() / self.temperature[:, None, None], dim=-1).topk(
            self.shape.children_per_node(self.depth), dim=-1
        )  # [B, W, b]
        scores = parent_scores[:, :, None] + top_logprobs  # [B, W, b]
        scores = torch.where((depth <= self.rooms)[:, None, None], scores, float("-inf"))
        b = scores.shape[-1]
        self.level_start, self.depth = self.scores.shape[1], depth
        self.tokens = torch.cat([self.tokens, top_tokens.reshape(B, W * b)], dim=1)
        self.parents = torch.cat([self.parents, parents[:, :, None].expand(B, W, b).reshape(B, W * b)], dim=1)
        self.scores = torch.cat([self.scores, scores.reshape(B, W * b)], dim=1)
        self.fed_of = torch.cat([self.fed_of, self.fed_of.new_full((B, W * b), -1)], dim=1)

    def _on_branch(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, W, M] bool: the candidates on each node's branch, itself included (nodes [B, W]:
        candidate numbers, ROOT for the root, whose branch is empty)."""
        B, W = nodes.shape
        M = self.tokens.shape[1]
        on_branch = torch.zeros(B, W, M, dtype=torch.bool, device=self.device)
        while M and bool((nodes >= 0).any()):
            on_branch |= torch.nn.functional.one_hot(nodes.clamp(min=0), M).bool() & (nodes >= 0)[:, :, None]
            nodes = torch.where(nodes >= 0, self.parents.gather(1, nodes.clamp(min=0)), ROOT)
        return on_branch

    def _nth_best_score(self) -> torch.Tensor:
        """Each row's budget-th best candidate score [B] (-inf while it has fewer)."""
        M = self.scores.shape[1]
        if M < self.budget:
            return self.scores.new_full((self.scores.shape[0],), float("-inf"))
        return self.scores.topk(self.budget, dim=1).values[:, -1]

    def _extend_branches(self, parent_fed: torch.Tensor) -> None:
        """Add W expanded nodes, children of parent_fed [B, W] (-1: the root), to the branches."""
        B, W = parent_fed.shape
        F = self.branch.shape[1]
        branch = torch.zeros(B, F + W, F + W, dtype=torch.bool, device=self.device)  # [B, F+W, F+W]
        if F:
            branch[:, :F, :F] = self.branch
            rows = torch.arange(B, device=self.device)[:, None]  # [B, 1]
            branch[:, F:, :F] = self.branch[rows, parent_fed.clamp(min=0)] & (parent_fed >= 0)[:, :, None]  # [B, W, F]
        branch[:, F:, F:] = torch.eye(W, dtype=torch.bool, device=self.device)
        self.branch = branch
