"""Progress lines for slow one-off work (progress.stage), and warm-ups that leave nothing one-off
to a timed request (LLM.warm_up: goodput's calibration, every forward shape of the rounds)."""

from __future__ import annotations

import threading

import pytest

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.progress import stage
from specdec.spec.goodput import GoodputPolicy
from specdec.worker import ModelRunner


def test_a_quick_stage_prints_nothing(capsys):
    with stage("reading", after=60):
        pass
    assert capsys.readouterr().err == ""


def test_a_slow_stage_says_what_it_does_and_how_long_it_took(capsys):
    shown = threading.Event()
    with stage("reading the target", after=0.0):
        with stage("packing", after=0.0):
            shown.wait(0.5)  # the timers' lines come from their threads
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "specdec: reading the target ..."
    assert lines[1] == "specdec:   packing ..."
    assert lines[2].startswith("specdec:   packing: done in ") and lines[2].endswith(" s")
    assert lines[3].startswith("specdec: reading the target: done in ")


def test_progress_can_be_silenced(capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_PROGRESS", "0")
    with stage("reading", after=0.0):
        threading.Event().wait(0.1)
    assert capsys.readouterr().err == ""


def test_a_failing_stage_still_says_how_long_it_took(capsys):
    with pytest.raises(RuntimeError):
        with stage("reading", after=0.0):
            threading.Event().wait(0.1)
            raise RuntimeError("no")
    assert "specdec: reading: done in" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    return (
        save_tiny_model(root / "target", "llama", seed=41, init_std=0.3),
        save_tiny_model(root / "draft", "llama", seed=42, init_std=0.3, num_hidden_layers=1),
    )


def test_after_warm_up_a_request_calibrates_nothing(pair, monkeypatch):
    """Goodput's costs are measured in the warm-up, at every k up to the engine's, so the timed
    request that follows (here with more room, so larger k) times nothing of its own."""
    target, draft = pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=4, dtype="float32", compile="off")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.warm_up([5, 6, 7], params)
    measured = []
    original = GoodputPolicy.calibrate

    def counting(policy, batch_size, k, time_target, time_draft):
        original(policy, batch_size, k, lambda t: (measured.append(t), time_target(t)), time_draft)

    monkeypatch.setattr(GoodputPolicy, "calibrate", counting)
    llm.generate([5, 6, 7, 8, 9], params)
    assert measured == []
    assert set(llm.engine.policy.costs[1].verify.calibrated) == {1, 2, 3, 4, 5}


def test_warm_up_runs_every_verify_length(pair, monkeypatch):
    """Under a fixed k (no calibration) the warm-up itself runs the target at 1..k+1 tokens a row,
    so no shape is first called inside a timed request."""
    target, draft = pair
    llm = LLM(
        str(target),
        speculative_model=str(draft),
        num_speculative_tokens=3,
        dtype="float32",
        compile="off",
        speculative_k_policy="fixed",
    )
    lengths = set()
    forward = ModelRunner.forward

    def recording(runner, batch, *args, **kwargs):
        if runner is llm.runner:  # the target's, not the draft's
            lengths.add(batch.input_ids.shape[1])
        return forward(runner, batch, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__call__", recording)
    llm.warm_up([5, 6, 7], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert {1, 2, 3, 4} <= lengths
