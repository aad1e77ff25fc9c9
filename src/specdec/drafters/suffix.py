"""Suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; vLLM's method "suffix"):
propose what followed the context's longest recent match in the text this server has seen. No
model; the proposal is a tree of point masses (draft_probs None), or nothing.

Terms:
  suffix tree   every suffix of a token stream, up to max_tree_depth tokens deep, each node
                counting how often its path occurred. arctic-inference's C++ tree
                (arctic_inference.suffix_decoding, as vLLM uses it) holds them.
  own tree      one per running request, over its prompt and its output so far: prompt lookup,
                with frequencies.
  shared tree   one over the outputs of recent requests (the running ones' too, token by token),
                the oldest request's dropped once max_cached_requests are held: a workload that
                repeats itself (the same instruction over many inputs, a tool call's scaffolding)
                drafts from what earlier requests were answered. One per cache scope
                (Sequence.cache_scope: a server's API key, say): a request drafts from the answers
                of its own scope's requests alone, so its speed tells nothing of what another
                scope's requests were answered. Each scope holds max_cached_requests.
  match         the longest suffix of the context found in a tree (up to max_tree_depth tokens);
                a round drafts at most max_spec_factor x its length tokens, so a one-token
                coincidence drafts little and a long copy drafts much.

Each round, each row speculates from both trees and keeps the draft of higher score (its nodes'
frequencies summed): up to k nodes, the likeliest continuations of the match, each node's
frequency at least min_token_prob. The nodes form a tree (several continuations seen after the
same context) verified in one forward (tree.py), ranked by their paths' frequencies (under
goodput the round verifies the likeliest the verify's cost buys: spec/tree_width.py); a draft
that is one path is handed on as a chain.

A seeded sampled request drafts from its own tree alone: how many random numbers a round draws
depends on its draft, and a seed must give the same tokens whatever else the server has served.
Greedy and unseeded rows use both. Drafts never change the output, only how much of it a round
accepts.
"""

from __future__ import annotations

import itertools

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.tree import ROOT

INSTALL_HINT = (
    'speculative_method="suffix" needs arctic-inference (suffix trees in C++): `make setup` installs it; by hand, '
    'pip install setuptools wheel cmake nanobind==2.9.2 protobuf grpcio-tools, then CMAKE_ARGS="-DPython_EXECUTABLE='
    '$(which python)" pip install --no-build-isolation arctic-inference==0.3.0'
)


def suffix_cache_class():
    """arctic-inference's SuffixDecodingCache, or an ImportError that says how to install it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return SuffixDecodingCache


class SuffixDrafter(Drafter):
    """max_tree_depth: the longest match and draft a tree holds; max_cached_requests: the
    requests whose outputs the shared tree holds (0: none, each request drafts from its own);
    max_spec_factor: the most tokens drafted per matched token; min_token_prob: the least
    frequency a drafted node may have among its siblings' paths."""

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10_000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        device: torch.device | str = "cpu",
    ):
        self.max_tree_depth, self.max_cached_requests = max_tree_depth, max_cached_requests
        self._fresh_caches()
        self.max_spec_factor, self.min_token_prob, self.device = max_spec_factor, min_token_prob, device
        # request id -> (its key in its caches, output tokens already added); a key is never
        # reused, so a request id that comes back (a later generate call's "0") is a new request
        self.started: dict[str, tuple[int, int]] = {}
        self._keys = itertools.count()

    def forget(self) -> None:
        """Drop every tree (no request may be running): a benchmark's warm-up answer, say, would
        otherwise draft the prompt it warmed up on."""
        assert not self.started, "forget() with requests running"
        self._fresh_caches()

    def _fresh_caches(self) -> None:
        self.cache_class = suffix_cache_class()
        self.shared_by_scope: dict = {}  # cache scope -> its own trees + its shared tree (made when first used)
        self.own = self.cache_class(self.max_tree_depth, 0)  # own trees alone: what seeded sampled rows draft from

    def shared(self, scope: str | None):
        """The cache of scope's requests: their own trees and the shared tree over their outputs."""
        if scope not in self.shared_by_scope:
            self.shared_by_scope[scope] = self.cache_class(self.max_tree_depth, self.max_cached_requests)
        return self.shared_by_scope[scope]

    @classmethod
    def from_config(cls, spec, target, target_runner) -> SuffixDrafter:
        return cls(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
            target_runner.device,
        )

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        width = max(ks, default=0)
        token_ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, k]
        parents = torch.full((len(batch), width), ROOT, dtype=torch.long)  # [B, k]
        scores = torch.full((len(batch), width), float("-inf"))  # [B, k]
        num_tokens = torch.zeros(len(batch), dtype=torch.long)  # [B]
        for row, (seq, k) in enumerate(zip(batch, ks)):
            nodes, node_parents, probs = self.speculate(seq, k)
            token_ids[row, : len(nodes)] = torch.as_tensor(nodes, dtype=torch.long)
            parents[row, : len(nodes)] = torch.as_tensor(node_parents, dtype=torch.long)
            scores[row, : len(nodes)] = torch.as_tensor(probs, dtype=torch.float32).log()
            num_tokens[row] = len(nodes)
        used = int(num_tokens.max()) if len(batch) else 0
        token_ids, parents, scores = token_ids[:, :used], parents[:, :used], scores[:, :used]  # [B, used]
        columns = torch.arange(used)  # [used]
        after_the_one_before = (parents == columns - 1) | (columns[None, :] >= num_tokens[:, None])  # [B, used]
        if bool(after_the_one_before.all()):  # every row a chain
            return Draft(token_ids.to(self.device), num_tokens.to(self.device))
        return Draft(
            token_ids.to(self.device), num_tokens.to(self.device), parents=parents.to(self.device), scores=scores
        )

    def proposal_length(self, seq: Sequence, k: int) -> int:
        """How many nodes propose would give seq with k: 0 where no tree continues its context."""
        return len(self.speculate(seq, k)[0])

    def speculate(self, seq: Sequence, k: int) -> tuple[list[int], list[int], list[float]]:
        """Up to k draft nodes for seq (token ids; each one's parent's index in them, ROOT for
        a child of the last token, parents before children; each one's probability, its path's
        frequency among the paths that continue the match), from its own tree and, unless it
        drafts alone, the shared one: the draft of higher score."""
        key = self._bring_up_to_date(seq)
        if k <= 0:
            return [], [], []
        cache = self.own if _drafts_alone(seq) else self.shared(seq.cache_scope)
        context = seq.token_ids[-cache.max_tree_depth :]
        draft = cache.speculate(
            key,
            context,
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
            use_tree_spec=True,
        )
        return list(draft.token_ids), list(draft.parents), list(draft.probs)

    def _bring_up_to_date(self, seq: Sequence) -> int:
        """seq's key in the caches, its prompt and every output token added to its trees (and
        its outputs to the shared one)."""
        if seq.request_id not in self.started:
            key = next(self._keys)
            for cache in self._caches(seq):
                cache.start_request(key, seq.prompt_token_ids)
            self.started[seq.request_id] = (key, 0)
        key, added = self.started[seq.request_id]
        new = seq.output_token_ids[added:]
        if new:
            for cache in self._caches(seq):
                cache.add_active_response(key, new)
            self.started[seq.request_id] = (key, added + len(new))
        return key

    def release(self, seq: Sequence) -> None:
        """seq left its slot: finished (its whole output stays in the shared tree, for later
        requests), or preempted to be recomputed (its output is dropped from the shared tree,
        and added again, once, when it comes back)."""
        if seq.request_id not in self.started:
            return
        key = self._bring_up_to_date(seq)
        del self.started[seq.request_id]
        for cache in self._caches(seq):
            cache.stop_request(key)
            if not seq.finished and key in cache.cached_requests:
                cache.evict_cached_response(key)

    def _caches(self, seq: Sequence) -> tuple:
        """The caches that hold seq's text: its scope's shared one (its own tree, and its output
        for later requests of the scope), and for a row that drafts alone the cache of own trees too."""
        shared = self.shared(seq.cache_scope)
        return (shared, self.own) if _drafts_alone(seq) else (shared,)


def _drafts_alone(seq: Sequence) -> bool:
    """A seeded sampled request drafts from its own text alone (the module's docstring)."""
    return seq.params.seed is not None and not seq.params.greedy
