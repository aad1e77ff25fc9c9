"""Writing a command's output directory without losing anything.

Every command that writes a directory (train, distill, bench, and the ones to come) opens
it with `open_output_dir` before its work and ends with `OutputDir.commit()`:

  refused     an empty --out; a file; a directory that is one of the command's inputs, lies
              inside one or holds one (even with force); an existing non-empty directory that
              is not this command's own earlier output, unless force (it is then replaced
              when the run finishes, never before)
  staging     the run writes into `<out>.incomplete/`, a sibling made at once, so a
              destination that cannot be written fails in the first second, not after hours
              of training; it holds STAGING_MARKER, which the model loader refuses
  commit      renames the staging directory into place; until then `<out>` is untouched, so
              an interrupted or failed run never leaves a directory that loads as a finished
              model (rerunning the command finds its staging directory and resumes)

Terms: *final* is the directory the user named, *staging* its `.incomplete` sibling, and a
command's *own output* is what an earlier run of the same command wrote there (the command
says how to recognise it), which it may resume from and replace.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STAGING_SUFFIX = ".incomplete"
STAGING_MARKER = ".specdec-incomplete.json"  # {"command": ..., "out": ...}
REPLACED_SUFFIX = ".replaced"  # where commit() moves the old final directory until the new one is in place


@dataclass(frozen=True)
class OutputDir:
    """An output directory opened for writing (see the module docstring).

    given: --out as the user wrote it (for messages). final: it, resolved. staging: where
    the run writes. command: the command writing it (e.g. "train").
    """

    given: str
    final: Path
    staging: Path
    command: str

    def commit(self) -> Path:
        """Put the staging directory in place as the final one (replacing what was there) and
        return the final directory."""
        old = None
        if self.final.exists():
            old = self.final.with_name(self.final.name + REPLACED_SUFFIX)
            _remove(old)  # left by a commit interrupted between its renames
            os.replace(self.final, old)
        os.replace(self.staging, self.final)
        (self.final / STAGING_MARKER).unlink()
        if old is not None:
            _remove(old)
        return self.final

    def __enter__(self) -> "OutputDir":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """A run that fails (or is interrupted) before writing anything leaves nothing behind."""
        if error is not None:
            self.discard_if_empty()

    def discard_if_empty(self) -> bool:
        """Remove the staging directory if the run wrote nothing there; whether it did."""
        if self.staging.is_dir() and [p.name for p in self.staging.iterdir()] == [STAGING_MARKER]:
            shutil.rmtree(self.staging)
            return True
        return False

    def clear_staging(self) -> None:
        """Start the staging directory afresh (a run that does not resume)."""
        for entry in self.staging.iterdir():
            if entry.name != STAGING_MARKER:
                _remove(entry)


def open_output_dir(out, command: str, inputs: dict[str, object] | None = None, force: bool = False,
                    is_own_output: Callable[[Path], bool] = lambda path: False) -> OutputDir:
    """Check --out and make its staging directory; raise ValueError naming the problem.

    inputs: {flag: path or None} of what the command reads (models, tokenizers, corpora).
    force: replace an existing directory that is not this command's own output.
    is_own_output(final): whether a non-empty final directory is this command's earlier output.
    """
    given = "" if out is None else str(out)
    if not given.strip():
        raise ValueError(f"--out is empty; give the directory {command} should write")
    final = Path(given).expanduser().resolve()
    if final.exists() and not final.is_dir():
        raise ValueError(f"--out {given!r} is a file; give a directory")
    _check_apart_from_inputs(given, final, inputs or {})
    if final.is_dir() and any(final.iterdir()) and not force and not is_own_output(final):
        raise ValueError(f"--out {given!r} already holds files ({_some_entries(final)}) that are not an earlier "
                         f"`specdec {command}` run's; give a new or empty directory, or pass --force to replace "
                         "it when this run finishes")
    staging = staging_path(final)
    _make_staging(given, staging, command, final)
    return OutputDir(given, final, staging, command)


def staging_path(out) -> Path:
    """Where a run writing --out `out` stages its output: `<out>.incomplete`, beside it."""
    final = Path(out).expanduser().resolve()
    return final.with_name(final.name + STAGING_SUFFIX)


def _check_apart_from_inputs(given: str, final: Path, inputs: dict[str, object]) -> None:
    for flag, path in inputs.items():
        if path is None or not str(path).strip():
            continue
        source = Path(path).expanduser().resolve()
        if final == source:
            relation = "is"
        elif source in final.parents:
            relation = "lies inside"
        elif final in source.parents:
            relation = "holds"
        else:
            continue
        raise ValueError(f"--out {given!r} {relation} {flag} {str(path)!r}, which this command reads; writing there "
                         "would destroy it. Give another --out (and move the result afterwards if you mean to "
                         "replace it)")


def _make_staging(given: str, staging: Path, command: str, final: Path) -> None:
    marker = staging / STAGING_MARKER
    if staging.exists() and not marker.is_file():
        raise ValueError(f"{staging} exists and was not made by specdec; move it away to write --out {given!r}")
    if marker.is_file():
        earlier = _read_marker(marker)
        if earlier != command:
            raise ValueError(f"{staging} holds an unfinished `specdec {earlier}` run; finish it with that command, "
                             f"or remove {staging}, before writing --out {given!r} with `specdec {command}`")
        return
    try:
        staging.mkdir(parents=True)
        marker.write_text(json.dumps({"command": command, "out": str(final)}) + "\n")
    except OSError as e:
        raise ValueError(f"--out {given!r} cannot be written ({e.strerror}: {e.filename}); give a directory you "
                         "can write") from e


def _read_marker(marker: Path) -> str:
    try:
        return str(json.loads(marker.read_text()).get("command"))
    except (OSError, ValueError, AttributeError):
        return "unknown"


def unfinished_output_message(path: Path) -> str | None:
    """What to say of a directory that is a run's staging directory (None if it is not one)."""
    marker = Path(path) / STAGING_MARKER
    if not marker.is_file():
        return None
    return (f"{path} is the unfinished output of a `specdec {_read_marker(marker)}` run (interrupted or failed "
            "before it finished); rerun that command to finish it, then use its --out directory")


def _some_entries(path: Path, limit: int = 4) -> str:
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
