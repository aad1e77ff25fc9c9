"""PrefixRouter: which engine replica a request goes to (`specdec serve --replicas N`).

Terms:
  block key       the chained digest under which an engine's prefix cache keeps a whole block of
                  16 prompt tokens (block_manager.block_key: the block's tokens and the key
                  of the block before it), so one key stands for the whole prefix up to its block
  matched blocks  for a request and a replica: how many of the request's leading block keys the
                  router saw that replica serve lately (the prefix it most likely still has cached)
  in flight       requests routed to a replica and not yet finished there (its load)

The router's view is approximate, as vLLM's and SGLang's routers are: it remembers, per replica, a
bounded LRU set of the block keys of the prompts it sent there, not what the replica's cache
really holds (a key the engine has evicted may still be remembered, and the reverse). A request
goes to the replica with the most matched blocks among those not overloaded (at most
max_imbalance more in flight than the least loaded up replica), else to the least loaded one.
A replica marked down (it died; Ray restarts it) gets nothing until it is marked up again, and
comes back with an empty cache. Plain Python, no Ray: the ingress holds one router.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specdec.block_manager import ROOT_KEY, block_key
from specdec.kv_cache import BLOCK_SIZE

DEFAULT_KEYS_PER_REPLICA = 16384  # ~16 bytes a key: a few MB per replica; 262,144 cached tokens remembered
DEFAULT_MAX_IMBALANCE = 4  # requests in flight a prefix may cost over the least loaded replica


def prompt_block_keys(prompt_token_ids: list[int]) -> list[bytes]:
    """The block keys of the prompt's whole blocks, first block first (the engine's own keys)."""
    keys, key = [], ROOT_KEY
    for start in range(0, len(prompt_token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        key = block_key(key, prompt_token_ids[start : start + BLOCK_SIZE])
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Route:
    """Where a request went: replica (its index), matched_blocks (0: routed by load alone)."""

    replica: int
    matched_blocks: int

    @property
    def reason(self) -> str:
        return "prefix" if self.matched_blocks else "load"


class PrefixRouter:
    """Routes requests among num_replicas replicas (module docstring). keys_per_replica bounds
    each replica's remembered keys (least recently routed dropped first)."""

    def __init__(
        self,
        num_replicas: int,
        keys_per_replica: int = DEFAULT_KEYS_PER_REPLICA,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
    ):
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        if keys_per_replica < 1 or max_imbalance < 0:
            raise ValueError(
                f"keys_per_replica must be >= 1 and max_imbalance >= 0, got {keys_per_replica}, {max_imbalance}"
            )
        self.num_replicas = num_replicas
        self.keys_per_replica = keys_per_replica
        self.max_imbalance = max_imbalance
        self.in_flight = [0] * num_replicas
        self.down: set[int] = set()
        self._routed = 0  # requests routed so far: whose turn a tie is
        self._keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def route(self, prompt_token_ids: list[int]) -> Route:
        """Choose the request's replica, count it in flight there and remember its prompt's blocks
        there. Call finished(route.replica) when the request ends, however it ends."""
        keys = prompt_block_keys(prompt_token_ids)
        lookup = keys[: (len(prompt_token_ids) - 1) // BLOCK_SIZE]  # the engine recomputes the last token's block
        route = self._choose(lookup)
        self._routed += 1
        self.in_flight[route.replica] += 1
        self._remember(route.replica, keys)
        return route

    def finished(self, replica: int) -> None:
        """A request routed to replica has ended (finished, failed or aborted)."""
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

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

    def _choose(self, keys: list[bytes]) -> Route:
        up = [r for r in range(self.num_replicas) if r not in self.down] or list(range(self.num_replicas))
        least = min(self.in_flight[r] for r in up)
        within = [r for r in up if self.in_flight[r] <= least + self.max_imbalance]
        matched = {r: self.matched_blocks(r, keys) for r in within}
        # most matched blocks first, then fewest in flight, then in turn (ties do not all go to replica 0)
        turn = self._routed % self.num_replicas
        best = min(within, key=lambda r: (-matched[r], self.in_flight[r], (r - turn) % self.num_replicas))
        return Route(best, matched[best])

    def _remember(self, replica: int, keys: list[bytes]) -> None:
        remembered = self._keys[replica]
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > self.keys_per_replica:
            remembered.popitem(last=False)
