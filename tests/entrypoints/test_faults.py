"""Faults inside a running server (issue 30, item 4): the server's app (serve.app.build_app) over an
AsyncEngine, on uvicorn in a thread of this process, so that a test reaches the engine itself: it
makes one call of a step raise (the round over a full batch, or a prefill that joins one), or the
engine's thread fail between steps, or die. Every request in the failing batch hears of it (a
stream: an OpenAI-shaped error event, then data: [DONE]; a whole completion: a 500 in OpenAI's
shape, no traceback), waiting and later requests are served, /health answers all the while, and
the block manager holds no block once the server is idle. A client that leaves frees its blocks."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import torch
import uvicorn

from helpers import HealthWatch, save_tiny_pair
from specdec import LLM
from specdec.serve.app import ServerState, build_app
from specdec.serve.async_engine import AsyncEngine
from specdec.serve.process import free_port
from specdec.serve.prom import ServerMetrics

# slow: a server per test, in this process (seconds each); alone: it times /health (under 1 s), with nothing beside it
pytestmark = [pytest.mark.slow, pytest.mark.alone]

CONTEXT = 1024
SLOTS = 4
LONG = {"prompt": "def add(a, b):", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
REFERENCE = {"prompt": "class Point:\n", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
WAIT = 30.0  # seconds: the most any request or condition may take (past it, a hang)


class InjectedFault(Exception):
    """The error a test makes an engine call raise."""


class EngineThreadKilled(BaseException):
    """Not an Exception: what no `except Exception` catches, so the engine's thread dies of it."""


class FailOnce:
    """Stands in for an engine call: passes every call on, but the first one for which when()
    holds raises error (fired is set then)."""

    def __init__(self, call: Callable, when: Callable[..., bool], error: BaseException):
        self.call, self.when, self.error = call, when, error
        self.fired = threading.Event()

    def __call__(self, *args, **kwargs):
        if not self.fired.is_set() and self.when(*args, **kwargs):
            self.fired.set()
            raise self.error
        return self.call(*args, **kwargs)


class InProcessServer:
    """llm served by build_app on uvicorn in a thread, on a free port, its steps prefilling at
    most max_prefill_tokens; stop() shuts it down. A subclass may change the engine in
    instrument(), before it serves."""

    def __init__(self, llm: LLM, max_prefill_tokens: int | None = None):
        with torch.inference_mode():
            llm.engine.prepare_to_serve(CONTEXT, max_prefill_tokens=max_prefill_tokens)
        self.engine = llm.engine
        self.instrument()
        self.async_engine = AsyncEngine(llm, ServerMetrics("tiny"), max_waiting=16)
        app = build_app(ServerState(self.async_engine, ["tiny"], CONTEXT))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    def instrument(self) -> None:
        """Nothing here."""

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=WAIT)
        assert not self.thread.is_alive(), "the server did not stop"

    def metric(self, name: str) -> float:
        """specdec:<name> from /metrics (the series of the served model)."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f"specdec:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    @property
    def blocks_held(self) -> int:
        blocks = self.engine.capacity.blocks
        assert blocks is not None
        return blocks.num_held

    def wait_until_idle(self) -> None:
        """Until no request runs or waits and the block manager holds no block (its own count),
        as /metrics says too."""
        wait_for(
            lambda: not self.engine.has_unfinished_requests() and self.blocks_held == 0,
            "the engine to be idle with no block held",
        )
        wait_for(lambda: self.metric("kv_cache_blocks_held") == 0, "/metrics to show no block held")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.01)


def stream_events(url: str, body: dict) -> tuple[int, list[str]]:
    """A streaming completion: its status and its data: lines' payloads, to the end."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=WAIT) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        return response.status_code, events


def whole(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT)


def assert_openai_error(error: dict, type_: str) -> None:
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_, error
    assert error["message"] and "Traceback" not in error["message"] and 'File "' not in error["message"], error


def assert_failed_cleanly(streamed: list[Future], wholes: list[Future], what: str) -> None:
    """Each stream: a 200 whose last events are an error in OpenAI's shape naming what failed,
    then [DONE]; each whole completion (or stream that failed before its first chunk): a 500 in
    OpenAI's shape."""
    for future in streamed:
        status, events = future.result(timeout=WAIT)
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert_openai_error(error, "server_error")
        assert what in error["message"], error
    for future in wholes:
        response = future.result(timeout=WAIT)
        assert response.status_code == 500, response.text
        assert response.headers["content-type"] == "application/json"
        assert_openai_error(response.json()["error"], "server_error")
        assert what in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("faults"), 21, 22, "llama", max_position_embeddings=CONTEXT)
    return pair["target"], pair["draft"]


def make_llm(model_dirs) -> LLM:
    target, draft = model_dirs
    return LLM(
        str(target),
        speculative_model=str(draft),
        num_speculative_tokens=3,
        dtype="float32",
        compile="off",
        max_num_seqs=SLOTS,
    )


@pytest.fixture(scope="module")
def llm(model_dirs):
    return make_llm(model_dirs)


@pytest.fixture
def server(llm):
    server = InProcessServer(llm)
    yield server
    server.stop()


def start_long_requests(pool: ThreadPoolExecutor, server: InProcessServer, count: int):
    """count long requests, the last one whole and the rest streamed, all running when it returns."""
    streamed = [pool.submit(stream_events, server.url, LONG) for _ in range(count - 1)]
    whole_completion = pool.submit(whole, server.url, LONG)
    wait_for(lambda: server.engine.num_running == count, f"{count} requests to run")
    return streamed, whole_completion


@pytest.mark.parametrize("where", ["round", "prefill"])
def test_a_step_that_raises_fails_its_batch_and_the_server_goes_on(server, monkeypatch, where):
    """round: the round over a full batch raises, while a fifth request waits for a slot: the four
    hear of it, the fifth is served. prefill: the prefill of a request joining three that run
    raises: all four hear of it. Then a request gets what it got before the fault (the caches
    are sound), /health answered every 20 ms within a second, and no block is held."""
    reference = whole(server.url, REFERENCE).json()["choices"][0]["text"]
    failures = server.metric("engine_step_failures_total")
    place = "the round" if where == "round" else "a prefill"
    with HealthWatch(server.url, timeout=WAIT) as health, ThreadPoolExecutor(8) as pool:
        if where == "round":
            streamed, whole_completion = start_long_requests(pool, server, SLOTS)
            waiter = pool.submit(whole, server.url, REFERENCE)
            wait_for(lambda: server.engine.num_waiting == 1, "the fifth request to wait")
            fault = FailOnce(server.engine.round.run, lambda *a, **k: True, InjectedFault("injected in the round"))
            monkeypatch.setattr(server.engine.round, "run", fault)
            wholes = [whole_completion]
        else:
            streamed, whole_completion = start_long_requests(pool, server, SLOTS - 1)
            fault = FailOnce(server.engine.round.prefill, lambda *a, **k: True, InjectedFault("injected in a prefill"))
            monkeypatch.setattr(server.engine.round, "prefill", fault)
            joining = pool.submit(whole, server.url, {**LONG, "stream": True})  # fails before its first chunk
            wholes, waiter = [whole_completion, joining], None
        assert_failed_cleanly(streamed, wholes, f"the engine failed: InjectedFault: injected in {place}")
        assert fault.fired.is_set()
        if waiter is not None:
            assert waiter.result(timeout=WAIT).json()["choices"][0]["text"] == reference
        assert whole(server.url, REFERENCE).json()["choices"][0]["text"] == reference
        _, events = stream_events(server.url, REFERENCE)
        assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == reference
    assert set(health.statuses) == {200} and health.slowest < 1.0, (set(health.statuses), health.slowest)
    server.wait_until_idle()
    assert server.metric("engine_step_failures_total") == failures + 1


def test_an_error_between_steps_fails_what_the_engine_holds_and_the_thread_goes_on(server, monkeypatch):
    """The engine's thread raises outside a step (here: asking whether work is left): the
    requests the engine holds hear of it, the thread is still stepping, later requests are served."""
    reference = whole(server.url, REFERENCE).json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        streamed, whole_completion = start_long_requests(pool, server, 2)
        fault = FailOnce(server.engine.has_unfinished_requests, lambda: True, InjectedFault("injected between steps"))
        monkeypatch.setattr(server.engine, "has_unfinished_requests", fault)
        assert_failed_cleanly(streamed, [whole_completion], "injected between steps")
    assert server.async_engine.is_running and httpx.get(f"{server.url}/health").status_code == 200
    assert whole(server.url, REFERENCE).json()["choices"][0]["text"] == reference
    server.wait_until_idle()


def test_a_client_that_leaves_frees_its_blocks_at_once(server):
    """A long stream holds blocks; its client leaves after a few chunks: the request is aborted
    (not run to its 900 tokens) and its blocks are free."""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=WAIT) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert server.blocks_held > 0
    server.wait_until_idle()
    assert server.metric("generation_tokens_total") < LONG["max_tokens"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the test
def test_an_engine_thread_that_dies_leaves_no_request_waiting(model_dirs, monkeypatch):
    """The engine's thread dies (an error no `except Exception` catches): the requests it held
    end with a 503 in OpenAI's shape (an error event then [DONE], on a stream) instead of
    waiting for ever; /health says 503 and new requests get a 503 at once."""
    server = InProcessServer(make_llm(model_dirs))
    try:
        with ThreadPoolExecutor(4) as pool:
            streamed, whole_completion = start_long_requests(pool, server, 2)
            fault = FailOnce(server.engine.has_unfinished_requests, lambda: True, EngineThreadKilled())
            monkeypatch.setattr(server.engine, "has_unfinished_requests", fault)
            status, events = streamed[0].result(timeout=WAIT)
            assert status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
            response = whole_completion.result(timeout=WAIT)
            assert response.status_code == 503
            assert_openai_error(response.json()["error"], "server_error")
        wait_for(lambda: not server.async_engine.is_running, "the engine's thread to end")
        assert httpx.get(f"{server.url}/health").status_code == 503
        refused = whole(server.url, REFERENCE)
        assert refused.status_code == 503 and "engine has stopped" in refused.json()["error"]["message"]
    finally:
        with contextlib.suppress(AssertionError):
            server.stop()
