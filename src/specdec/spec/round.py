"""One speculative round over a batch of running sequences, and the prefill that starts them.

A round, for every row at once (each with its own k this round, from k_choice.py):
  propose   the drafter drafts up to k tokens per row (or, with a tree shape, a tree of up to
            k nodes: tree.py, cut to the width its verify buys: tree_width.py)
  verify    one target forward over [last token, drafts] gives the target's distribution at
            every draft position and one past it; rejection sampling (verify.py) keeps a prefix
            (of a tree: a branch, whose K/V entries are then moved into the sequence's next
            positions) and adds one token (recovered or bonus)
  observe   the drafter learns what was accepted (and, for a head, the target's features)
The result is each row's new tokens with their counts and logprobs (RoundResult); appending
them (stop conditions inside an accepted run) is the engine's.

Invariant between rounds: the target's cache holds K/V for every token of a sequence but
the last, which is fed first in the next round's verify forward.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.kv_cache import TreeAttention
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import SamplingTensors, sample, token_logprobs, warp
from specdec.sequence import Sequence
from specdec.spec.processors import LogitsProcessors, chain_branches
from specdec.spec.tree_width import TreeWidth
from specdec.spec.verify import greedy_tree_verify, greedy_verify, rejection_sample, tree_rejection_sample
from specdec.tree import TreeShape, branches
from specdec.worker import ForwardBatch, ModelRunner


@dataclass(frozen=True)
class RoundResult:
    """What a round (or a prefill) gives each row of its batch.

    tokens[i]         row i's new tokens: its accepted drafts, then one recovered or bonus token
    num_proposed[i]   draft tokens row i's drafter proposed (0 in a prefill or a plain round)
    num_accepted[i]   of those, accepted
    num_forced[i]     tokens row i's grammar forced ahead of them, accepted (jump-forward:
                      _jump_forward); its tokens begin with these, then the accepted drafts
    ks[i]             the k row i was given (None: a prefill)
    tree_depths[i]    the depth of row i's tree (None for a chain)
    logprobs[i]       a TokenLogprob per new token where the request asks for logprobs, else None
    verify_tokens     the verify forward's tokens per row (k + 1, its longest row's)
    num_verified      its real tokens in all (each row's last and its drafts; None: every row's)
    all_rows_drafted  whether every row drafted (else the draft's time says little of a batch's)
    seconds           where the round's time went: {"draft", "target", "sampling", "bookkeeping"}
                      ({"prefill"} for a prefill)
    """

    tokens: list[list[int]]
    num_proposed: list[int]
    num_accepted: list[int]
    ks: collections.abc.Sequence[int | None]
    tree_depths: collections.abc.Sequence[int | None]
    logprobs: list[list | None]
    verify_tokens: int = 1
    num_verified: int | None = None
    all_rows_drafted: bool = False
    num_forced: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


class SpeculativeRound:
    """The round's parts over one target runner and drafter (None: plain decoding). tree: the
    shape of every round's draft, or None for chains; tree_nodes: a tree's node budget;
    tree_width: what cuts a grown tree to the width its verify buys (None: every node is
    verified); eos_token_ids: the model's end-of-sequence tokens, which a request's min_tokens
    holds back; tokenizer: what encodes a request's bad words. The requests' logits processors
    (processors.py) are applied to the target's logits wherever it samples."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        tree: TreeShape | None,
        tree_nodes: int = 0,
        tree_width: TreeWidth | None = None,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Tokenizer | None = None,
    ):
        self.target, self.drafter, self.tree, self.tree_width = target, drafter, tree, tree_width
        self.processors = LogitsProcessors(eos_token_ids, tokenizer, target.config.vocab_size)
        self.tree_nodes = tree_nodes
        self.return_hidden = drafter is not None and drafter.needs_target_hidden  # the target's features too
        self._sampling_key: tuple | None = None
        self._sampling: SamplingTensors | None = None

    def forget_batches(self) -> None:
        """Earlier requests may share ids with the next ones: rebuild the sampling tensors."""
        self._sampling_key = None

    def prefill(self, batch: list[Sequence], chunk_lengths: list[int]) -> RoundResult:
        """One target forward over the next chunk_lengths[i] of each row's prefill_token_ids (a new
        sequence's prompt; a recomputed one's tokens but the last) after its num_prefilled, which
        it advances. A row whose prefill this finishes is done (num_prefilled None), and a new one
        samples its first token; a recomputed one samples nothing (the next round feeds its last
        token, as it would have: its generator's draws stay in step). Rows left part-way get no
        token either: the result's tokens[i] is [] for them."""
        start = time.perf_counter()
        starts = [s.num_written for s in batch]  # every row is prefilling: its num_prefilled
        chunks = [s.prefill_token_ids[first : first + n] for s, first, n in zip(batch, starts, chunk_lengths)]
        logits = self._feed_keeping_prompt_logprobs(batch, chunks, starts)  # [B, V]
        done = []
        for seq, first, chunk in zip(batch, starts, chunks):
            seq.num_prefilled = first + len(chunk)
            if seq.num_prefilled == len(seq.prefill_token_ids):
                seq.num_prefilled = None
                done.append(not seq.output_token_ids)  # a new sequence's: its first token is due
            else:
                done.append(False)
        rows = [row for row, due in enumerate(done) if due]
        first_tokens: dict[int, int] = {}
        logprobs: list[list | None] = [None] * len(batch)
        if rows:
            due_logits = logits[torch.tensor(rows, device=logits.device)]  # [R, V]
            sampled = [batch[row] for row in rows]
            processed = self.processors(due_logits[:, None], sampled)[:, 0]  # [R, V]
            probs = warp(processed, SamplingTensors.from_params([s.params for s in sampled], self.target.device))
            tokens = sample(probs, [s.generator for s in sampled])  # [R]
            first_tokens = dict(zip(rows, tokens.tolist()))
            row_logprobs = _logprobs(sampled, due_logits[:, None], tokens[:, None], torch.ones_like(tokens))
            for row, entry in zip(rows, row_logprobs):
                logprobs[row] = entry
        zeros, nones = [0] * len(batch), [None] * len(batch)
        return RoundResult(
            [[first_tokens[row]] if row in first_tokens else [] for row in range(len(batch))],
            zeros,
            zeros,
            nones,
            nones,
            logprobs,
            seconds={"prefill": time.perf_counter() - start},
        )

    def _feed_keeping_prompt_logprobs(
        self, batch: list[Sequence], chunks: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        """_feed, where the rows of new sequences asking for their prompt's logprobs are fed on
        their own with the logits at every position, and the logprobs of the prompt tokens
        those predict kept in the sequences (rows fed apart give what they would together: the
        target's rows are independent). -> [B, V]."""
        asking = [
            row for row, seq in enumerate(batch) if seq.params.prompt_logprobs is not None and not seq.output_token_ids
        ]
        if not asking:
            return self._feed(batch, chunks, starts)
        rows = [batch[r] for r in asking]
        forward, last_index = self.target.ragged_batch(
            [chunks[r] for r in asking], [starts[r] for r in asking], [s.slot for s in rows]
        )
        outputs = self.target.forward(forward, return_hidden=self.return_hidden)  # [A, W, V] (, hidden [A, W, H])
        every, hidden = outputs if isinstance(outputs, tuple) else (outputs, None)
        if hidden is not None:
            assert self.drafter is not None
            first_positions = torch.tensor([starts[r] for r in asking], device=hidden.device)  # [A]
            self.drafter.observe_hidden(rows, first_positions, hidden, (last_index + 1).to(hidden.device))
        logits = every.new_empty(len(batch), every.shape[-1])  # [B, V]
        logits[asking] = every[torch.arange(len(rows), device=every.device), last_index.to(every.device)]  # [A, V]
        others = [row for row in range(len(batch)) if row not in asking]
        if others:
            logits[others] = self._feed(
                [batch[r] for r in others], [chunks[r] for r in others], [starts[r] for r in others]
            )
        for seq, row, start, chunk in zip(rows, every, (starts[r] for r in asking), (chunks[r] for r in asking)):
            _keep_prompt_logprobs(seq, start, len(chunk), row)
        return logits

    def _feed(self, batch: list[Sequence], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """The target's forward over each row's chunk from its start (the drafter given the
        target's features there where it reads them): the logits after each chunk's last token
        [B, V]."""
        device = self.target.device
        logits = self.target.feed(
            chunks, starts, [s.slot for s in batch], return_hidden=self.return_hidden
        )  # [B, V] (, hidden [B, T, H])
        if isinstance(logits, tuple):  # return_hidden: the drafter reads the target's features
            logits, hidden = logits
            chunk_lengths = torch.tensor([len(chunk) for chunk in chunks], device=device)  # [B]
            assert self.drafter is not None
            self.drafter.observe_hidden(batch, torch.tensor(starts, device=device), hidden, chunk_lengths)
        return logits

    def run(self, batch: list[Sequence], ks: list[int]) -> RoundResult:
        """A round over batch, row i drafting at most ks[i] tokens (a tree of tree_nodes nodes at
        most, ks[i] deep at most)."""
        sampling = self._sampling_tensors(batch)
        t0 = time.perf_counter()
        draft, all_rows_drafted = self._propose(batch, ks, sampling)
        if draft.is_tree and self.tree_width is not None:
            draft = self.tree_width.cut(draft, batch)
        draft = self._grammatical(draft, batch)
        draft, verify_ks, forced = self._jump_forward(draft, batch, ks)
        t1 = time.perf_counter()
        if draft.is_tree:
            num_draft = draft.num_tokens  # [B]
        else:  # each row cut to its k; the verify forward as wide as the longest proposal (0: a plain step)
            num_draft = torch.minimum(draft.num_tokens, torch.tensor(verify_ks, device=draft.num_tokens.device))  # [B]
            draft = draft.narrowed(int(num_draft.max()))
        input_ids, positions, tree = self._verify_inputs(batch, draft)  # [B, k+1] each, and a tree's layout
        slots = [s.slot for s in batch]
        lengths = (num_draft + 1).tolist()  # each row's real tokens: its last token and its drafts
        outputs = self.target(
            ForwardBatch.of(input_ids, positions, slots, tree, lengths), return_hidden=self.return_hidden
        )  # [B, k+1, V] (return_hidden: and [B, k+1, H]; zero past a row's own tokens, or what they say)
        target_logits, target_hidden = outputs if isinstance(outputs, tuple) else (outputs, None)
        t2 = time.perf_counter()
        processed = self.processors(target_logits, batch, draft.token_ids, _on_branch(draft, tree))  # [B, k+1, V]
        output, num_accepted, path = self._verify(batch, sampling, draft, num_draft, processed)
        if path is not None:  # the accepted branch's entries into place, its features in order
            assert tree is not None  # a tree's draft
            self._keep_branch(slots, tree.write_positions, path, num_accepted)
            if target_hidden is not None:
                target_hidden = target_hidden.gather(1, path[:, :, None].expand(-1, -1, target_hidden.shape[-1]))
        t3 = time.perf_counter()
        if draft.is_tree and self.tree_width is not None:  # each node at the root's position + its depth
            self.tree_width.observe(draft, positions[:, 1:] - positions[:, :1], num_accepted)
        if self.drafter is not None:
            self.drafter.observe(batch, num_accepted)
        if target_hidden is not None:
            assert self.drafter is not None  # return_hidden is a drafter's need
            self.drafter.observe_hidden(batch, positions[:, 0], target_hidden, num_accepted + 1)
        num_accepted_list = num_accepted.tolist()
        tokens = [output[row, : n + 1].tolist() for row, n in enumerate(num_accepted_list)]
        depths = _tree_depths(positions, num_draft).tolist() if draft.is_tree else [None] * len(batch)
        logprobs = _logprobs(batch, target_logits, output, num_accepted + 1, path)
        forced_accepted = [min(f, n) for f, n in zip(forced, num_accepted_list)]
        return RoundResult(
            tokens,
            [n - f for n, f in zip(num_draft.tolist(), forced)],
            [n - f for n, f in zip(num_accepted_list, forced_accepted)],
            ks,
            depths,
            logprobs,
            verify_tokens=input_ids.shape[1],
            num_verified=sum(lengths),
            all_rows_drafted=all_rows_drafted,
            num_forced=forced_accepted,
            seconds={"draft": t1 - t0, "target": t2 - t1, "sampling": t3 - t2, "bookkeeping": time.perf_counter() - t3},
        )

    def _propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> tuple[Draft, bool]:
        """The drafter's tokens for the rows with k > 0 (up to the largest k); the rest propose
        nothing. Also whether every row drafted."""
        device = self.target.device
        rows = [row for row, k in enumerate(ks) if k > 0]
        if not rows:
            return Draft.empty(len(batch), device), False
        if len(rows) == len(batch):
            return self._draft(batch, ks, sampling), True
        index = torch.tensor(rows, device=device)  # [R]
        drafted = self._draft([batch[row] for row in rows], [ks[row] for row in rows], sampling.select_rows(index))
        return drafted.scattered(len(batch), index), False

    def _draft(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        assert self.drafter is not None  # a row has k > 0
        if self.tree is not None:  # every drafting row grows a tree, no deeper than its k (at most its room)
            return self.drafter.propose_tree(batch, self.tree_nodes, self.tree, ks, sampling)
        return self.drafter.propose(batch, ks, sampling)

    def _grammatical(self, draft: Draft, batch: list[Sequence]) -> Draft:
        """draft with each chain cut before the first token its request's grammar forbids (the
        masked target would reject it: it only widens the verify). A tree is kept whole: a
        forbidden node is rejected in it."""
        rows = [row for row, seq in enumerate(batch) if seq.params.structured_outputs is not None]
        if not rows or draft.is_tree:
            return draft
        num_tokens = draft.num_tokens.clone()  # [B]
        for row in rows:
            proposed = draft.token_ids[row, : int(num_tokens[row])].tolist()
            num_tokens[row] = self.processors.num_allowed(batch[row], proposed)
        return dataclasses.replace(draft, num_tokens=num_tokens)

    def _jump_forward(self, draft: Draft, batch: list[Sequence], ks: list[int]) -> tuple[Draft, list[int], list[int]]:
        """Where a row's grammar forces its next tokens (the bytes it allows next are fixed:
        llguidance's fast-forward tokens, in the tokenizer's own tokenization), they lead the row's
        chain: as drafts they are verified, so the output stays the masked target's own (it takes
        another tokenization of the same bytes where it prefers one), and a forced run costs no
        drafter step. A drafter's chain that begins with them is kept, any other replaced; at most
        the engine's k of them (the cache's room past a sequence) and what the row may still emit
        less one. Returns the draft, ks raised to cover them, and each row's forced count."""
        forced = [0] * len(batch)
        if draft.is_tree or self.tree_nodes == 0:  # trees, and an engine without drafts (no room kept)
            return draft, ks, forced
        runs = {
            row: run[: min(self.tree_nodes, seq.remaining_tokens - 1)]
            for row, seq in enumerate(batch)
            if seq.grammar is not None and (run := self.processors.forced_tokens(seq))
        }
        runs = {row: run for row, run in runs.items() if run}
        if not runs:
            return draft, ks, forced
        width = max(draft.token_ids.shape[1], *(len(run) for run in runs.values()))
        pad = width - draft.token_ids.shape[1]
        token_ids = torch.nn.functional.pad(draft.token_ids, (0, pad))  # [B, width]
        probs = (
            torch.nn.functional.pad(draft.probs, (0, 0, 0, pad)) if draft.probs is not None else None
        )  # [B, width, V]
        num_tokens, ks = draft.num_tokens.clone(), list(ks)
        for row, run in runs.items():
            if token_ids[row, : int(num_tokens[row])].tolist()[: len(run)] != run:
                token_ids[row, : len(run)] = torch.tensor(run, device=token_ids.device)
                num_tokens[row] = len(run)
                if probs is not None:  # point masses: what the forced tokens are drawn from
                    probs[row, : len(run)] = torch.nn.functional.one_hot(token_ids[row, : len(run)], probs.shape[-1])
            ks[row] = max(ks[row], int(num_tokens[row]))
            forced[row] = len(run)
        return Draft(token_ids, num_tokens, probs), ks, forced

    def _verify_inputs(
        self, batch: list[Sequence], draft: Draft
    ) -> tuple[torch.Tensor, torch.Tensor, TreeAttention | None]:
        """[last token, d_1..d_k] at positions [L-1 .. L-1+k] per row: [B, k+1] each. For a tree,
        its nodes sit at L-1 + their depth, and its layout: column t (the root, then node t-1)
        is written at L-1 + t and reads the sequence before L-1 and its own branch."""
        device = self.target.device
        last_tokens = torch.tensor([s.last_token_id for s in batch], device=device)[:, None]  # [B, 1]
        input_ids = torch.cat([last_tokens, draft.token_ids], dim=1)  # [B, k+1]
        first_positions = torch.tensor([s.num_tokens - 1 for s in batch], device=device)  # [B]
        columns = torch.arange(input_ids.shape[1], device=device)  # [k+1]
        if draft.parents is None:  # a chain
            return input_ids, first_positions[:, None] + columns, None
        visible = branches(draft.parents)  # [B, k+1, k+1]
        depth = visible.sum(-1) - 1  # [B, k+1]: ancestors, the root included
        tree = TreeAttention(first_positions[:, None] + columns, first_positions, visible)
        return input_ids, first_positions[:, None] + depth, tree

    def _verify(
        self,
        batch: list[Sequence],
        sampling: SamplingTensors,
        draft: Draft,
        num_draft: torch.Tensor,
        target_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rejection sampling (greedy: prefix matching) -> output_token_ids [B, k+1], num_accepted [B],
        and for a tree the accepted branch's verify columns [B, k+1] (None for a chain)."""
        greedy = sampling.greedy if sampling.any_greedy else None
        generators = [s.generator for s in batch]
        if draft.parents is not None:  # a tree
            if sampling.all_greedy:
                return greedy_tree_verify(draft.token_ids, draft.parents, num_draft, target_logits.argmax(-1))
            return tree_rejection_sample(
                draft.token_ids, draft.parents, num_draft, _warp(target_logits, sampling), generators, greedy
            )
        if sampling.all_greedy:  # no probabilities needed
            return *greedy_verify(draft.token_ids, num_draft, target_logits.argmax(-1)), None
        return *rejection_sample(
            draft.token_ids, num_draft, draft.probs, _warp(target_logits, sampling), generators, greedy
        ), None

    def _keep_branch(
        self, slots: list[int], write_positions: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """Move the K/V entries of each row's accepted branch (verify columns path [B, k+1],
        root first) to the positions right after the root's, as a chain's would lie; the rest
        (rejected nodes) stay past the sequence's length, to be overwritten."""
        sources = write_positions.gather(1, path[:, 1:])  # [B, k]
        destinations = write_positions[:, 1:]  # [B, k]: root position + 1..k
        accepted = torch.arange(sources.shape[1], device=sources.device)[None, :] < num_accepted[:, None]  # [B, k]
        root = write_positions[:, :1]  # [B, 1]: a no-op pair pads the rest
        self.target.move(slots, torch.where(accepted, sources, root), torch.where(accepted, destinations, root))

    def _sampling_tensors(self, batch: list[Sequence]) -> SamplingTensors:
        """The batch's settings as tensors, rebuilt only when the batch changes."""
        key = tuple(seq.request_id for seq in batch)
        if key != self._sampling_key or self._sampling is None:
            self._sampling_key = key
            sampling = SamplingTensors.from_params([s.params for s in batch], self.target.device)
            self._sampling = dataclasses.replace(sampling, processors=self.processors)
        return self._sampling


def _on_branch(draft: Draft, tree: TreeAttention | None) -> torch.Tensor:
    """[B, k+1, k] bool: the drafts in each verify column's context: a chain's column t follows
    drafts 0..t-1; a tree's column follows the nodes of its branch, itself included."""
    if tree is not None:
        return tree.visible[:, :, 1:]  # columns 1..k are the nodes
    return chain_branches(draft.token_ids)


def _warp(target_logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The target's warped distributions [B, T, V] from its logits [B, T, V]."""
    B, T, V = target_logits.shape  # T = k + 1
    return warp(target_logits.reshape(B * T, V), sampling.repeat_rows(T)).view(B, T, V)


def _keep_prompt_logprobs(seq: Sequence, start: int, length: int, logits: torch.Tensor) -> None:
    """Keep in seq the logprobs of the prompt tokens that logits [W, V] at positions
    start..start+length-1 predict (position p's predicts token p + 1), from the first not kept
    yet (a prefill begun again after preemption computes some twice); None for token 0."""
    prompt = seq.prompt_token_ids
    kept = seq.prompt_logprobs
    if not kept:
        kept.append(None)  # no token before the first
    first, last = max(start + 1, len(kept)), min(start + length, len(prompt) - 1)  # tokens predicted, kept anew
    if first > last:
        return
    tokens = torch.tensor(prompt[first : last + 1], device=logits.device)  # [n]
    assert seq.params.prompt_logprobs is not None
    kept += token_logprobs(logits[first - 1 - start : last - start], tokens, seq.params.prompt_logprobs)


def _logprobs(
    batch: list[Sequence],
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    path: torch.Tensor | None = None,
) -> list[list | None]:
    """For each row whose request asks for logprobs, its first num_tokens[row] emitted tokens'
    (token_ids [B, T]; token j drawn from the distribution of logits [B, T, V] at column j, or for
    a tree at column path[row, j], its branch's): a list of TokenLogprob; None for the other rows."""
    logprobs: list[list | None] = [None] * len(batch)
    for row, seq in enumerate(batch):
        if seq.params.logprobs is not None:
            n = int(num_tokens[row])
            columns = path[row, :n] if path is not None else torch.arange(n, device=logits.device)  # [n]
            logprobs[row] = token_logprobs(logits[row, columns], token_ids[row, :n], seq.params.logprobs)
    return logprobs


def _tree_depths(positions: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Each row's tree depth [B] from its verify positions [B, k+1] (root first, nodes at the
    root's + their depth) and its node count [B]."""
    columns = torch.arange(positions.shape[1], device=positions.device)[None, :]  # [1, k+1]
    offsets = (positions - positions[:, :1]).masked_fill(columns > num_nodes[:, None], 0)  # [B, k+1]
    return offsets.max(dim=1).values
