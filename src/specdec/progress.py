"""Progress lines on stderr for one-off work that can take a while: loading a model, packing or
quantizing its weights, compiling, timing the round costs goodput needs.

    with stage("loading the target models/code-target"):
        ...

A stage that is still running after SHOW_AFTER seconds says so on stderr ("specdec: loading the
target models/code-target ..."), and when it ends, how long it took ("... done in 3.2 s"); a
stage that ends sooner prints nothing, so quick loads stay quiet. SPECDEC_PROGRESS=0 silences
them all. A stage inside a stage that is showing says its own lines, indented.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

SHOW_AFTER = 1.0  # seconds

_depth = threading.local()


@contextlib.contextmanager
def stage(what: str, after: float = SHOW_AFTER):
    """Report `what` on stderr if it runs longer than `after` seconds (see the module)."""
    if os.environ.get("SPECDEC_PROGRESS", "1") == "0":
        yield
        return
    depth = getattr(_depth, "value", 0)
    indent = "  " * depth
    start, lock, shown = time.perf_counter(), threading.Lock(), []

    def show() -> None:
        with lock:
            if not shown:
                shown.append(True)
                _write(f"specdec: {indent}{what} ...")

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    _depth.value = depth + 1
    try:
        yield
    finally:
        _depth.value = depth
        timer.cancel()
        with lock:
            if shown:
                _write(f"specdec: {indent}{what}: done in {time.perf_counter() - start:.1f} s")
            shown.append(False)  # a timer firing now prints nothing


def _write(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed: progress is not worth failing for
        pass
