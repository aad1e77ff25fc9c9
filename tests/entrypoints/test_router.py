"""serve/router.PrefixRouter, without Ray: a request goes to the replica that lately served the
longest run of its prompt's blocks (the engine's own block keys), else to the least loaded; an
overloaded replica loses its prefix's requests; a replica marked down gets none and comes back
with nothing remembered; the remembered keys stay bounded."""

from __future__ import annotations

import random

import pytest

from specdec.block_manager import ROOT_KEY, block_key
from specdec.kv_cache import BLOCK_SIZE
from specdec.serve.router import PrefixRouter, prompt_block_keys


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_block_keys_are_the_engines():
    rng = random.Random(0)
    prompt = tokens(rng, 3 * BLOCK_SIZE + 5)
    expected, key = [], ROOT_KEY
    for i in range(3):
        key = block_key(key, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        expected.append(key)
    assert prompt_block_keys(prompt) == expected
    assert prompt_block_keys(prompt[: BLOCK_SIZE - 1]) == []


def test_least_loaded_without_a_prefix():
    rng = random.Random(1)
    router = PrefixRouter(3)
    routes = [router.route(tokens(rng, 40)) for _ in range(6)]
    assert [r.replica for r in routes] == [0, 1, 2, 0, 1, 2]
    assert {r.reason for r in routes} == {"load"}
    router.finished(1)
    assert router.route(tokens(rng, 40)).replica == 1


def test_ties_take_turns():
    """One request after another (none in flight) still spreads over the replicas."""
    rng = random.Random(7)
    router = PrefixRouter(3)
    replicas = []
    for _ in range(6):
        replicas.append(router.route(tokens(rng, 40)).replica)
        router.finished(replicas[-1])
    assert replicas == [0, 1, 2, 0, 1, 2]


def test_a_shared_prefix_goes_where_it_was_served():
    rng = random.Random(2)
    router = PrefixRouter(2)
    system = tokens(rng, 4 * BLOCK_SIZE)
    first = router.route(system + tokens(rng, 10))
    router.route(tokens(rng, 40))  # to the other replica, by load
    again = router.route(system + tokens(rng, 7))
    assert again.replica == first.replica
    assert again.matched_blocks == 4 and again.reason == "prefix"
    # a longer match wins over a shorter one
    other = router.route(system[: 2 * BLOCK_SIZE] + tokens(rng, 3 * BLOCK_SIZE))
    assert other.replica == first.replica and other.matched_blocks == 2


def test_only_the_blocks_before_the_last_token_count():
    """The engine recomputes the block holding the prompt's last token: a prompt of exactly one
    block matches nothing."""
    rng = random.Random(3)
    router = PrefixRouter(2)
    block = tokens(rng, BLOCK_SIZE)
    router.route(block + tokens(rng, 5))
    assert router.route(block).matched_blocks == 0


def test_an_overloaded_replica_loses_its_prefix():
    rng = random.Random(4)
    router = PrefixRouter(2, max_imbalance=2)
    system = tokens(rng, 2 * BLOCK_SIZE)
    replicas = [router.route(system + tokens(rng, 5)).replica for _ in range(6)]
    # 0 takes the prefix; it keeps it until it has 3 more in flight than 1, then they alternate
    assert replicas[:3] == [0, 0, 0]
    assert router.in_flight[0] - router.in_flight[1] <= 3
    assert 1 in replicas


def test_a_replica_down_gets_nothing_and_comes_back_empty():
    rng = random.Random(5)
    router = PrefixRouter(2)
    prompt = tokens(rng, 3 * BLOCK_SIZE)
    assert router.route(prompt).replica == 0
    router.finished(0)
    router.mark_down(0)
    assert all(router.route(tokens(rng, 40)).replica == 1 for _ in range(5))
    router.mark_up(0)
    route = router.route(prompt)
    assert route.replica == 0 and route.matched_blocks == 0  # least loaded; its cache was lost


def test_all_down_still_routes():
    router = PrefixRouter(2)
    router.mark_down(0)
    router.mark_down(1)
    assert router.route(list(range(20))).replica in (0, 1)


def test_remembered_keys_are_bounded_lru():
    rng = random.Random(6)
    router = PrefixRouter(1, keys_per_replica=4)
    old = tokens(rng, 3 * BLOCK_SIZE)
    router.route(old)
    for _ in range(3):
        router.route(tokens(rng, 2 * BLOCK_SIZE))
    assert router.matched_blocks(0, prompt_block_keys(old)) == 0
    assert len(router._keys[0]) == 4


@pytest.mark.parametrize("arguments", [(0,), (1, 0), (1, 4, -1)])
def test_bad_settings_are_refused(arguments):
    with pytest.raises(ValueError):
        PrefixRouter(*arguments)
