"""Writing a command's output directory without losing anything.

Every command that writes a directory (train, distill, bench, and the ones to come) opens
it with `open_output_dir` before its work and ends with `OutputDir.commit()`:

  refused     an empty --out; a file; a directory that is one of the command's inputs, lies
              inside one or holds one, or is (or holds) the current or the home directory
              (even with force); an existing non-empty directory that is not this command's own
              earlier output, or holds files besides that output's, unless force (it is then
              replaced when the run finishes, never before); a directory another run is
              writing (its staging directory is locked while the run lasts)
  staging     the run writes into `<out>.incomplete/`, a sibling made at once, so a
              destination that cannot be written fails in the first second, not after hours
              of training; it holds STAGING_MARKER, which the model loader refuses
  commit      renames the staging directory into place; until then `<out>` is untouched, so
              an interrupted or failed run never leaves a directory that loads as a finished
              model (rerunning the command finds its staging directory and resumes)

Terms: *final* is the directory the user named, *staging* its `.incomplete` sibling, and a
command's *own output* is what an earlier run of the same command wrote there (the command
says how to recognise it and what such a run writes), which it may resume from and replace.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

STAGING_SUFFIX = ".incomplete"
STAGING_MARKER = ".specdec-incomplete.json"  # {"command": ..., "out": ...}
REPLACED_SUFFIX = ".replaced"  # where commit() moves the old final directory until the new one is in place


@dataclass(frozen=True)
class OutputDir:
    """An output directory opened for writing (see the module docstring).

    given: --out as the user wrote it (for messages). final: it, resolved. staging: where
    the run writes. command: the command writing it (e.g. "train"). lock: the staging
    marker, open and locked while this run writes.
    """

    given: str
    final: Path
    staging: Path
    command: str
    lock: IO = field(repr=False, compare=False)

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
        self.lock.close()
        if old is not None:
            _remove(old)
        return self.final

    def __enter__(self) -> "OutputDir":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """A run that fails (or is interrupted) before writing anything leaves nothing behind;
        the lock goes with the run."""
        if error is not None:
            self.discard_if_empty()
        self.lock.close()

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
                    is_own_output: Callable[[Path], bool] = lambda path: False,
                    own_entries: tuple[str, ...] = ()) -> OutputDir:
    """Check --out and make (and lock) its staging directory; raise ValueError naming the problem.

    inputs: {flag: path or None} of what the command reads (models, tokenizers, corpora) or
        writes elsewhere.
    force: replace an existing directory that is not this command's own output.
    is_own_output(final): whether a non-empty final directory is this command's earlier output.
    own_entries: name patterns (fnmatch) of what such an output holds; anything else in it is
        the user's, and makes it a directory of other files.
    """
    given = "" if out is None else str(out)
    if not given.strip():
        raise ValueError(f"--out is empty; give the directory {command} should write")
    final = Path(given).expanduser().resolve()
    if final.exists() and not final.is_dir():
        raise ValueError(f"--out {given!r} is a file; give a directory")
    _check_apart_from_inputs(given, final, inputs or {})
    _check_not_a_home(given, final)
    if final.is_dir() and any(final.iterdir()) and not force:
        _check_replaceable(given, final, command, is_own_output, own_entries)
    staging = staging_path(final)
    return OutputDir(given, final, staging, command, _make_staging(given, staging, command, final))


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
        raise ValueError(f"--out {given!r} {relation} {flag} {str(path)!r}: writing there would destroy it. Give "
                         "another --out (and move the result afterwards if you mean to replace it)")


def _check_not_a_home(given: str, final: Path) -> None:
    """Refuse to replace the current or the home directory, or a directory holding either."""
    for name, place in (("the current directory", Path.cwd().resolve()), ("your home directory",
                                                                          Path.home().resolve())):
        if final == place or final in place.parents:
            raise ValueError(f"--out {given!r} {'is' if final == place else 'holds'} {name}, which an output "
                             "directory would replace; give a new directory for the output")


def _check_replaceable(given: str, final: Path, command: str, is_own_output: Callable[[Path], bool],
                       own_entries: tuple[str, ...]) -> None:
    """A non-empty --out may be replaced without force only when it is this command's own
    output and holds nothing else."""
    names = sorted(p.name for p in final.iterdir())
    if not is_own_output(final):
        raise ValueError(f"--out {given!r} already holds files ({_some(names)}) that are not an earlier "
                         f"`specdec {command}` run's; give a new or empty directory, or pass --force to replace "
                         "it when this run finishes")
    others = [name for name in names if not any(fnmatch.fnmatch(name, pattern) for pattern in own_entries)]
    if others:
        raise ValueError(f"--out {given!r} holds an earlier `specdec {command}` run, and also {_some(others)}, which "
                         "that run did not write and this one would replace; move them away, or pass --force")


def _make_staging(given: str, staging: Path, command: str, final: Path) -> IO:
    """Make (or reopen, for a run that resumes) the staging directory; return its marker,
    open and locked."""
    marker = staging / STAGING_MARKER
    if staging.exists() and not marker.is_file():
        raise ValueError(f"{staging} exists and was not made by specdec; move it away to write --out {given!r}")
    if marker.is_file() and _read_marker(marker) != command:
        raise ValueError(f"{staging} holds an unfinished `specdec {_read_marker(marker)}` run; finish it with that "
                         f"command, or remove {staging}, before writing --out {given!r} with `specdec {command}`")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        lock = open(marker, "a+")
    except OSError as e:
        raise ValueError(f"--out {given!r} cannot be written ({e.strerror}: {e.filename}); give a directory you "
                         "can write") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ValueError(f"another specdec run is writing --out {given!r} (in {staging}); wait for it to finish, or "
                         "give another --out") from None
    if os.path.getsize(marker) == 0:
        lock.write(json.dumps({"command": command, "out": str(final)}) + "\n")
        lock.flush()
    return lock


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


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
