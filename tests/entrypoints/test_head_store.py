"""DIR/heads (serve/head_store.py): versions published whole and made current at once, one adapt
run at a time, a damaged current.json named; and the server's watcher (serve/head_watcher.py):
each new version loaded and handed to the engine to swap in, a version that does not load
refused by name once, the head in use kept."""

from __future__ import annotations

import logging
import shutil

import pytest

from helpers import save_random_head, save_tiny_model
from specdec import LLM
from specdec.serve.head_store import HeadStore, HeadStoreError
from specdec.serve.head_watcher import HeadWatcher


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-store")
    target = save_tiny_model(root / "target", "llama", seed=3, init_std=0.3)
    return {
        "target": target,
        "heads": [save_random_head(target, root / f"head{seed}", seed=seed) for seed in (1, 2)],
    }


def publish(store: HeadStore, head, damage: bool = False):
    with store.adapting() as candidate:
        shutil.copytree(head, candidate)
        if damage:
            (candidate / "head.safetensors").write_bytes(b"\x00" * 64)
        return store.publish(candidate, {"before": 1.4, "after": 1.9})


def test_versions_are_numbered_whole_and_made_current(models, tmp_path):
    store = HeadStore(tmp_path / "learn")
    assert store.current() is None and store.versions() == []
    first, second = publish(store, models["heads"][0]), publish(store, models["heads"][1])
    assert (first.number, second.number, store.versions()) == (1, 2, [1, 2])
    assert store.current() == second and second.path == tmp_path / "learn" / "heads" / "000002"
    assert (second.path / "head.json").is_file() and "after" in (second.path / "adapt.json").read_text()
    assert not (store.root / ".candidate").exists()
    assert sorted(p.name for p in store.root.iterdir()) == ["000001", "000002", "adapt.lock", "current.json"]
    assert store.root.stat().st_mode & 0o777 == 0o700
    for _ in range(3):
        publish(store, models["heads"][0])
    assert store.versions() == [3, 4, 5] and store.current().number == 5  # the newest KEEP_VERSIONS


def test_one_adapt_run_at_a_time(tmp_path):
    store = HeadStore(tmp_path)
    with store.adapting():
        with pytest.raises(HeadStoreError, match=r"another `specdec adapt` \(pid \d+\) is adapting into"):
            with store.adapting():
                pass
    with store.adapting() as candidate:  # released: the next run goes on
        assert candidate == store.root / ".candidate"


@pytest.mark.parametrize("text", ["{", '{"version": 0}', '{"version": "2"}', "[]"])
def test_a_damaged_current_json_is_named(tmp_path, text):
    store = HeadStore(tmp_path)
    store.root.mkdir(parents=True)
    (store.root / "current.json").write_text(text)
    with pytest.raises(HeadStoreError, match="current.json"):
        store.current()


class Engine:
    """An AsyncEngine's swap_head, recorded."""

    def __init__(self):
        self.swaps = []

    def swap_head(self, drafter, prepared, version: int) -> None:
        drafter.swap_head(prepared)
        self.swaps.append((version, prepared.path))


def test_the_watcher_hands_each_new_version_to_the_engine_and_refuses_what_does_not_load(models, tmp_path, caplog):
    llm = LLM(str(models["target"]), speculative_model=str(models["heads"][0]), dtype="float32")
    drafter = llm.engine.drafter.adaptable()
    store, engine = HeadStore(tmp_path), Engine()
    watcher = HeadWatcher(store, drafter, engine)
    assert watcher.check() is None and engine.swaps == []  # nothing published
    one = publish(store, models["heads"][1])
    assert watcher.check() == 1 and engine.swaps == [(1, one.path)]
    assert watcher.check() is None and watcher.version == 1  # the same version: nothing to do
    in_use = drafter.head
    with caplog.at_level(logging.WARNING, logger="specdec"):
        publish(store, models["heads"][0], damage=True)
        assert watcher.check() is None and watcher.check() is None
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "head version 2 refused" in refusals[0] and "head.safetensors" in refusals[0]
    assert "drafting on with version 1" in refusals[0] and drafter.head is in_use
    three = publish(store, models["heads"][0])  # a good one after it: taken
    assert watcher.check() == 3 and engine.swaps[-1] == (3, three.path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec"):
        (store.root / "current.json").write_text("{")
        assert watcher.check() is None and watcher.check() is None
    assert len([r for r in caplog.records if "current.json" in r.getMessage()]) == 1  # said once
    assert watcher.version == 3


def test_adapt_every_n_recorded_requests_starts_one_run_at_a_time(models, tmp_path, monkeypatch):
    """--adapt-every 4: a `specdec adapt` run into the store once 4 more requests are recorded, at
    the lowest priority, from the head serving while none was adapted; never two at once."""
    from types import SimpleNamespace

    from specdec.serve import head_watcher

    class Run:
        def __init__(self, command, **options):
            self.command, self.options, self.pid, self.returncode = command, options, 1, None

        def poll(self):
            return self.returncode

    monkeypatch.setattr(head_watcher.subprocess, "Popen", Run)
    llm = LLM(str(models["target"]), speculative_model=str(models["heads"][0]), dtype="float32")
    recorder = SimpleNamespace(num_recorded=3, directory=tmp_path)
    watcher = HeadWatcher(
        HeadStore(tmp_path), llm.engine.drafter.adaptable(), Engine(), adapt=("t.gguf", 2.5, recorder, 4)
    )
    watcher._maybe_adapt()
    assert watcher._adapting is None
    recorder.num_recorded = 4
    watcher._maybe_adapt()
    first = watcher._adapting
    assert first.command[1:] == [
        "-m",
        "specdec.cli",
        "adapt",
        "t.gguf",
        "--from",
        str(tmp_path),
        "--minutes",
        "2.5",
        "--head",
        str(models["heads"][0]),
    ]
    assert first.options["preexec_fn"] is head_watcher._lowest_priority
    recorder.num_recorded = 12
    watcher._maybe_adapt()
    assert watcher._adapting is first  # still running: no second run
    first.returncode = 0
    watcher._maybe_adapt()
    assert watcher._adapting is not first and (tmp_path / "heads" / "adapt.log").is_file()
