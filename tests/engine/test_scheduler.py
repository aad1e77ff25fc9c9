"""The scheduler on its own: first come, first served into free cache slots; a prefill budget;
slots freed by finished and removed requests go to the next waiting ones."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import SamplingParams
from specdec.engine.scheduler import Scheduler
from specdec.sequence import Sequence


def sequence(request_id: str, prompt_length: int) -> Sequence:
    return Sequence(request_id, list(range(2, 2 + prompt_length)), SamplingParams(), torch.Generator())


def test_requests_start_in_arrival_order_into_the_free_slots_lowest_first():
    scheduler = Scheduler(num_slots=3)
    for i in range(5):
        scheduler.add(sequence(f"r{i}", 4))
    admitted = scheduler.admit()
    assert [seq.request_id for seq in admitted] == ["r0", "r1", "r2"]
    assert [seq.slot for seq in admitted] == [0, 1, 2]
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 2)
    assert scheduler.admit() == []  # no slot free


def test_a_finished_requests_slot_goes_to_the_next_waiting_one():
    scheduler = Scheduler(num_slots=2)
    for i in range(4):
        scheduler.add(sequence(f"r{i}", 4))
    first, second = scheduler.admit()
    second.finish_reason = "stop"
    assert scheduler.retire_finished() == [second]
    assert scheduler.running == [first]
    (third,) = scheduler.admit()
    assert (third.request_id, third.slot) == ("r2", second.slot)


def test_the_prefill_budget_splits_a_burst_but_always_starts_one():
    scheduler = Scheduler(num_slots=8, max_prefill_tokens=20)
    for i, length in enumerate([6, 6, 6, 30, 4]):
        scheduler.add(sequence(f"r{i}", length))
    # rows x the longest prompt among them: 3 x 6 = 18 fits, 4 x 30 does not
    assert [seq.request_id for seq in scheduler.admit()] == ["r0", "r1", "r2"]
    # a prompt longer than the whole budget still starts, alone
    assert [seq.request_id for seq in scheduler.admit()] == ["r3"]
    assert [seq.request_id for seq in scheduler.admit()] == ["r4"]
    assert scheduler.num_waiting == 0


def test_removing_a_request_frees_its_slot_or_its_place_in_line():
    scheduler = Scheduler(num_slots=1)
    for i in range(3):
        scheduler.add(sequence(f"r{i}", 3))
    (running,) = scheduler.admit()
    assert scheduler.remove("r2").request_id == "r2"  # waiting
    assert scheduler.remove("r0") is running  # running: its slot is free again
    assert scheduler.remove("nobody") is None
    (next_one,) = scheduler.admit()
    assert (next_one.request_id, next_one.slot) == ("r1", 0)
    scheduler.remove("r1")
    assert not scheduler.has_unfinished()


def test_a_swapped_out_request_resumes_first_in_its_own_slot_and_a_recomputed_one_in_any():
    """Preempted with keep_slot (swapped out), a request waits first in line holding its slot: it
    resumes in it even with no slot free, before the requests that came earlier. Preempted
    without (to be recomputed), its slot goes to the next request and it takes the next free
    one, its prefill its tokens but the last."""
    scheduler = Scheduler(num_slots=2)
    for i in range(3):
        scheduler.add(sequence(f"r{i}", 3))
    first, second = scheduler.admit()
    second.output_token_ids += [7, 8]
    scheduler.preempt(second, keep_slot=True)
    assert (second.slot, [seq.request_id for seq in scheduler.waiting]) == (1, ["r1", "r2"])
    assert scheduler.admit() == [second] and second.slot == 1  # r2 still waits: no slot free
    scheduler.preempt(second, keep_slot=False)
    assert second.slot == -1
    (resumed,) = scheduler.admit()  # first in line, into the slot free again
    assert resumed is second and resumed.slot == 1 and scheduler.num_waiting == 1
    assert resumed.prefill_token_ids == [2, 3, 4, 7]  # all but the last token, which a round feeds


def test_slots_change_only_while_nothing_runs():
    scheduler = Scheduler(num_slots=1)
    scheduler.add(sequence("r0", 3))
    scheduler.admit()
    with pytest.raises(RuntimeError, match="cannot change while sequences run"):
        scheduler.resize(4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_and_finishes_never_share_a_slot_and_serve_everyone_in_order(seed):
    """Against a plain model of the rules: at most num_slots run, each in a slot of its own, and
    requests start in the order they came."""
    rng = random.Random(seed)
    num_slots = rng.randint(1, 4)
    scheduler = Scheduler(num_slots=num_slots, max_prefill_tokens=rng.choice([None, 16, 40]))
    arrived, started = 0, []
    for _ in range(200):
        for _ in range(rng.randint(0, 2)):
            scheduler.add(sequence(f"r{arrived}", rng.randint(1, 20)))
            arrived += 1
        started += [seq.request_id for seq in scheduler.admit()]
        slots = [seq.slot for seq in scheduler.running]
        assert len(slots) == len(set(slots)) <= num_slots and all(0 <= s < num_slots for s in slots)
        for seq in scheduler.running:
            if rng.random() < 0.3:
                seq.finish_reason = "length"
        scheduler.retire_finished()
    assert started == [f"r{i}" for i in range(len(started))]
    assert len(started) + scheduler.num_waiting == arrived
