"""The load benchmark's mix (benchmarks/bench_load.py), short, against specdec serve on tiny
models (issue 30, item 4): 60 requests over 5 s, streams, whole completions, clients that
disconnect mid-stream or give up early, oversize bodies, malformed requests and unknown models.
Every request ends (none hangs), each answered as docs/server.md says, /health answers within a
second all the while, the server is alive at the end, and once idle the block manager holds no
block."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from helpers import save_tiny_pair
from specdec.serve.process import ServerProcess

# slow: a server process (about 15 s in all); alone: it times /health (under 1 s), with nothing beside it
pytestmark = [pytest.mark.slow, pytest.mark.alone]

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"
CONTEXT = 1024
MAX_REQUEST_BYTES = 64 * 1024
STATUSES = {  # what each kind of request may be answered (None: the client left before an answer)
    "stream": {200},
    "whole": {200},
    "disconnect": {200},
    "abort": {None, 200},
    "oversize": {413},
    "malformed": {400},
    "unknown": {404},
}


@pytest.fixture(scope="module")
def bench_load():
    """benchmarks/bench_load.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_load", BENCH_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_load"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    pair = save_tiny_pair(root, 31, 32, "llama", max_position_embeddings=CONTEXT)
    args = [str(pair["target"]), "--draft", str(pair["draft"]), "-k", "3", "--compile", "off", "--dtype", "float32"]
    args += ["--max-num-seqs", "8", "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    server = ServerProcess(args, root / "server.log")
    yield server
    assert server.stop() == 0, server.output()


def test_the_load_mix_ends_every_request_as_documented_and_leaves_no_block_held(server, bench_load):
    prompts = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in range(10):\n    print(i)"]
    settings = bench_load.MixSettings(
        streams=60, seconds=5, prompts=prompts, max_request_bytes=MAX_REQUEST_BYTES, request_timeout=60
    )
    outcomes, probe = asyncio.run(bench_load.run_mix(server.url, settings))
    assert len(outcomes) == 60 and {o.kind for o in outcomes} == set(STATUSES)
    assert [o for o in outcomes if o.ended == "hung"] == []
    for outcome in outcomes:
        assert outcome.status in STATUSES[outcome.kind], outcome
    assert bench_load.problems(outcomes) == []  # each ended as its kind must, errors in OpenAI's shape
    completed_streams = [o for o in outcomes if o.kind == "stream"]
    assert all(o.done and o.chunks >= 1 for o in completed_streams)
    assert sum(o.ended == "disconnected" for o in outcomes) >= 1 and sum(o.ended == "aborted" for o in outcomes) >= 1
    assert probe.answers >= 20 and probe.not_ok == 0 and probe.slowest < 1.0, (probe.answers, probe.slowest)
    assert server.process.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
    idle = asyncio.run(bench_load.wait_until_idle(server.url))
    assert idle["kv_cache_blocks_held"] == 0 and idle["num_requests_running"] == 0, idle
    assert idle["engine_step_failures_total"] == 0
    assert "Traceback" not in server.output()
