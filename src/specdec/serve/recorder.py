"""`specdec serve MODEL --learn DIR`: the record of what the server answered, for `specdec adapt`
to fine-tune the drafter on (issue 50). Nothing is recorded without the flag.

DIR/
  manifest.json            what is recorded: the format, the target (its path and vocabulary size)
  requests-000001.jsonl    one JSON line per finished request (finish_reason "stop" or "length"),
  requests-000002.jsonl    in the order they finished: {"prompt": [token ids], "output": [token ids],
  ...                      "finish_reason": ..., "time": unix seconds, "scope": its API key's place
                           ("key0", ...) or null}; a segment is closed once it holds segment_bytes
  recorder.lock            held (flock) by the server recording: a second server is refused

Token ids only. The target's features a head learns from (EAGLE-3 reads three layers: 3 x hidden
x 2 bytes a token, 9 KiB for a 1.5B model, against 4 bytes an id) are recomputed by adapt, in a
prefill of the recorded text, instead of stored.

The user's data: the directory is the owner's alone (0700, its files 0600); it holds at most
max_bytes, the oldest segment deleted first; a restart goes on where the last run stopped (the
segments kept); deleting the directory deletes the record. Recording never fails a request: the
engine's thread hands each finished request to a queue, and a thread of the recorder's own writes
it; a write that fails (a full disk, say) is one warning, and recording stops while serving goes
on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path

from specdec.output_dir import lock_exclusively
from specdec.sequence import Sequence

log = logging.getLogger("specdec")

FORMAT = "specdec-traffic-1"
MANIFEST, LOCK = "manifest.json", "recorder.lock"
SEGMENT = re.compile(r"requests-(\d{6})\.jsonl")
RECORDED_REASONS = (
    "stop",
    "length",
)  # a finished answer; an aborted one (the client left) is not the target's whole answer
MAX_SEGMENT_BYTES = 64 << 20


class RecorderError(ValueError):
    """DIR cannot be recorded into: in use by another server, another model's, or not writable."""


class Recorder:
    """Records finished requests into directory (the module's docstring) for the target at
    target_path of vocab_size tokens, keeping at most max_bytes. record() is the engine's
    listener (Engine.finish_listeners); close() writes what is queued and releases the lock."""

    def __init__(self, directory: Path | str, target_path: str, vocab_size: int, max_bytes: int):
        if max_bytes < 1:
            raise RecorderError(f"--learn-max-gb must be above 0, got {max_bytes / 1e9:g}")
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.segment_bytes = max(1, min(MAX_SEGMENT_BYTES, max_bytes // 8))
        self._lock = _locked(self.directory)
        try:
            _check_manifest(self.directory, {"format": FORMAT, "target": str(target_path), "vocab_size": vocab_size})
        except BaseException:
            self._lock.close()
            raise
        self.recording = True
        self.num_recorded = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._segment = None
        self._closed: list[tuple[Path, int]] = []  # the segments written before the open one, oldest first
        self._thread = threading.Thread(target=self._write_queued, name="specdec-recorder", daemon=True)
        self._thread.start()

    def record(self, seq: Sequence) -> None:
        """Queue seq's prompt and output if it finished with the target's whole answer."""
        if self.recording and seq.finish_reason in RECORDED_REASONS:
            entry = {
                "prompt": list(seq.prompt_token_ids),
                "output": list(seq.output_token_ids),
                "finish_reason": seq.finish_reason,
                "time": round(time.time(), 3),
                "scope": seq.cache_scope,
            }
            self._queue.put(entry)

    def close(self) -> None:
        """Write what is queued, then stop and release the directory."""
        self._queue.put(None)
        self._thread.join()
        self._lock.close()

    def _write_queued(self) -> None:
        while (entry := self._queue.get()) is not None:
            if not self.recording:
                continue
            try:
                self._write(json.dumps(entry, separators=(",", ":")) + "\n")
                self.num_recorded += 1
            except OSError as e:
                self.recording = False
                full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
                log.warning(
                    "recording into %s stopped%s: %s; the server goes on serving, and what was recorded is kept",
                    self.directory,
                    full,
                    e,
                )
        if self._segment is not None:
            self._segment.close()

    def _write(self, line: str) -> None:
        data = line.encode()
        if self._segment is None or self._segment.tell() + len(data) > self.segment_bytes:
            self._next_segment()
        assert self._segment is not None
        self._segment.write(data)
        self._segment.flush()
        self._drop_oldest()

    def _next_segment(self) -> None:
        """Close the segment being written and open the next; the closed ones, with their sizes,
        read once here (the directory is listed at each new segment, not at each request)."""
        if self._segment is not None:
            self._segment.close()
        found = segments(self.directory)
        self._closed = [(path, path.stat().st_size) for _, path in found]  # oldest first
        path = self.directory / f"requests-{found[-1][0] + 1 if found else 1:06d}.jsonl"
        self._segment = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")

    def _drop_oldest(self) -> None:
        """The oldest closed segments deleted while they and the one being written hold more
        than max_bytes (the one being written is kept)."""
        assert self._segment is not None
        total = sum(size for _, size in self._closed) + self._segment.tell()
        while self._closed and total > self.max_bytes:
            path, size = self._closed.pop(0)
            path.unlink()
            total -= size


def segments(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of directory's segments, oldest first."""
    found = []
    for path in directory.iterdir():
        match = SEGMENT.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_requests(directory: Path | str) -> list[dict]:
    """Every request recorded in directory, oldest first (a line cut short by a crash left out)."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise FileNotFoundError(f"{directory} holds no recorded traffic ({MANIFEST} missing): record some with --learn")
    requests = []
    for _, path in segments(directory):
        for line in path.read_text().splitlines():
            try:
                requests.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return requests


def _locked(directory: Path):
    """directory made (owner-only) and its lock held, or RecorderError naming who holds it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        lock = os.fdopen(os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    except OSError as e:
        raise RecorderError(
            f"--learn {directory}: cannot record there ({e.strerror}): give a directory you can write"
        ) from e
    holder = lock.read().strip() or "unknown"  # the pid the holder wrote, if any
    if not lock_exclusively(lock):
        raise RecorderError(
            f"--learn {directory}: another server (pid {holder}) is recording there: give each server its own directory"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _check_manifest(directory: Path, manifest: dict) -> None:
    """The manifest written, or the one there checked to be the same target's."""
    path = directory / MANIFEST
    if path.is_file():
        try:
            found = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RecorderError(
                f"--learn {directory}: its {MANIFEST} is unreadable ({e}): give another directory"
            ) from e
        if found.get("format") != FORMAT or found.get("vocab_size") != manifest["vocab_size"]:
            raise RecorderError(
                f"--learn {directory} holds traffic recorded for another model ({found.get('target')!r}, "
                f"{found.get('vocab_size')} tokens; this one has {manifest['vocab_size']}): give another directory"
            )
        return
    staged = directory / f".{MANIFEST}.tmp"
    with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        json.dump(manifest, out, indent=1)
    os.replace(staged, path)
