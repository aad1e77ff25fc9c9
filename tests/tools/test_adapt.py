"""`specdec adapt` (training/adapt.py): an EAGLE-3 head fine-tuned on recorded traffic (a job's
requests, as `serve --learn` records them) drafts more of the held-out
requests than the head it started from, and drafting with it keeps the target's output; the time
budget ends a run where it stands, with its head written; too little traffic, a directory that
is not a head's and a model with no shipped head are refused by name."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch

from helpers import random_prompts, save_random_head, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.models.eagle import load_head
from specdec.models.loader import load_pretrained
from specdec.sequence import Sequence
from specdec.serve.head_store import HeadStore
from specdec.serve.recorder import Recorder
from specdec.tools.training import adapt as adapt_module
from specdec.tools.training.adapt import adapt, adapt_into_store
from specdec.tools.training.loop import TrainConfig

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
FAST = TrainConfig(steps=40, batch_size=4, lr=3e-3, min_lr_ratio=1.0, eval_every=0, checkpoint_every=0, log_every=0)
WORDS = "def return self value for in range if else import class print list dict x y n".split()


def record(directory, target, count: int, seed: int) -> None:
    """count requests of one job, as a server with --learn records them: a question in a dozen
    words, an answer in six of them (a batch job's narrow language)."""
    tokenizer = load_pretrained(target, "float32").tokenizer
    rng = random.Random(seed)
    recorder = Recorder(directory, str(target), 320, 10**7)
    for i in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        answer = " ".join(rng.choice(WORDS[:6]) for _ in range(rng.randint(30, 60)))
        seq = Sequence(f"r{i}", tokenizer.encode(question), GREEDY, torch.Generator())
        seq.output_token_ids = tokenizer.encode(answer)
        seq.finish_reason = "length"
        recorder.record(seq)
    recorder.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A 4-layer target, an untrained EAGLE-3 head for it scoring every token, and 16 recorded requests."""
    root = tmp_path_factory.mktemp("adapt")
    target = save_tiny_model(root / "target", seed=4, init_std=0.3, num_hidden_layers=4)
    head = save_random_head(target, root / "head", seed=2, feature_layers=(0, 1, 3))
    record(root / "traffic", target, 16, seed=7)
    return {"target": target, "head": head, "traffic": root / "traffic"}


def test_the_adapted_head_drafts_more_of_the_held_out_requests_and_keeps_the_output(job, tmp_path):
    out = tmp_path / "adapted"
    adapted = adapt(str(job["target"]), job["traffic"], out, job["head"], minutes=10, steps=40, config=FAST)
    assert adapted.result.out == out and adapted.improved
    assert adapted.after["held_out_greedy_agreement"] > adapted.before["held_out_greedy_agreement"] + 0.04
    head = load_head(out, load_pretrained(job["target"], "float32").model.config, torch.float32)
    assert head.feature_layers == (0, 1, 3)
    prompts = random_prompts(3, seed=40, lengths=(8, 24))
    expected = token_ids(LLM(str(job["target"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY))
    drafted = LLM(str(job["target"]), dtype="float32", speculative_model=str(out), num_speculative_tokens=3)
    assert token_ids(drafted.generate(prompts, GREEDY)) == expected


def test_the_command_line_stops_at_its_time_budget_with_the_head_written(job, tmp_path, capsys):
    out = tmp_path / "quick"
    argv = ["adapt", str(job["target"]), "--from", str(job["traffic"]), "--head", str(job["head"])]
    code = main([*argv, "--out", str(out), "--minutes", "0.0001", "--steps", "500"])
    said = capsys.readouterr().out
    assert code in (0, 1) and "held-out agreement" in said and "tau estimate" in said, said
    assert (out / "head.json").is_file() and "(1 steps)" in said  # the budget ran out after the first step


def test_too_little_traffic_and_a_wrong_head_are_refused(job, tmp_path, capsys):
    one = tmp_path / "one"
    record(one, job["target"], 1, seed=3)
    argv = ["adapt", str(job["target"]), "--out", str(tmp_path / "o")]
    assert main([*argv, "--from", str(one), "--head", str(job["head"])]) == 2
    assert "adapting needs at least 2" in capsys.readouterr().err
    assert main([*argv, "--from", str(job["traffic"]), "--head", str(job["target"])]) == 2
    assert "is not an EAGLE head's directory" in capsys.readouterr().err
    assert main([*argv, "--from", str(job["traffic"])]) == 2
    assert "no EAGLE head is registered for" in capsys.readouterr().err
    assert main([*argv, "--from", str(tmp_path), "--head", str(job["head"])]) == 2
    assert "holds no recorded traffic" in capsys.readouterr().err


def test_adapting_into_the_store_publishes_a_better_head_and_deletes_one_that_is_not(
    job, tmp_path, capsys, monkeypatch
):
    """Without --out: into DIR/heads. A better head is version 1, current, with what adapt measured;
    the next run starts from it, and a head it makes worse (a learning rate that wrecks it) is
    deleted, version 1 staying current; no candidate or features are left behind."""
    traffic = tmp_path / "traffic"
    shutil.copytree(job["traffic"], traffic)
    adapted, version = adapt_into_store(str(job["target"]), traffic, job["head"], steps=40, config=FAST)
    store = HeadStore(traffic)
    assert adapted.improved and version is not None and store.current() == version and version.number == 1
    report = json.loads((version.path / "adapt.json").read_text())
    assert (
        report["started_from"] == str(job["head"])
        and report["after"]["held_out_tau_estimate"] > report["before"]["held_out_tau_estimate"]
    )
    wrecking = dataclasses.replace(FAST, lr=50.0)
    argv = ["adapt", str(job["target"]), "--from", str(traffic), "--steps", "1"]
    started_from = []

    def wrecked(model, traffic, out, head, minutes, steps, config=None, **kwargs):
        started_from.append(head)
        return adapt(model, traffic, out, head, minutes, steps, wrecking, **kwargs)

    monkeypatch.setattr(adapt_module, "adapt", wrecked)
    assert main(argv) == 1
    assert started_from == [version.path]
    assert "it is deleted, the current version stays" in capsys.readouterr().out
    assert store.current() == version and store.versions() == [1]
    assert sorted(p.name for p in store.root.iterdir()) == ["000001", "adapt.lock", "current.json"]
