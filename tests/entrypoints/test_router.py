"""serve/router.PrefixRouter, without Ray: a request goes to the replica where it would finish
first in tokens (the least outstanding work, less the prefill its cached prefix saves there);
work is counted in tokens, so a burst splits by its prompts' lengths, not their number; a
replica's load falls as its requests compute and end; a replica marked down gets none and comes
back with nothing remembered; the remembered keys stay bounded."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.block_manager import ROOT_KEY, block_key
from specdec.kv_cache import BLOCK_SIZE
from specdec.serve.router import PrefixRouter, prompt_block_keys

_ids = itertools.count()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def send(router: PrefixRouter, prompt: list[int], max_tokens: int = 16):
    """Route a request under a fresh id: (its id, its Route)."""
    request_id = f"r{next(_ids)}"
    return request_id, router.route(request_id, prompt, max_tokens)


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
    sent = [send(router, tokens(rng, 40)) for _ in range(6)]
    assert [route.replica for _, route in sent] == [0, 1, 2, 0, 1, 2]
    assert {route.reason for _, route in sent} == {"load"}
    assert router.outstanding == [2 * (40 + 16)] * 3 and router.in_flight == [2, 2, 2]
    router.finished(sent[1][0])
    assert send(router, tokens(rng, 40))[1].replica == 1


def test_ties_take_turns():
    """One request after another (none in flight) still spreads over the replicas."""
    rng = random.Random(7)
    router = PrefixRouter(3)
    replicas = []
    for _ in range(6):
        request_id, route = send(router, tokens(rng, 40))
        replicas.append(route.replica)
        router.finished(request_id)
    assert replicas == [0, 1, 2, 0, 1, 2]
    assert router.outstanding == [0, 0, 0] and router.in_flight == [0, 0, 0]


def greedy_split(lengths: list[int], max_tokens: int, replicas: int) -> list[int]:
    """The reference: each request in turn to the replica with the least work so far."""
    work = [0] * replicas
    for length in lengths:
        least = min(range(replicas), key=lambda r: work[r])
        work[least] += length + max_tokens
    return work


def test_a_burst_splits_by_tokens_not_by_count():
    """Prompts arriving at once go each to the replica with the least work so far (the greedy
    reference), so the replicas' work differs by at most one request's; alternating long and
    short prompts, a split by count would give one replica all the long ones."""
    rng = random.Random(8)
    for _ in range(5):
        lengths = [rng.randrange(26, 330) for _ in range(16)]  # the bench's burst: 16 prompts of 26-329 tokens
        router = PrefixRouter(2)
        for length in lengths:
            send(router, tokens(rng, length), max_tokens=64)
        assert sorted(router.outstanding) == sorted(greedy_split(lengths, 64, 2))
        assert max(router.outstanding) - min(router.outstanding) <= max(lengths) + 64
    router = PrefixRouter(2)
    for length in [300, 30] * 8:
        send(router, tokens(rng, length), max_tokens=64)
    assert router.outstanding == [1832, 1832]  # by count: 364 * 8 = 2912 against 94 * 8 = 752
    assert router.in_flight == [8, 8]


def test_computed_work_lowers_the_load():
    rng = random.Random(9)
    router = PrefixRouter(2)
    long_id, long_route = send(router, tokens(rng, 300), max_tokens=10)
    assert long_route.work == 310 and router.outstanding == [310, 0]
    short_id, short_route = send(router, tokens(rng, 100), max_tokens=10)
    assert short_route.replica == 1
    router.computed(long_id, long_route.prefill_tokens + 1)  # prefilled, first token out
    assert router.outstanding == [9, 110]
    assert send(router, tokens(rng, 20))[1].replica == 0
    router.computed(long_id, 1000)  # more than it had left: counts what it had
    router.finished(long_id)
    router.finished(long_id)  # twice, or after an unknown id: nothing more
    router.computed("never-routed", 5)
    assert router.outstanding == [36, 110] and router.in_flight == [1, 1]


def test_a_shared_prefix_goes_where_it_was_served():
    """Replicas equally idle: the one that served the prefix saves its prefill, so it wins."""
    rng = random.Random(2)
    router = PrefixRouter(2)
    system = tokens(rng, 4 * BLOCK_SIZE)
    first_id, first = send(router, system + tokens(rng, 10))
    router.finished(first_id)
    other_id, _ = send(router, tokens(rng, 40))  # by turn, to the other replica
    router.finished(other_id)
    again_id, again = send(router, system + tokens(rng, 7))
    router.finished(again_id)
    assert again.replica == first.replica
    assert again.matched_blocks == 4 and again.reason == "prefix"
    assert again.prefill_tokens == 7 and again.work == 7 + 16
    # a longer match wins over a shorter one
    _, other = send(router, system[: 2 * BLOCK_SIZE] + tokens(rng, 3 * BLOCK_SIZE))
    assert other.replica == first.replica and other.matched_blocks == 2


def test_only_the_blocks_before_the_last_token_count():
    """The engine recomputes the block holding the prompt's last token: a prompt of exactly one
    block matches nothing."""
    rng = random.Random(3)
    router = PrefixRouter(2)
    block = tokens(rng, BLOCK_SIZE)
    send(router, block + tokens(rng, 5))
    assert send(router, block)[1].matched_blocks == 0


def test_a_prefix_stays_until_its_queue_outweighs_the_prefill_it_saves():
    """A cached prefix of 8 blocks saves 128 tokens of prefill: its replica takes the prefix's
    requests (24 tokens of work each there) while its outstanding work stays within 128 tokens
    of the other's, then the other replica prefills it too."""
    rng = random.Random(4)
    router = PrefixRouter(2)
    system = tokens(rng, 8 * BLOCK_SIZE)
    first_id, first = send(router, system + tokens(rng, 8))
    router.finished(first_id)
    replicas = [send(router, system + tokens(rng, 8))[1].replica for _ in range(8)]
    # the 7th would wait behind 6 * 24 = 144 tokens there, against a prefill of 128 + 24 on the other;
    # the 8th finds the prefix cached on both and goes to the less loaded
    assert first.replica == 0 and replicas == [0] * 6 + [1, 0]
    assert router.outstanding == [7 * 24, 8 * BLOCK_SIZE + 24]


def test_a_replica_down_gets_nothing_and_comes_back_empty():
    rng = random.Random(5)
    router = PrefixRouter(2)
    prompt = tokens(rng, 3 * BLOCK_SIZE)
    request_id, route = send(router, prompt)
    assert route.replica == 0
    router.finished(request_id)
    router.mark_down(0)
    assert all(send(router, tokens(rng, 40))[1].replica == 1 for _ in range(5))
    router.mark_up(0)
    _, route = send(router, prompt)
    assert route.replica == 0 and route.matched_blocks == 0  # least loaded; its cache was lost


def test_all_down_still_routes():
    router = PrefixRouter(2)
    router.mark_down(0)
    router.mark_down(1)
    assert send(router, list(range(20)))[1].replica in (0, 1)


def test_a_request_id_routes_once():
    router = PrefixRouter(2)
    router.route("same", list(range(20)), 4)
    with pytest.raises(ValueError, match="already routed"):
        router.route("same", list(range(20)), 4)


def test_remembered_keys_are_bounded_lru():
    rng = random.Random(6)
    router = PrefixRouter(1, keys_per_replica=4)
    old = tokens(rng, 3 * BLOCK_SIZE)
    send(router, old)
    for _ in range(3):
        send(router, tokens(rng, 2 * BLOCK_SIZE))
    assert router.matched_blocks(0, prompt_block_keys(old)) == 0
    assert len(router._keys[0]) == 4


@pytest.mark.parametrize("arguments", [(0,), (1, 0)])
def test_bad_settings_are_refused(arguments):
    with pytest.raises(ValueError):
        PrefixRouter(*arguments)
