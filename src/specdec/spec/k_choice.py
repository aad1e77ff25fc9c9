"""Each row's k for a round, and what a round may write past a sequence's end.

k (num_speculative_tokens) is the most a round drafts for one row. Each round, each row gets:
  goodput   the goodput policy's choice (goodput.py: the plan of the most expected tokens per
            second from each sequence's acceptance rate and the measured costs; 0 = plain)
  fixed     k, cut to the row's room (what it can still emit: a larger k is drafted and
            verified for nothing)
  tree      a tree of up to k nodes wherever there is room, its depth cut to the row's k: under
            fixed, the room; under goodput, the policy's choice for the row as for a chain (the
            draft steps a round pays are the tree's depths), and each round verifies only the
            likeliest nodes the verify's measured cost buys (tree_width.py)
A round with a seeded sampled request keeps the fixed k: its tokens depend on its rounds' k,
which goodput takes from timings, and a seed must give the same tokens every run.
"""

from __future__ import annotations

from specdec.drafters.base import Drafter, RowOutlook
from specdec.sequence import Sequence
from specdec.spec.goodput import GoodputPolicy, padded_width
from specdec.spec.round import RoundResult
from specdec.spec.tree_width import TreeWidth
from specdec.tree import TreeShape


class KChoice:
    """k: num_speculative_tokens (0: plain decoding). tree: a tree shape (tree.py) other than
    "chain": every round drafts a tree of up to k nodes, from a drafter that grows trees, each
    row's no deeper than its k of the round; with k_policy "goodput" the policy chooses that
    depth and tree_width cuts each tree to what the verify's costs buy, with "fixed" the whole
    tree, as deep as the room, is verified. k_policy: "goodput" or "fixed".
    cost_width(rows, tokens, longest): the tokens per row a target forward costs as
    (ModelRunner.cost_width; goodput.py)."""

    def __init__(
        self,
        k: int,
        k_policy: str,
        tree: TreeShape | None,
        drafter_grows_trees: bool,
        cost_width=padded_width,
    ):
        self.k = k
        self.tree = tree if tree is not None and not tree.is_chain and k else None
        if self.tree is not None and not drafter_grows_trees:
            raise ValueError(
                f"speculative_tree={str(tree)!r} needs a drafter that grows trees (a draft model, an "
                "EAGLE head or early exit); this drafter drafts chains only: use "
                "speculative_tree='chain'"
            )
        use_goodput = k > 0 and k_policy == "goodput"
        self.policy = GoodputPolicy(k, cost_width) if use_goodput else None
        # a tree's depth by the policy, its width by its verify's cost (a grown tree's, or the tree
        # a drafter of chains proposes where its text branches: suffix decoding's)
        self.tree_width = TreeWidth(self.policy) if self.policy is not None else None
        self.outlooks: list[RowOutlook] | None = None  # the last round goodput chose for: who drafted each row

    def round_ks(self, batch: list[Sequence], drafter: Drafter | None = None) -> list[int]:
        """Each row's k this round (at most its room; a tree's depth). Under goodput, where
        drafter is made of several, goodput also picks who drafts each row among those drafter
        offers (Drafter.outlook), and tells it (Drafter.assign)."""
        rooms = [s.draft_room for s in batch]
        self.outlooks = None
        if self.policy is None or any(s.params.seed is not None and not s.params.greedy for s in batch):
            k = self.usable_k(batch)
            return [min(k, room) for room in rooms]
        slots = [s.slot for s in batch]
        options = drafter.outlook(batch, self.usable_k(batch)) if drafter is not None else None
        if options is not None and drafter is not None:
            self.outlooks = self.policy.pick(slots, rooms, options)
            drafter.assign(batch, self.outlooks)
        return self.policy.choose(slots, rooms, self.outlooks)

    def usable_k(self, seqs: list[Sequence]) -> int:
        """No wider than the most drafts any row has room for."""
        return min(self.k, max(s.draft_room for s in seqs))

    def sizing_k(self, seqs: list[Sequence]) -> int:
        """The k to size caches and forwards for, for these requests (a tree's nodes are not
        cut to the room)."""
        return self.k if self.tree is not None else self.usable_k(seqs)

    def margin(self, k: int) -> int:
        """Positions past a sequence's last token that a round may write: verify runs k past it,
        and a drafter growing a tree writes the nodes it expands."""
        return max(k, self.tree.max_expanded(k)) if self.tree is not None else k

    def positions_needed(self, seq: Sequence) -> int:
        """Cache positions seq needs (the last one is kept free for padding: kv_cache.ragged_batch)."""
        return seq.num_tokens + seq.params.max_tokens + self.margin(self.sizing_k([seq])) + 1

    def check_fits(self, seq: Sequence, max_len: int | None) -> None:
        """A ValueError unless seq's positions_needed fit max_len positions (None: not sized yet)."""
        needed = self.positions_needed(seq)
        if max_len is not None and needed > max_len:
            raise ValueError(
                f"a prompt of {len(seq.prompt_token_ids)} tokens + max_tokens={seq.params.max_tokens} needs "
                f"{needed} cache positions, and the engine was prepared for {max_len}; shorten the prompt "
                "or lower max_tokens"
            )

    def room(self, seq: Sequence, max_len: int) -> int:
        """The positions seq holds blocks for before a forward: its tokens, what a round writes
        past them, and the one after (kv_cache.ragged_batch's padding), within max_len."""
        return min(seq.num_tokens + self.margin(self.k) + 1, max_len)

    def query_lengths(self) -> tuple[int, ...]:
        """The target forwards' lengths a round runs (compiled for): a fixed k verifies k drafts
        every round (fewer are padded), goodput may choose k = 0, a tree's forwards run eagerly
        and only rows without room run compiled (plain steps)."""
        if self.tree is not None:
            return (1,)
        return (1, self.k + 1) if self.policy is not None else (self.k + 1,)

    def start(self, seq: Sequence) -> None:
        """A sequence begins (after its prefill): its acceptance estimate starts from the prior."""
        if self.policy is not None:
            self.policy.start(seq.slot)

    def observe(self, batch: list[Sequence], result: RoundResult) -> None:
        """What a round of batch accepted and cost, for the policy's estimates."""
        if self.policy is None:
            return
        sources = [o.source for o in self.outlooks] if self.outlooks is not None else None
        # a tree proposes its depth's positions, as a chain of that length would (metrics.py)
        proposed = [n if depth is None else depth for n, depth in zip(result.num_proposed, result.tree_depths)]
        self.policy.observe([s.slot for s in batch], proposed, result.num_accepted, sources)
        # a round where a free drafter drafted some rows says little of the paying drafter's cost
        free_drafted = self.outlooks is not None and any(o.free for o in self.outlooks)
        self.policy.observe_round(
            len(batch),
            max(k or 0 for k in result.ks),  # a round's ks are ints (None is a prefill's)
            result.verify_tokens,
            target_seconds=result.seconds["target"] + result.seconds["sampling"],
            draft_seconds=result.seconds["draft"] if result.all_rows_drafted and not free_drafted else None,
            num_verified=result.num_verified,
        )
