"""Writing a command's output directory without losing anything.

Every command that writes a directory (train, distill, bench, and the ones to come) opens
it with `open_output_dir` before its work and ends with `OutputDir.commit()`:

  refused     an empty --out; a file; a name ending in .incomplete or .replaced (specdec's
              working directories); a directory that is one of the command's inputs, lies
              inside one or holds one; the current or home directory, one holding either,
              the filesystem's root or a non-empty directory right under it, a mount point
              (all of these even with force); an existing non-empty directory that is not this command's own earlier
              output, or holds files besides that output's (even inside its subdirectories),
              unless force, which replaces it when the run finishes, never before, and never
              a repository (a directory holding .git); a directory another run is writing (its
              staging directory is locked while that run lasts)
  staging     the run writes into `<out>.incomplete/`, a sibling made at once, so a
              destination that cannot be written fails in the first second, not after hours
              of training; it holds STAGING_MARKER, which the model loader refuses
  commit      moves `<out>` (if any) aside to `<out>.replaced`, renames the staging directory
              into place, removes the marker, then the old directory; until then `<out>` is
              untouched, so an interrupted or failed run never leaves a directory that loads as
              a finished model. Rerunning the command finds its staging directory and resumes
              (a resumable command), or starts afresh; a commit cut short between its renames
              is finished by the next run of the same command
  a full disk a write that fails for want of space (errno ENOSPC, or a library's error that
              wraps it: safetensors' SafetensorError, torch.save's "unexpected pos") is said in
              one line by `said_when_disk_full`: where, how much is free, and what was kept

A directory a command writes into as it goes, with no staging (a store it resumes: train-heads'
--features), is checked by the same rules with `check_written_in_place`; force there writes the
command's files beside the others instead of replacing the directory.

Terms: *final* is the directory the user named, *staging* its `.incomplete` sibling, and a
command's *own output* is what an earlier run of the same command wrote there (the command
says how to recognise it and which files such a run writes), which it may resume from and
replace.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STAGING_SUFFIX = ".incomplete"
REPLACED_SUFFIX = ".replaced"  # where commit() moves the old final directory until the new one is in place
STAGING_MARKER = ".specdec-incomplete.json"  # {"command": ..., "out": ..., "resumable": ...}
NAME_MAX = 255  # the longest file name Linux file systems take
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota spent
FULL_DISK_WORDS = ("No space left on device", "os error 28", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")
NEARLY_FULL_BYTES = 64 * 1024 * 1024  # less free than this, and a write that failed for no stated cause is the disk's
FAILED_WRITE_WORDS = ("unexpected pos", "file write failed", "I/O error", "iostream error")  # torch's, safetensors'


@dataclass(frozen=True)
class OutputDir:
    """An output directory opened for writing (see the module docstring).

    given: --out as the user wrote it (for messages). final: it, resolved. staging: where
    the run writes. command: the command writing it (e.g. "train"). resumable: whether a
    later run resumes from what this one leaves in staging (else a failed run removes it).
    lock: the staging marker, open and locked while this run writes.
    """

    given: str
    final: Path
    staging: Path
    command: str
    resumable: bool
    lock: IO = field(repr=False, compare=False)

    @property
    def replaced(self) -> Path:
        return _sibling(self.final, REPLACED_SUFFIX)

    def commit(self) -> Path:
        """Put the staging directory in place as the final one (replacing what was there) and
        return the final directory."""
        if self.replaced.exists():  # made since the run began: whose it is, is not known
            raise ValueError(
                f"{self.replaced} appeared while this run wrote; move it away and rerun the command to "
                f"finish (the finished output waits in {self.staging})"
            )
        replacing = self.final.exists()
        try:
            if replacing:
                os.replace(self.final, self.replaced)
            os.replace(self.staging, self.final)
        except OSError as e:
            raise ValueError(
                f"the finished output could not be moved into place ({e.strerror}: {e.filename}); it is "
                f"complete in {self.staging}, and {self.given!r} is "
                f"{'in ' + str(self.replaced) if self.replaced.exists() else 'untouched'}"
            ) from e
        (self.final / STAGING_MARKER).unlink()
        self.lock.close()
        if replacing:
            _remove(self.replaced)
        return self.final

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """A run that fails (or is interrupted) leaves nothing behind unless a later run can
        resume from it; the lock goes with the run."""
        if error is not None and self.staging.is_dir():
            if not self.resumable:
                shutil.rmtree(self.staging)
            else:
                self.discard_if_empty()
        self.lock.close()

    def discard_if_empty(self) -> bool:
        """Remove the staging directory if the run wrote no file there (a run stopped before its
        first checkpoint leaves the empty directory it was to go in); whether it did."""
        if not self.staging.is_dir():
            return False
        marker = self.staging / STAGING_MARKER
        written = [p for p in self.staging.rglob("*") if p != marker and not _is_real_dir(p)]
        if written:
            return False
        shutil.rmtree(self.staging)
        return True

    def clear_staging(self) -> None:
        """Start the staging directory afresh (a run that does not resume)."""
        for entry in self.staging.iterdir():
            if entry.name != STAGING_MARKER:
                _remove(entry)


def open_output_dir(
    out,
    command: str,
    inputs: dict[str, str | os.PathLike | None] | None = None,
    force: bool = False,
    is_own_output: Callable[[Path], bool] = lambda path: False,
    own_entries: tuple[str, ...] = (),
    resumable: bool = True,
) -> OutputDir:
    """Check --out and make (and lock) its staging directory; raise ValueError naming the problem.

    inputs: {flag: path or None} of what the command reads (models, tokenizers, corpora) or
        writes elsewhere.
    force: replace an existing directory that is not this command's own output.
    is_own_output(final): whether a non-empty final directory is this command's earlier output.
    own_entries: patterns (fnmatch, of paths relative to it) of the files such an output
        holds; any other file in it is the user's, and makes it a directory of other files.
    resumable: whether the command resumes from an interrupted run's staging directory.
    """
    given = "" if out is None else str(out)
    if not given.strip():
        raise ValueError(f"--out is empty; give the directory {command} should write")
    final = Path(given).expanduser().resolve()
    staging, replaced = _sibling(final, STAGING_SUFFIX), _sibling(final, REPLACED_SUFFIX)
    _check_name(given, final)
    if final.exists() and not final.is_dir():
        raise ValueError(f"--out {given!r} is a file; give a directory")
    for place, label in (
        (final, ""),
        (staging, f"'s staging directory {staging}"),
        (replaced, f"'s replacement directory {replaced}"),
    ):
        _check_apart_from_inputs(f"--out {given!r}{label}", place, inputs or {})
    _check_not_a_system_place(given, final)
    _finish_interrupted_commit(given, final, staging, command)
    if final.is_dir() and any(final.iterdir()):
        _check_replaceable(given, final, command, force, is_own_output, own_entries)
    if replaced.exists():
        raise ValueError(
            f"{replaced} exists (a replacement of --out {given!r} cut short, or a directory of yours); "
            "move or remove it before writing --out"
        )
    lock = _make_staging(given, staging, command, final, resumable)
    return OutputDir(given, final, staging, command, resumable, lock)


def check_written_in_place(
    given,
    flag: str,
    command: str,
    inputs: dict[str, str | os.PathLike | None],
    force: bool = False,
    is_own_output: Callable[[Path], bool] = lambda path: False,
    own_entries: tuple[str, ...] = (),
) -> Path:
    """Check a directory a command writes into as it goes, with no staging directory (a store it
    resumes, such as train-heads' --features), by --out's rules (the module docstring) and return
    it resolved; raise ValueError naming the problem. flag: its flag, for messages; the other
    arguments as open_output_dir's. Refused: an empty name, a file, a directory that is one of
    inputs, lies inside one or holds one, the current or home directory, one holding either, the
    root or a non-empty directory under it (all of these even with force); a non-empty directory
    that is not this command's own (is_own_output) or holds other files (own_entries), unless
    force, which writes this command's files into it beside the others, never into a repository."""
    given = "" if given is None else str(given)
    if not given.strip():
        raise ValueError(f"{flag} is empty; give the directory {command} should write")
    final = Path(given).expanduser().resolve()
    if final.exists() and not final.is_dir():
        raise ValueError(f"{flag} {given!r} is a file; give a directory")
    _check_apart_from_inputs(f"{flag} {given!r}", final, inputs, flag)
    _check_not_a_system_place(given, final, flag, renamed=False)
    if final.is_dir() and any(final.iterdir()):
        _check_replaceable(given, final, command, force, is_own_output, own_entries, flag, in_place=True)
    return final


def staging_path(out) -> Path:
    """Where a run writing --out `out` stages its output: `<out>.incomplete`, beside it."""
    return _sibling(Path(out).expanduser().resolve(), STAGING_SUFFIX)


def _sibling(final: Path, suffix: str) -> Path:
    return final.with_name(final.name + suffix)


def unfinished_output_message(path: Path) -> str | None:
    """What to say of a directory that is a run's staging directory (None if it is not one)."""
    marker = Path(path) / STAGING_MARKER
    if not marker.is_file():
        return None
    return (
        f"{path} is the unfinished output of a `specdec {_read_marker(marker).get('command')}` run (interrupted "
        "or failed before it finished); rerun that command to finish it, then use its --out directory"
    )


def _check_name(given: str, final: Path) -> None:
    if final.name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)):
        raise ValueError(
            f"--out {given!r}: names ending in {STAGING_SUFFIX} or {REPLACED_SUFFIX} are specdec's "
            "working directories; give the directory's own name"
        )
    if len(os.fsencode(final.name + STAGING_SUFFIX)) > NAME_MAX:
        raise ValueError(
            f"--out {given!r}: its name is too long to stage beside it as {final.name[:20]}..."
            f"{STAGING_SUFFIX}; give a name of at most {NAME_MAX - len(STAGING_SUFFIX)} bytes"
        )


def _finish_interrupted_commit(given: str, final: Path, staging: Path, command: str) -> None:
    """A final directory that still holds the staging marker, with no staging directory beside
    it, is a commit cut short after its rename: the output is whole, only the marker is left."""
    marker = final / STAGING_MARKER
    if not marker.is_file() or staging.exists():
        return
    earlier = _read_marker(marker).get("command")
    if earlier != command:
        raise ValueError(
            f"--out {given!r} is the output of a `specdec {earlier}` run whose last step was cut short; "
            f"rerun that command to finish it"
        )
    marker.unlink()


def _check_apart_from_inputs(
    what: str, place: Path, inputs: dict[str, str | os.PathLike | None], flag: str = "--out"
) -> None:
    for name, path in inputs.items():
        if path is None or not str(path).strip():
            continue
        source = Path(path).expanduser().resolve()
        if place == source:
            relation = "is"
        elif source in place.parents:
            relation = "lies inside"
        elif place in source.parents:
            relation = "holds"
        else:
            continue
        raise ValueError(
            f"{what} {relation} {name} {str(path)!r}: writing there would destroy it. Give another "
            f"{flag} (and move the result afterwards if you mean to replace it)"
        )


def _check_not_a_system_place(given: str, final: Path, flag: str = "--out", renamed: bool = True) -> None:
    """Refuse to replace the current or home directory, a directory holding either, the root
    or a non-empty directory right under it; and (renamed: the output is renamed into place) a
    mount point, which a rename cannot move."""
    for name, place in (
        ("the current directory", Path.cwd().resolve()),
        ("your home directory", Path.home().resolve()),
    ):
        if final == place or final in place.parents:
            raise ValueError(
                f"{flag} {given!r} {'is' if final == place else 'holds'} {name}, which an output "
                "directory would replace; give a new directory for the output"
            )
    if len(final.parts) <= 2 and final.is_dir() and any(final.iterdir()):
        raise ValueError(
            f"{flag} {given!r} is {final}, a system directory an output would replace; give a new "
            "directory for the output"
        )
    if renamed and final.is_dir() and os.path.ismount(final):
        raise ValueError(
            f"--out {given!r} is a mount point, which cannot be renamed into place when the run "
            f"finishes; give a directory inside it, e.g. {final / 'out'}"
        )


def _check_replaceable(
    given: str,
    final: Path,
    command: str,
    force: bool,
    is_own_output: Callable[[Path], bool],
    own_entries: tuple[str, ...],
    flag: str = "--out",
    in_place: bool = False,
) -> None:
    """A non-empty --out (flag) may be replaced without force only when it is this command's own
    output and holds nothing else; with force, never when it is a repository. in_place: the
    command writes into the directory (force then writes beside the other files) instead of
    replacing it."""
    forced = "write this run's files beside them" if in_place else "replace the whole directory when this run finishes"
    if force:
        if (final / ".git").exists():
            raise ValueError(
                f"{flag} {given!r} is a repository (it holds .git); --force never "
                f"{'writes into' if in_place else 'replaces'} one: give a "
                "new directory for the output"
            )
        return
    names = sorted(p.name for p in final.iterdir())
    if not is_own_output(final):
        raise ValueError(
            f"{flag} {given!r} already holds files ({_some(names)}) that are not an earlier "
            f"`specdec {command}` run's; give a new or empty directory, or pass --force to {forced}"
        )
    files = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if not p.is_dir() or p.is_symlink())
    others = [name for name in files if not any(fnmatch.fnmatch(name, pattern) for pattern in own_entries)]
    if others:
        raise ValueError(
            f"{flag} {given!r} holds an earlier `specdec {command}` run, and also {_some(others)}, which "
            f"that run did not write{'' if in_place else ' and this one would replace'}; move them away, or pass "
            f"--force{' to ' + forced if in_place else ''}"
        )


def _make_staging(given: str, staging: Path, command: str, final: Path, resumable: bool) -> IO:
    """Make (or reopen, for a run that resumes) the staging directory; return its marker,
    open and locked."""
    marker = staging / STAGING_MARKER
    if staging.exists() and not marker.is_file():
        raise ValueError(f"{staging} exists and was not made by specdec; move it away to write --out {given!r}")
    earlier = _read_marker(marker) if marker.is_file() else {"command": command}
    if earlier.get("command") != command:
        what = "could be resumed" if earlier.get("resumable", True) else "cannot be resumed: remove it"
        raise ValueError(
            f"{staging} holds an unfinished `specdec {earlier.get('command')}` run ({what}); finish it "
            f"with that command, or remove {staging}, before writing --out {given!r} with "
            f"`specdec {command}`"
        )
    try:
        staging.mkdir(parents=True, exist_ok=True)
        lock = open(marker, "a+")
    except OSError as e:
        raise ValueError(
            f"--out {given!r} cannot be written ({e.strerror}: {e.filename}); give a directory you can write"
        ) from e
    if not lock_exclusively(lock):
        raise ValueError(
            f"another specdec run is writing --out {given!r} (in {staging}); wait for it to finish, or "
            "give another --out"
        ) from None
    if os.path.getsize(marker) == 0:
        lock.write(json.dumps({"command": command, "out": str(final), "resumable": resumable}) + "\n")
        lock.flush()
    return lock


def lock_exclusively(file: IO) -> bool:
    """Whether this process now holds file's exclusive lock (flock; released when the file is
    closed, or the process ends); False, and file closed, where another process holds it."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        file.close()
        return False
    return True


def _read_marker(marker: Path) -> dict:
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {"command": "unknown"}
    return data if isinstance(data, dict) else {"command": "unknown"}


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---------------------------------------------------------------------------- a full disk


class DiskFullError(OSError):
    """A write that failed for want of space, said in one line (see said_when_disk_full)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


def is_disk_full(error: BaseException, path: str | os.PathLike) -> bool:
    """Whether error is a write under path that failed for want of space: errno ENOSPC (or EDQUOT)
    anywhere in its chain of causes, those words in a library's message (safetensors says "No space
    left on device (os error 28)"), or a write that failed without saying why (torch.save's
    "unexpected pos") while the disk holding path has less than NEARLY_FULL_BYTES free."""
    chain = list(_causes(error))
    if any(isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS for e in chain):
        return True
    if any(words in str(e) for e in chain for words in FULL_DISK_WORDS):
        return True
    failed_write = any(words in str(e) for e in chain for words in FAILED_WRITE_WORDS)
    free = free_bytes(path)
    return failed_write and free is not None and free < NEARLY_FULL_BYTES


def _causes(error: BaseException) -> Iterator[BaseException]:
    """error, then what it was raised from or while handling, and so on (each once)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def free_bytes(path: str | os.PathLike) -> int | None:
    """The bytes free to this user on the disk holding path (or its nearest existing parent);
    None if that cannot be read."""
    place = Path(path).expanduser().absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return shutil.disk_usage(place).free
    except OSError:
        return None


def disk_full_message(path: str | os.PathLike, writing: str, kept: str) -> str:
    """One line: no space where path lies, what was being written, how much is free, what was kept."""
    free = free_bytes(path)
    free_text = "free space unknown" if free is None else f"{free / 1e6:,.{1 if free < 10e6 else 0}f} MB free"
    return f"no space left on the disk holding {path} while writing {writing} ({free_text}); {kept}"


@contextmanager
def said_when_disk_full(path: str | os.PathLike, writing: str, kept: Callable[[], str]) -> Iterator[None]:
    """Turn an error of a full disk under path (is_disk_full) into a DiskFullError saying, in one
    line, where, what was being written (writing), how much is free and what was kept (kept(), asked
    once the error has happened: after the command has cleaned up); other errors pass through."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not is_disk_full(e, path):
            raise
        raise DiskFullError(disk_full_message(path, writing, kept())) from e
