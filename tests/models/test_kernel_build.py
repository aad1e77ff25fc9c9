"""The kernels' build lock (kernels/build_lock.py): a lock left by a dead process is taken at
once, a live builder or the leftovers of a killed build are waited for, reported and given up
on with advice, torch's stale baton is removed, a library that does not load is built afresh;
and, slow, a real build killed midway twice leaves the next run building and running a kernel."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from specdec import kernels
from specdec.kernels.build_lock import (
    BATON_NAME,
    DEFAULT_WAIT_S,
    LOCK_NAME,
    WAIT_ENV_VAR,
    KernelBuildBusy,
    build_lock,
    leftovers,
    owner_pid,
    wait_limit,
)

SRC = Path(kernels.__file__).parents[2]
HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from specdec.kernels.build_lock import build_lock
with build_lock(Path(sys.argv[1]), limit=0):
    print("held", flush=True)
    time.sleep(120)
"""


def python_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), **extra}


@pytest.fixture
def holder(tmp_path):
    """A live process holding the build lock on tmp_path / "build" (killed at the end)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path / "build")],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    yield process
    process.kill()
    process.wait()


def test_a_lock_left_by_a_killed_builder_is_taken_at_once_and_its_stale_baton_removed(tmp_path, holder, caplog):
    build = tmp_path / "build"
    (build / BATON_NAME).touch()  # torch's baton, as a build killed midway leaves it
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert owner_pid(build) == holder.pid  # the dead builder's PID is still written
    with caplog.at_level(logging.INFO, logger="specdec"), build_lock(build, limit=0):  # limit 0: no wait at all
        assert owner_pid(build) == os.getpid()
        assert not (build / BATON_NAME).exists()
    assert any(str(build / BATON_NAME) in record.getMessage() for record in caplog.records)


def test_a_live_builder_is_reported_while_waited_for_and_given_up_on_with_advice(tmp_path, holder, caplog):
    build = tmp_path / "build"
    with caplog.at_level(logging.WARNING, logger="specdec"), pytest.raises(KernelBuildBusy) as busy:
        with build_lock(build, limit=0.8, report_every=0.2):
            pytest.fail("took a lock that a live process holds")
    reports = [record.getMessage() for record in caplog.records if record.getMessage().startswith("waiting for")]
    assert len(reports) >= 2 and all(f"process {holder.pid}" in r and str(build) in r for r in reports)
    assert f"kill {holder.pid}" in str(busy.value) and WAIT_ENV_VAR in str(busy.value)
    assert (build / LOCK_NAME).exists()
    holder.kill()
    holder.wait()
    with build_lock(build, limit=0):
        assert owner_pid(build) == os.getpid()


@pytest.fixture
def in_build_dir(tmp_path):
    """start(program, *args): a process running in tmp_path / "build" (all killed at the end)."""
    (tmp_path / "build").mkdir()
    started = []

    def start(*command: str, **kwargs) -> subprocess.Popen:
        started.append(subprocess.Popen(command, cwd=tmp_path / "build", **kwargs))
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_leftover_ninja_is_waited_for_and_reported(tmp_path, in_build_dir, caplog):
    build = tmp_path / "build"
    shutil.copy(shutil.which("sleep"), tmp_path / "ninja")  # a process named ninja, as /proc shows it
    ninja = in_build_dir(str(tmp_path / "ninja"), "120")
    with caplog.at_level(logging.WARNING, logger="specdec"), pytest.raises(KernelBuildBusy) as busy:
        with build_lock(build, limit=0.6, report_every=0.2):
            pytest.fail("built beside the ninja of another build")
    assert f"{ninja.pid} (ninja)" in str(busy.value) and f"still running in {build}" in str(busy.value)
    assert any(f"{ninja.pid} (ninja)" in record.getMessage() for record in caplog.records)
    assert ninja.poll() is None  # left to finish its build
    ninja.kill()
    ninja.wait()
    with build_lock(build, limit=0):
        assert leftovers(build) == []


def test_leftover_compilers_with_no_ninja_are_stopped_but_a_shell_is_not(tmp_path, in_build_dir, caplog):
    build = tmp_path / "build"
    shell = in_build_dir("sh", stdin=subprocess.PIPE)  # a person's shell in the directory
    compiler = in_build_dir("sleep", "120")  # stands for a compiler whose ninja was killed
    assert leftovers(build) == [(compiler.pid, "sleep")]
    with caplog.at_level(logging.WARNING, logger="specdec"), build_lock(build, limit=60):
        assert compiler.wait() == -signal.SIGKILL
        assert shell.poll() is None
    assert any(f"stopped {compiler.pid} (sleep)" in record.getMessage() for record in caplog.records)


def test_the_wait_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(WAIT_ENV_VAR, raising=False)
    assert wait_limit() == DEFAULT_WAIT_S
    monkeypatch.setenv(WAIT_ENV_VAR, "2.5")
    assert wait_limit() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(WAIT_ENV_VAR, bad)
        with pytest.raises(ValueError, match=rf"{WAIT_ENV_VAR} must be a number of seconds.*{bad!r}"):
            wait_limit()


@pytest.fixture
def build_dir_with_outputs(tmp_path, monkeypatch):
    """A build directory holding an interrupted build's outputs, and torch's record that this
    process built the extension."""
    build = tmp_path / "build"
    (build / "nested").mkdir(parents=True)
    for name in (LOCK_NAME, "build.ninja", ".ninja_log", "qmatmul.o", "specdec_qmatmul_avx2.so"):
        (build / name).write_text("x")
    monkeypatch.setitem(cpp_extension.JIT_EXTENSION_VERSIONER.entries, kernels.extension_name("avx2"), object())
    return build


def test_a_library_that_does_not_load_is_built_afresh(build_dir_with_outputs, monkeypatch):
    module, loads = object(), []

    def load(**kwargs):
        loads.append(sorted(p.name for p in build_dir_with_outputs.iterdir()))
        if len(loads) == 1:
            raise ImportError("specdec_qmatmul_avx2.so: file too short")
        assert kwargs["name"] not in cpp_extension.JIT_EXTENSION_VERSIONER.entries  # so torch builds it again
        return module

    monkeypatch.setattr(cpp_extension, "load", load)
    assert kernels._build_and_load("avx2", build_dir_with_outputs) is module
    assert loads[1] == [LOCK_NAME]


def test_a_library_that_does_not_load_when_built_afresh_is_unavailable(build_dir_with_outputs, monkeypatch):
    def load(**kwargs):
        raise ImportError("undefined symbol: omp_get_thread_num")

    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.raises(kernels.KernelUnavailable, match=r"built afresh in .* do not load: undefined symbol"):
        kernels._build_and_load("avx2", build_dir_with_outputs)


BUILD = "from specdec.kernels import qmatmul; qmatmul()"
RUN_A_KERNEL = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from specdec.kernels import ops
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 4, 32, generator=g)  # [B, T, H, D]
    keys, values = (torch.randn(1, 9, 2, 32, generator=g) for _ in range(2))  # [B, S, Hkv, D]
    got = ops().attend(q, keys, values, None, 32**-0.5)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, keys, values)), enable_gqa=True
    ).transpose(1, 2)
    assert (got - expected).abs().max() < 1e-5, (got - expected).abs().max()
    print("attended")
    """
)


def start(code: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A Python process running code in a session of its own (a process group to kill whole)."""
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_until_compiling(build: Path, process: subprocess.Popen, log: Path, bound_s: float = 600) -> None:
    """Return once process's build is midway: its ninja and a compiler run in build; fail if
    process ends first."""
    deadline = time.monotonic() + bound_s
    while not {"ninja", "cc1plus"} <= {name for _, name in leftovers(build)}:
        assert process.poll() is None, f"the build ended before compiling:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no build started in {bound_s} s:\n{log.read_text()}"
        time.sleep(0.1)


@pytest.fixture
def fresh_cache(tmp_path):
    """A SPECDEC_CACHE of the test's own; the build processes left in it are stopped at the end."""
    yield tmp_path
    for pid, _ in leftovers(tmp_path / "extensions" / kernels.variant()):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.alone  # a whole build on both cores: run after the rest, with nothing beside it
def test_a_build_killed_midway_leaves_the_next_run_building_and_running_a_kernel(fresh_cache):
    """A terminal closed while compiling: Python and ninja killed, the compilers (each in a
    process group of ninja's making) left running with no ninja to record their files, and
    torch's baton left behind, on which every later run used to wait forever. The next run
    stops the leftovers, builds, and runs a kernel. (A leftover ninja that goes on building, as
    after a SIGTERM to Python alone, is waited for: the fast tests above.)"""
    env = python_env(SPECDEC_CACHE=str(fresh_cache), SPECDEC_KERNEL_BUILD_WAIT="1200")
    build = fresh_cache / "extensions" / kernels.variant()
    first = start(BUILD, env, fresh_cache / "first.log")
    wait_until_compiling(build, first, fresh_cache / "first.log")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert (build / BATON_NAME).exists()

    second = subprocess.run([sys.executable, "-c", RUN_A_KERNEL], env=env, capture_output=True, text=True, timeout=1500)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "attended"
