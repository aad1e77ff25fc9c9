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
from safetensors import SafetensorError

from gguf_files import tiny_hf_model, write_gguf
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
