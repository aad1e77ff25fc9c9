"""PrefixRouter: which engine replica a request goes to (`specdec serve --replicas N`).

Terms:
  block key       the chained digest under which an engine's prefix cache keeps a whole block of
                  16 prompt tokens (block_manager.block_key: the block's tokens and the key
                  of the block before it), so one key stands for the whole prefix up to its block
  matched blocks  for a request and a replica: how many of the request's leading block keys the
                  router saw that replica serve lately (the prefix it most likely still has cached)
  work            the tokens a request makes its replica compute: the prompt's tokens past its
                  matched blocks (its prefill) plus max_tokens (its decoding)
  outstanding     a replica's load: the work of the requests routed there, less what they have
                  computed so far (reported by computed()); in flight: how many requests that is

A request goes to the replica where it would finish first, counted in tokens: the least
outstanding + its work there. A prefix cached on a replica lowers the request's work there by
16 tokens a matched block, so a shared system prompt goes back to its replica until that
replica's queue outweighs the prefill it saves; ties go in turn. Requests are counted in tokens,
not one each: prompts of 30 and 300 tokens cost a replica unlike amounts of prefill, and
splitting a burst evenly by count can leave one replica with half as much work again as the other.

The router's view is approximate, as vLLM's and SGLang's routers are: it remembers, per replica, a
bounded LRU set of the block keys of the prompts it sent there, not what the replica's cache
really holds (a key the engine has evicted may still be remembered, and the reverse), and a
request may stop before max_tokens. A replica marked down (it died; Ray restarts it) gets
nothing until it is marked up again, and comes back with an empty cache. Plain Python, no Ray:
the ingress holds one router.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specdec.block_manager import ROOT_KEY, block_key
from specdec.kv_cache import BLOCK_SIZE

DEFAULT_KEYS_PER_REPLICA = 16384  # ~16 bytes a key: a few MB per replica; 262,144 cached tokens remembered


def prompt_block_keys(prompt_token_ids: list[int]) -> list[bytes]:
    """The block keys of the prompt's whole blocks, first block first (the engine's own keys)."""
    keys, key = [], ROOT_KEY
    for start in range(0, len(prompt_token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        key = block_key(key, prompt_token_ids[start : start + BLOCK_SIZE])
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Route:
    """Where a request went: replica (its index), matched_blocks (0: routed by load alone),
    prefill_tokens (its prompt's tokens past them) and work (prefill_tokens + max_tokens)."""

    replica: int
    matched_blocks: int
    prefill_tokens: int
    work: int

    @property
    def reason(self) -> str:
        return "prefix" if self.matched_blocks else "load"


class PrefixRouter:
    """Routes requests among num_replicas replicas (module docstring). keys_per_replica bounds
    each replica's remembered keys (least recently routed dropped first)."""

    def __init__(self, num_replicas: int, keys_per_replica: int = DEFAULT_KEYS_PER_REPLICA):
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        if keys_per_replica < 1:
            raise ValueError(f"keys_per_replica must be >= 1, got {keys_per_replica}")
        self.num_replicas = num_replicas
        self.keys_per_replica = keys_per_replica
        self.down: set[int] = set()
        self._routed = 0  # requests routed so far: whose turn a tie is
        self._keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._remaining: dict[str, tuple[int, int]] = {}  # request id -> (replica, work not yet computed)

    @property
    def outstanding(self) -> list[int]:
        """Each replica's load: the work not yet computed of its requests, in tokens."""
        tokens = [0] * self.num_replicas
        for replica, remaining in self._remaining.values():
            tokens[replica] += remaining
        return tokens

    @property
    def in_flight(self) -> list[int]:
        """Each replica's requests routed and not yet finished."""
        requests = [0] * self.num_replicas
        for replica, _ in self._remaining.values():
            requests[replica] += 1
        return requests

    def route(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Route:
        """Choose the request's replica, count its work outstanding there and remember its
        prompt's blocks there. Then report computed(request_id, tokens) as outputs arrive, and
        finished(request_id) when it ends, however it ends."""
        if request_id in self._remaining:
            raise ValueError(f"request {request_id!r} is already routed; request ids must be unique")
        keys = prompt_block_keys(prompt_token_ids)
        lookup = keys[: (len(prompt_token_ids) - 1) // BLOCK_SIZE]  # the engine recomputes the last token's block
        replica, matched = self._choose(lookup)
        prefill = len(prompt_token_ids) - matched * BLOCK_SIZE
        route = Route(replica, matched, prefill, prefill + max(0, max_tokens))
        self._routed += 1
        self._remaining[request_id] = (replica, route.work)
        self._remember(replica, keys)
        return route

    def computed(self, request_id: str, tokens: int) -> None:
        """The request's replica computed tokens more of its work (its prefill once the first
        output arrives, then each new output token)."""
        if request_id not in self._remaining:
            return
        replica, remaining = self._remaining[request_id]
        self._remaining[request_id] = (replica, remaining - min(remaining, max(0, tokens)))

    def finished(self, request_id: str) -> None:
        """The request has ended (finished, failed or aborted): its work left no longer counts."""
        self._remaining.pop(request_id, None)

    def mark_down(self, replica: int) -> None:
        """The replica died: route nothing to it, and forget what it had cached."""
        self.down.add(replica)
        self._keys[replica].clear()

    def mark_up(self, replica: int) -> None:
        """The replica answers again (restarted, with an empty cache)."""
        self.down.discard(replica)

    def matched_blocks(self, replica: int, keys: list[bytes]) -> int:
        """How many of keys, from the first, the replica was lately sent."""
        remembered = self._keys[replica]
        count = 0
        while count < len(keys) and keys[count] in remembered:
            count += 1
        return count

    def _choose(self, keys: list[bytes]) -> tuple[int, int]:
        """(replica, its matched blocks): the up replica where the request finishes first."""
        up = [r for r in range(self.num_replicas) if r not in self.down] or list(range(self.num_replicas))
        matched = {r: self.matched_blocks(r, keys) for r in up}
        turn = self._routed % self.num_replicas  # ties do not all go to replica 0
        outstanding = self.outstanding
        best = min(up, key=lambda r: (outstanding[r] - matched[r] * BLOCK_SIZE, (r - turn) % self.num_replicas))
        return best, matched[best]

    def _remember(self, replica: int, keys: list[bytes]) -> None:
        remembered = self._keys[replica]
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > self.keys_per_replica:
            remembered.popitem(last=False)
