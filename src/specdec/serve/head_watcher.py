"""`serve --learn DIR`: the server drafts with DIR/heads' current version (head_store.py), swapped
in while it runs.

A thread of the watcher's own polls DIR/heads/current.json every poll_seconds. A version newer
than the one in use is loaded and prepared there (EagleDrafter.load_version; the engine's thread
goes on stepping meanwhile), then handed to the engine's thread, which swaps it in between two
steps (AsyncEngine.swap_head): no round sees two heads, and no output changes (a draft never
changes one). A version that does not load (damaged files, a head for another model, of another
shape or reading other layers) is refused by name in one warning and never tried again; the head
in use stays. Version 0 is the head the server started with.

With adapt_every N, the watcher also starts `specdec adapt MODEL --from DIR` (into the store, at
the lowest CPU priority: nice 19) once N requests were recorded since the last run started, one
run at a time, its output appended to DIR/heads/adapt.log; the server stopping stops it (a run
stopped part way resumes at the next).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from specdec.serve.head_store import HeadStore, HeadStoreError

log = logging.getLogger("specdec")

POLL_SECONDS = 5.0
ADAPT_LOG = "adapt.log"


class HeadWatcher:
    """Watches store for versions of drafter's head (an adaptable drafter: Drafter.adaptable) and
    hands each new one to engine (an AsyncEngine) to swap in. adapt: (model, minutes, recorder,
    every) to start `specdec adapt` runs, or None."""

    def __init__(self, store: HeadStore, drafter, engine, poll_seconds: float = POLL_SECONDS, adapt=None):
        self.store, self.drafter, self.engine = store, drafter, engine
        self.poll_seconds = poll_seconds
        self.adapt = adapt
        self.version = 0  # the version handed to the engine last (0: the head the server started with)
        self.refused: set[int] = set()
        self._damaged_said = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._adapting: subprocess.Popen | None = None
        self._recorded_at_last_run = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdec-head-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, and stop an adapt run under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._adapting is not None and self._adapting.poll() is None:
            self._adapting.terminate()
            self._adapting.wait()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
                self._maybe_adapt()
            except Exception:  # a bug here must not end the watching, nor the server
                log.exception("watching %s for new heads failed; trying again", self.store.root)
            self._stop.wait(self.poll_seconds)

    def check(self) -> int | None:
        """A new current version loaded and handed to the engine: its number; None if there was none."""
        try:
            current = self.store.current()
        except HeadStoreError as e:
            if not self._damaged_said:
                log.warning("%s; drafting on with head version %d", e, self.version)
                self._damaged_said = True
            return None
        self._damaged_said = False
        if current is None or current.number <= self.version or current.number in self.refused:
            return None
        try:
            prepared = self.drafter.load_version(current.path)
        except Exception as e:  # HeadLoadError names what is wrong; anything else is named by its type
            self.refused.add(current.number)
            reason = str(e) if isinstance(e, ValueError | OSError) else f"{type(e).__name__}: {e}"
            number, version = current.number, self.version
            log.warning("head version %d refused: %s; drafting on with version %d", number, reason, version)
            return None
        self.engine.swap_head(self.drafter, prepared, current.number)
        self.version = current.number
        return current.number

    def _maybe_adapt(self) -> None:
        if self.adapt is None or (self._adapting is not None and self._adapting.poll() is None):
            return
        model, minutes, recorder, every = self.adapt
        if recorder.num_recorded - self._recorded_at_last_run < every:
            return
        self._recorded_at_last_run = recorder.num_recorded
        self.store.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        command = [sys.executable, "-m", "specdec.cli", "adapt", model, "--from", str(recorder.directory)]
        command += ["--minutes", f"{minutes:g}"]
        if self.version == 0 and self.drafter.head_path is not None:  # none adapted yet: from the head serving
            command += ["--head", str(self.drafter.head_path)]
        with open(self.store.root / ADAPT_LOG, "a") as out:
            self._adapting = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_lowest_priority
            )
        log.info(
            "adapting the head on %d recorded requests (pid %d, log %s)",
            recorder.num_recorded,
            self._adapting.pid,
            Path(self.store.root / ADAPT_LOG),
        )


def _lowest_priority() -> None:
    os.nice(19)
