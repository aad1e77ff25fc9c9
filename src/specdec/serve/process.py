"""`specdec serve` as a child process on a free port: what the tests and the serving benchmark
start, talk to over HTTP, read the metrics of, and stop with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`specdec serve ARGS --port <a free one>`, its output in log_path; the constructor returns
    once /health answers 200 (or raises with the output, if it exits or takes over timeout s)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        command = [sys.executable, "-m", "specdec.cli", "serve", *args, "--port", str(self.port)]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """/metrics as {series (name and labels): value}, histogram buckets left out."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("specdec:") and "_bucket{" not in line:
                series, value = line.rsplit(" ", 1)
                values[series] = float(value)
        return values

    def metric(self, name: str, **labels) -> float:
        """The sum of specdec:<name> over the series whose labels include labels."""
        return sum(
            value
            for series, value in self.metrics().items()
            if series.split("{")[0] == f"specdec:{name}"
            and all(f'{key}="{label}"' in series for key, label in labels.items())
        )

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (killed, if it does not exit in timeout s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
