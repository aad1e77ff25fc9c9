"""Where specdec's log lines and its own warnings go: stderr, each line "specdec: ...", in the
command line and in every process that serves (a Ray Serve replica or ingress is a process of
its own, with no handler of its own)."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

SOURCE = Path(__file__).parent  # specdec's own source: its warnings are said in its words


def show_log() -> None:
    """specdec's log lines (the dtype chosen and why, compile times) on stderr, once; and
    specdec's own warnings (a draft's shorter context, an emulated dtype) in the same words,
    without the Python source line a warning otherwise prints."""
    log = logging.getLogger("specdec")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("specdec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if warnings.showwarning is not _show_warning:
        _show_warning.default = warnings.showwarning
        warnings.showwarning = _show_warning


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each line (a test's capture or a server may replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning of specdec's own (raised in its source) as a log line; any other as Python shows it."""
    if str(filename).startswith(str(SOURCE)):
        logging.getLogger("specdec").warning("%s", message)
    else:
        _show_warning.default(message, category, filename, lineno, file, line)
