"""A full disk, said in one line: where, how much is free, and what was kept; nothing half-written.

The disk is not filled: the lowest write call of each command (safetensors' save_file, torch.save,
a file's write, pip) is replaced by one that writes part of its file and then fails as that call
fails on a full disk, with the same error object (safetensors' SafetensorError "... No space left
on device (os error 28)", torch's RuntimeError "unexpected pos" from a stream whose write raised
OSError ENOSPC, pip's traceback ending in "[Errno 28] No space left on device").
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from gguf_files import tiny_hf_model, write_gguf
from helpers import save_tiny_model, stdlib_corpus
from specdec.cli import main
from specdec.output_dir import NEARLY_FULL_BYTES, is_disk_full

SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def full_disk_save_file(tensors, filename, metadata=None) -> None:
    """safetensors.torch.save_file on a full disk: part of the file, then its error."""
    Path(filename).write_bytes(b"\0" * 1000)
    raise SafetensorError(SAFETENSORS_FULL)


def one_error_line(err: str) -> str:
    """The one line a command said, checked to be one line and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------- telling a full disk apart


def unexpected_pos_error(cause: BaseException | None) -> RuntimeError:
    """torch.save's error when its stream's write failed: the cause is its context, if any."""
    try:
        try:
            if cause is not None:
                raise cause
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    except RuntimeError as e:
        return e


@pytest.mark.parametrize(
    "error, free, full",
    [
        (OSError(errno.ENOSPC, "No space left on device", "x"), 10**12, True),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "x"), 10**12, True),
        (SafetensorError(SAFETENSORS_FULL), 10**12, True),
        (unexpected_pos_error(OSError(errno.ENOSPC, "No space left on device")), 10**12, True),
        # torch.save to a path says nothing of why: the free space tells
        (unexpected_pos_error(RuntimeError("basic_ios::clear: iostream error")), 1000, True),
        (unexpected_pos_error(RuntimeError("basic_ios::clear: iostream error")), 10**12, False),
        (unexpected_pos_error(None), NEARLY_FULL_BYTES + 1, False),
        (OSError(errno.EACCES, "Permission denied", "x"), 0, False),
        (ValueError("a bad value"), 0, False),
    ],
)
def test_a_full_disk_is_told_from_other_errors(error, free, full, tmp_path, monkeypatch):
    import specdec.output_dir as output_dir

    monkeypatch.setattr(output_dir, "free_bytes", lambda path: free)
    assert is_disk_full(error, tmp_path) is full


# ---------------------------------------------------------------------------- convert


def test_convert_on_a_full_disk_says_so_and_keeps_nothing(tmp_path, capsys, monkeypatch):
    import safetensors.torch

    gguf = write_gguf(tmp_path / "model.gguf", tiny_hf_model("llama"), "F32")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_save_file)
    assert main(["convert", str(gguf), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: no space left on the disk holding {tmp_path / 'out'} while writing the converted")
    assert " MB free); nothing was kept" in line
    assert files_under(tmp_path) == ["model.gguf"]


# ---------------------------------------------------------------------------- train and distill

TINY_TRAINING = ["--context", "32", "--batch-size", "4", "--eval-tokens", "256", "--log-every", "10"]
TINY_TRAINING += ["--device", "cpu", "--seed", "3", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2"]


class FullDiskStream:
    """A file that takes `room` bytes, then fails as a write to a full disk fails."""

    def __init__(self, stream, room: int):
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.stream.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()


def torch_save_fails_at_call(number: int, monkeypatch) -> None:
    """torch.save as on a disk that fills during its number-th call (1: the first)."""
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) != number:
            return real_save(obj, f, *args, **kwargs)
        return real_save(obj, FullDiskStream(f, 5000), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"), ("abc.py", "copy.py", "stat.py"))


def train_args(corpus: Path, out: Path) -> list[str]:
    return ["train", "--corpus", str(corpus), "--out", str(out), "--preset", "tiny", *TINY_TRAINING]


def test_train_on_a_full_disk_keeps_its_last_checkpoint_and_resumes(corpus, tmp_path, capsys, monkeypatch):
    out, staging = tmp_path / "out", tmp_path / "out.incomplete"
    with monkeypatch.context() as patch:
        torch_save_fails_at_call(2, patch)  # the checkpoint of step 4; step 2's is written
        assert main(train_args(corpus, out)) == 2
    line = one_error_line(capsys.readouterr().err)
    checkpoint = staging / "checkpoint" / "last.pt"
    assert line.startswith(
        f"error: no space left on the disk holding {staging} while writing the `specdec train` run ("
    )
    assert line.endswith(
        f"MB free); kept the last checkpoint, {checkpoint}: free some space and rerun the command to resume from it"
    )
    assert not out.exists() and not (staging / "checkpoint" / "last.pt.tmp").exists()  # nothing half-written
    assert torch.load(checkpoint, weights_only=True)["state"]["step"] == 2
    assert main(train_args(corpus, out)) == 0
    assert f"resuming from {checkpoint} (step 2)" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not staging.exists()


def test_train_on_a_full_disk_before_its_first_checkpoint_keeps_nothing(corpus, tmp_path, capsys, monkeypatch):
    torch_save_fails_at_call(1, monkeypatch)
    assert main(train_args(corpus, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "while writing the `specdec train` run" in line
    assert line.endswith(
        "MB free); nothing was kept (the run stopped before its first checkpoint, --checkpoint-every): "
        "free some space and rerun the command, which starts over"
    )
    assert files_under(tmp_path) == []


def test_distill_on_a_full_disk_writing_its_model_keeps_its_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    target = save_tiny_model(tmp_path / "target", "llama", seed=0, init_std=0.2)
    out, staging = tmp_path / "draft", tmp_path / "draft.incomplete"
    draft_size = [
        "--hidden-size",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate-size",
        "64",
    ]
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_save_file)  # the model, after the last checkpoint
    run = ["distill", str(target), "--out", str(out), "--corpus", str(corpus), *draft_size, *TINY_TRAINING]
    assert main(run) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(
        f"error: no space left on the disk holding {staging} while writing the `specdec distill` run"
    )
    assert f"kept the last checkpoint, {staging / 'checkpoint' / 'last.pt'}: free some space" in line
    assert not out.exists() and not list(staging.glob("*.safetensors"))  # no half-written weights
