"""--learn DIR (serve/recorder.py): what a server records of the requests it answered. Finished
answers only, owner-only files, at most max_bytes (the oldest dropped), one server per
directory, another model's directory refused, a full disk a warning that stops recording and
keeps what was written. The server end to end is in test_serve.py."""

from __future__ import annotations

import errno
import json
import logging
import random
import stat

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sequence import Sequence
from specdec.serve.recorder import MANIFEST, Recorder, RecorderError, read_requests, segments

VOCAB = 320


def answered(rng: random.Random, reason: str | None = "length", scope: str | None = None) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))]
    seq = Sequence(f"r{rng.random()}", prompt, SamplingParams(max_tokens=64), torch.Generator(), cache_scope=scope)
    seq.output_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    seq.finish_reason = reason
    return seq


def recorder(directory, max_bytes: int = 10**6, vocab: int = VOCAB) -> Recorder:
    return Recorder(directory, "tiny-target", vocab, max_bytes)


def test_finished_answers_are_recorded_in_order_into_owner_only_files(tmp_path):
    rng = random.Random(3)
    seqs = [answered(rng, reason, scope) for reason, scope in [("length", None), ("stop", "key1"), ("abort", None)]]
    rec = recorder(tmp_path / "learn")
    for seq in seqs:
        rec.record(seq)
    rec.close()
    got = read_requests(tmp_path / "learn")
    assert [(r["prompt"], r["output"], r["finish_reason"], r["scope"]) for r in got] == [
        (s.prompt_token_ids, s.output_token_ids, s.finish_reason, s.cache_scope) for s in seqs[:2]
    ]  # the aborted answer (the client left) is not the target's whole answer
    assert stat.S_IMODE((tmp_path / "learn").stat().st_mode) == 0o700
    for path in (tmp_path / "learn").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert json.loads((tmp_path / "learn" / MANIFEST).read_text())["vocab_size"] == VOCAB


def test_the_record_stays_within_its_bound_dropping_the_oldest(tmp_path):
    rng = random.Random(4)
    seqs = [answered(rng) for _ in range(200)]
    rec = recorder(tmp_path, max_bytes=4000)
    for seq in seqs:
        rec.record(seq)
    rec.close()
    sizes = [path.stat().st_size for _, path in segments(tmp_path)]
    assert sum(sizes) <= 4000 + rec.segment_bytes and len(sizes) > 1
    got = read_requests(tmp_path)
    assert 0 < len(got) < len(seqs)
    assert [r["output"] for r in got] == [s.output_token_ids for s in seqs[-len(got) :]]  # the newest, in order


def test_one_server_per_directory_and_a_restart_goes_on(tmp_path):
    rng = random.Random(5)
    first = recorder(tmp_path)
    with pytest.raises(RecorderError, match=r"another server \(pid \d+\) is recording there"):
        recorder(tmp_path)
    first.record(answered(rng))
    first.close()
    again = recorder(tmp_path)  # the lock is free once the first stopped
    again.record(answered(rng))
    again.close()
    assert len(read_requests(tmp_path)) == 2 and len(segments(tmp_path)) == 2


def test_another_models_directory_is_refused(tmp_path):
    recorder(tmp_path).close()
    with pytest.raises(RecorderError, match="holds traffic recorded for another model .* 320 tokens; this one has 999"):
        recorder(tmp_path, vocab=999)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(RecorderError, match="is unreadable"):
        recorder(tmp_path)


def test_a_full_disk_stops_recording_with_a_warning_and_keeps_what_was_written(tmp_path, monkeypatch, caplog):
    rng = random.Random(6)
    rec = recorder(tmp_path)
    rec.record(answered(rng))
    rec.close()
    rec = recorder(tmp_path)

    def full(line):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rec, "_write", full)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        for _ in range(3):
            rec.record(answered(rng))
        rec.close()
    assert not rec.recording and rec.num_recorded == 0
    assert caplog.text.count("(the disk is full)") == 1 and "goes on serving" in caplog.text
    assert len(read_requests(tmp_path)) == 1


def test_bad_places_and_sizes_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RecorderError, match="cannot record there"):
        recorder(tmp_path / "file" / "learn")
    with pytest.raises(RecorderError, match="--learn-max-gb must be above 0"):
        recorder(tmp_path, max_bytes=0)
    with pytest.raises(FileNotFoundError, match="holds no recorded traffic"):
        read_requests(tmp_path)
