"""The versions of a head adapted to what a server serves (issue 50), kept beside the record they
learn from: DIR/heads/ of `specdec serve MODEL --learn DIR`.

DIR/heads/
  000001/, 000002/, ...  each a head's directory (head.json, head.safetensors, adapt's files) and
                         adapt.json: what `specdec adapt` measured on held-out requests before
                         and after, and the head it started from. Never changed once written;
                         the newest KEEP_VERSIONS are kept, older ones deleted as new ones come.
  current.json           {"version": N}: the version servers draft with. Replaced at once
                         (os.replace) after version N's directory is whole, so a reader sees the
                         old version or the new one, never half of one.
  adapt.lock             held (flock) by the `specdec adapt` running into the store: one at a time
  .candidate/            that run's output while it trains (a run killed part way resumes from
  .candidate.features/   it, and from the target's features over the record beside it); it
                         becomes the next version only where it beats the head it started from
                         on the held-out requests, else it is deleted; the features are deleted
                         once the run ends

A server learning into DIR (serve/head_watcher.py) drafts with the current version, swapped in
between rounds. Deleting DIR/heads deletes every version: a server then keeps the head it has,
and after a restart drafts with the one it was given.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.output_dir import lock_exclusively

HEADS, CURRENT, LOCK, CANDIDATE, REPORT = "heads", "current.json", "adapt.lock", ".candidate", "adapt.json"
VERSION_NAME = re.compile(r"\d{6}")
KEEP_VERSIONS = 3  # the current version and the two before it (a head is ~60 MB)


class HeadStoreError(ValueError):
    """The store cannot be read or written: a damaged current.json, another adapt running."""


@dataclass(frozen=True)
class HeadVersion:
    number: int  # 1, 2, ...: 0 is the head a server started with, never in the store
    path: Path


class HeadStore:
    """DIR/heads/ of the record in directory (the module's docstring)."""

    def __init__(self, directory: str | Path):
        self.root = Path(directory).expanduser() / HEADS

    def current(self) -> HeadVersion | None:
        """The version servers draft with; None where none was published. Raises HeadStoreError
        where current.json is damaged."""
        file = self.root / CURRENT
        try:
            data = json.loads(file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise HeadStoreError(f"{file} cannot be read ({e}); publish a version again with `specdec adapt`") from e
        number = data.get("version") if isinstance(data, dict) else None
        if type(number) is not int or number < 1:
            raise HeadStoreError(f"{file} names no version (got {data!r}); publish one again with `specdec adapt`")
        return HeadVersion(number, self.version_path(number))

    def version_path(self, number: int) -> Path:
        return self.root / f"{number:06d}"

    def versions(self) -> list[int]:
        """The versions written, ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if VERSION_NAME.fullmatch(p.name) and p.is_dir())

    @contextlib.contextmanager
    def adapting(self) -> Iterator[Path]:
        """The store made (owner-only) and held for one adapt run: yields the candidate's
        directory. Raises HeadStoreError where another run holds the store."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = os.fdopen(os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600), "r+")
        holder = lock.read().strip() or "unknown"
        if not lock_exclusively(lock):
            raise HeadStoreError(
                f"another `specdec adapt` (pid {holder}) is adapting into {self.root}: wait for it to finish"
            )
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(str(os.getpid()))
            lock.flush()
            yield self.root / CANDIDATE
        finally:
            lock.close()

    def publish(self, candidate: Path, report: dict) -> HeadVersion:
        """candidate (a head's directory, in the store: adapting()'s) as the next version, with
        report in its adapt.json, made current. Call inside adapting()."""
        number = max(self.versions(), default=0) + 1
        (candidate / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        path = self.version_path(number)
        os.rename(candidate, path)
        staged = self.root / f".{CURRENT}.{os.getpid()}"
        with open(staged, "w") as out:
            out.write(json.dumps({"version": number}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(staged, self.root / CURRENT)
        for old in self.versions()[:-KEEP_VERSIONS]:
            shutil.rmtree(self.version_path(old), ignore_errors=True)
        return HeadVersion(number, path)

    def discard(self, candidate: Path) -> None:
        """A candidate that did not beat the head it started from, deleted."""
        shutil.rmtree(candidate, ignore_errors=True)

    def drop_features(self, candidate: Path) -> None:
        """The features of a run that ended (recomputed by the next one over the grown record)."""
        shutil.rmtree(candidate.with_name(candidate.name + ".features"), ignore_errors=True)
