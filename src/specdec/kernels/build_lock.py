"""One kernel build at a time in a build directory, and never a wait on a build that is gone.

torch.utils.cpp_extension guards a build with its own lock, the baton: a file named 'lock' that
it creates before building and removes after, and that every other process waits on, forever,
while it exists. A build killed midway (SIGTERM, Ctrl-C, SIGKILL) leaves the baton behind, so
every later run would wait forever. specdec takes a lock of its own first:

  build lock  an exclusive fcntl.flock on LOCK_NAME in the build directory, held for the whole
              build. The kernel drops it when its process ends, however it ends (SIGKILL
              included), so it cannot outlive its owner. The file holds the owner's PID, for
              the words of whoever waits; the file itself stays (removing a flock's file races).
  builder     the process that holds the build lock.
  baton       torch's 'lock' file. Every specdec build holds the build lock before torch takes
              the baton, so a builder that finds a baton knows that its owner is dead, and
              removes it.
  leftovers   processes still running in the build directory (it is their working directory)
              with no builder: the ninja and compilers of a killed build. Python dies alone on
              SIGTERM, and ninja runs each compiler in a process group of its own, so a killed
              process group (a closed terminal) or a Ctrl-C that kills ninja before it passes
              the signal on still leaves the compilers running. The builder never builds beside
              them, so that two processes never write the same file:
              - a leftover ninja finishes the build and logs it: the builder waits for it;
              - compilers with no ninja write files that no log records, which the next ninja
                compiles again (an output missing from its log is dirty): the builder stops them.
              After either, ninja rebuilds what is missing or half-written and keeps the rest.

Every wait says what it waits for every few seconds and gives up after a bound (WAIT_ENV_VAR,
in seconds; DEFAULT_WAIT_S unset) with KernelBuildBusy, whose message says what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("specdec")

LOCK_NAME = "specdec-build.lock"  # the build lock's file, in the build directory
BATON_NAME = "lock"  # torch's FileBaton, in the build directory
WAIT_ENV_VAR = "SPECDEC_KERNEL_BUILD_WAIT"
DEFAULT_WAIT_S = 20 * 60.0  # a cold build takes about 2 minutes on 2 cores
REPORT_EVERY_S = 10.0
POLL_S = 0.25
# A shell whose working directory is the build directory is a person's, not a build's: ninja's
# `sh -c` lives only as long as the compiler it runs, which is waited for by its own name.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "fish", "ksh", "tcsh", "csh"})


class KernelBuildBusy(RuntimeError):
    """Another build in the kernels' build directory (a live builder or leftovers) outlasted
    the wait's bound; the message names it and what to do."""


def wait_limit() -> float:
    """Seconds to wait for another build before giving up: WAIT_ENV_VAR, else DEFAULT_WAIT_S."""
    setting = os.environ.get(WAIT_ENV_VAR)
    if setting is None:
        return DEFAULT_WAIT_S
    try:
        limit = float(setting)
    except ValueError:
        limit = -1.0
    if not limit >= 0:  # also NaN
        raise ValueError(
            f"{WAIT_ENV_VAR} must be a number of seconds to wait for another kernel build "
            f"(unset: {DEFAULT_WAIT_S:.0f}), got {setting!r}"
        )
    return limit


@contextlib.contextmanager
def build_lock(directory: Path, limit: float | None = None, report_every: float = REPORT_EVERY_S) -> Iterator[None]:
    """Hold the build lock on directory (made if missing) for the body: wait for a live
    builder, settle the leftovers, remove a stale baton. Raises KernelBuildBusy after limit
    seconds in all (None: wait_limit())."""
    directory.mkdir(parents=True, exist_ok=True)
    waited = _Wait(wait_limit() if limit is None else limit, report_every)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited.until(lambda: _try_flock(fd), lambda: _builder_words(directory), lambda: _busy_advice(directory))
        _write_owner(fd)
        _settle_leftovers(directory, waited)
        _remove_stale_baton(directory)
        yield
    finally:
        os.close(fd)  # drops the flock


class _Wait:
    """A wait's clock, shared by its steps: says what it waits for every report_every seconds
    and raises KernelBuildBusy once limit seconds have passed since it began."""

    def __init__(self, limit: float, report_every: float):
        self.limit, self.report_every = limit, report_every
        self.start = time.monotonic()

    def until(self, done: Callable[[], bool], waited_for: Callable[[], str], advice: Callable[[], str]) -> None:
        """Poll done() until it holds; waited_for() names what is awaited, advice() what to do."""
        last_report = None
        while not done():
            now = time.monotonic()
            elapsed = now - self.start
            if elapsed >= self.limit:
                raise KernelBuildBusy(
                    f"gave up after {elapsed:.0f} s waiting for {waited_for()} "
                    f"({WAIT_ENV_VAR}={self.limit:g}); {advice()}"
                )
            if last_report is None or now - last_report >= self.report_every:
                log.warning("waiting for %s (%.0f s of at most %g)", waited_for(), elapsed, self.limit)
                last_report = now
            time.sleep(POLL_S)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_owner(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def owner_pid(directory: Path) -> int | None:
    """The PID the last builder wrote in the lock file (None: none written)."""
    try:
        return int((directory / LOCK_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def _builder_words(directory: Path) -> str:
    pid = owner_pid(directory)
    who = f"process {pid}" if pid is not None else "another process"
    return f"{who} to finish building specdec's kernels in {directory}"


def _busy_advice(directory: Path) -> str:
    pid = owner_pid(directory)
    stop = f"stop it (kill {pid})" if pid is not None else "stop it"
    return f"let it finish and run again, or {stop}, or set {WAIT_ENV_VAR} to wait longer (seconds)"


def leftovers(directory: Path) -> list[tuple[int, str]]:
    """(PID, name) of the processes other than this one whose working directory is directory,
    shells left out (SHELLS): on Linux, from /proc; elsewhere none are seen."""
    target = os.path.realpath(directory)
    found = []
    for entry in _proc_entries():
        try:
            if entry.name != str(os.getpid()) and os.readlink(entry / "cwd") == target:
                name = (entry / "comm").read_text().strip()
                if name not in SHELLS:
                    found.append((int(entry.name), name))
        except OSError:  # another user's process, or one that just ended
            continue
    return found


def _proc_entries() -> list[Path]:
    try:
        return [entry for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def _settle_leftovers(directory: Path, waited: _Wait) -> None:
    """Wait for a leftover ninja to finish its build, then stop the compilers left with none
    (module docstring: leftovers) and wait for them to end."""
    waited.until(
        lambda: not _named(leftovers(directory), "ninja"),
        lambda: (
            f"an interrupted kernel build's ninja, still running in {directory}, to finish it: "
            + _listed(_named(leftovers(directory), "ninja"))
        ),
        lambda: (
            "let it finish, or stop it (kill the PID named), and run again; "
            f"or set {WAIT_ENV_VAR} to wait longer (seconds)"
        ),
    )
    _stop(leftovers(directory), directory)
    waited.until(
        lambda: not leftovers(directory),
        lambda: (
            f"the processes of an interrupted kernel build still running in {directory} to end: "
            + _listed(leftovers(directory))
        ),
        lambda: f"stop them (kill the PIDs named) and run again; or set {WAIT_ENV_VAR} to wait longer (seconds)",
    )


def _named(processes: list[tuple[int, str]], name: str) -> list[tuple[int, str]]:
    return [(pid, comm) for pid, comm in processes if comm == name]


def _listed(processes: list[tuple[int, str]]) -> str:
    return ", ".join(f"{pid} ({name})" for pid, name in processes) or "none"


def _stop(processes: list[tuple[int, str]], directory: Path) -> None:
    """SIGKILL processes left by a dead build (those this user may signal)."""
    stopped = []
    for pid, name in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            stopped.append((pid, name))
    if stopped:
        log.warning(
            "stopped %s, left running in %s by an interrupted kernel build with no ninja to record "
            "their files (ninja compiles them again)",
            _listed(stopped),
            directory,
        )


def _remove_stale_baton(directory: Path) -> None:
    """Remove torch's baton, which only a dead build can have left (module docstring)."""
    baton = directory / BATON_NAME
    with contextlib.suppress(FileNotFoundError):
        baton.unlink()
        log.info("removed %s, left by an interrupted kernel build", baton)
