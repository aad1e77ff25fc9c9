"""specdec serve --replicas 2 on a local Ray instance (serve/ray_serve.py), driven by the official
openai client and httpx against the server's one port (Ray Serve runs no HTTP proxy of its own):
completions and streams give what LLM.generate gives offline (greedy, float32); a shared prefix
goes back to the replica that served it; /metrics covers both replicas; every route but /health
and /metrics asks for the API key, Ray's /-/routes and /-/healthz included; a replica killed
mid-stream ends its request with an error event (never a hang), and once Ray has restarted it the
next requests succeed; SIGTERM with streams and a completion in flight ends each stream with an
error event then `data: [DONE]`, the completion with a 503 in OpenAI's shape, and the server exits
0 with no traceback. ReplicaClient's stop is checked with stand-in replicas too. Skipped where Ray
Serve is not installed (pip install "specdec[ray]")."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

from helpers import assert_drains, save_tiny_model
from specdec import LLM, SamplingParams
from specdec.serve.process import ServerProcess

try:
    import ray
    import ray.serve  # noqa: F401  (what --replicas needs)
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason='Ray Serve is not installed: pip install "specdec[ray]"')
pytestmark = pytest.mark.alone  # a local Ray instance takes the machine: nothing runs beside it

MODEL = "tiny"
API_KEY = "sesame"
SHUTDOWN_TIMEOUT_S = 3  # the module server's --shutdown-timeout: its SIGTERM test's streams outlast it
KILL_ANSWER_S = 30  # a stream whose replica died ends within this long
RESTART_S = 90  # Ray restarts a killed replica (and it loads its model) within this long


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The serve tests' tiny target and its one-layer draft."""
    root = tmp_path_factory.mktemp("ray")
    return {
        name: save_tiny_model(root / name, "llama", seed=seed, init_std=0.3, max_position_embeddings=2048, **layers)
        for name, seed, layers in (("target", 11, {}), ("draft", 12, {"num_hidden_layers": 1}))
    }


def test_replicas_without_ray_is_one_line(monkeypatch, capsys, tmp_path):
    """specdec serve --replicas 2 where Ray is not installed: the error says how to install it."""
    from specdec.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    monkeypatch.delitem(sys.modules, "specdec.serve.ray_serve", raising=False)
    model = save_tiny_model(tmp_path / "model", "llama", seed=1)
    assert main(["serve", str(model), "--replicas", "2"]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == 'error: --replicas N needs Ray Serve: pip install "specdec[ray]"'
    )


class SlowReplica:
    """A stand-in for an engine replica's DeploymentHandle: handle.ready.remote() answers only
    once loaded is set (a replica still loading its model and timing its rounds)."""

    def __init__(self):
        self.loaded = False
        self.ready = self

    def remote(self):
        async def answer():
            while not self.loaded:
                await asyncio.sleep(0.01)
            return "replica"

        return answer()


@needs_ray
def test_health_waits_for_a_replica_that_answers(monkeypatch):
    """The ingress's /health (is_running) says 200 only once a replica has answered: before, Ray
    Serve already routed to the ingress while the engines were still loading, and load sent on
    its 200 waited out their start."""
    from specdec.serve import ray_serve

    monkeypatch.setattr(ray_serve, "HEALTH_PERIOD_S", 0.01)
    monkeypatch.setattr(ray_serve, "HEALTH_TIMEOUT_S", 0.05)
    replicas = [SlowReplica(), SlowReplica()]

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]

    async def watch() -> tuple[bool, bool, set[int]]:
        ingress = ray_serve.ReplicaClient(None, replicas, MODEL)  # pyright: ignore[reportArgumentType]
        before = ingress.is_running
        ingress.start()
        await asyncio.sleep(0.2)
        still_loading = ingress.is_running
        replicas[1].loaded = True
        for _ in range(100):
            await asyncio.sleep(0.02)
            if ingress.is_running:
                break
        await ingress.stop()
        return before, still_loading, set(ingress.router.down)

    log = logging.getLogger("specdec")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        before, still_loading, down = asyncio.run(watch())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert not before and not still_loading  # no replica had answered
    assert down == {0}  # the one that answered is up, the other still down
    assert said == ["engine-1 answers: routing to it"]  # once, when it changed: not at start, not every poll


class EndlessReplica:
    """A stand-in for an engine replica's DeploymentHandle whose generate streams outputs until
    cancelled: handle.options(stream=True).generate.remote(...) returns a response (EndlessResponse)."""

    def __init__(self):
        self.generate = self
        self.responses: list[EndlessResponse] = []

    def options(self, stream: bool) -> EndlessReplica:
        return self

    def remote(self, request_id, prompt_token_ids, params, prompt, stream_text, cache_scope) -> EndlessResponse:
        self.responses.append(EndlessResponse())
        return self.responses[-1]


class EndlessResponse:
    """A streamed response of unfinished outputs, one a millisecond, until cancel() is called."""

    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from specdec.outputs import CompletionOutput, RequestOutput

        await asyncio.sleep(0.001)
        return RequestOutput("r", "", [1], [CompletionOutput(0, "a", [2], None)], finished=False)

    def cancel(self) -> None:
        self.cancelled = True


@needs_ray
def test_stop_ends_every_open_request_with_shutting_down():
    """ReplicaClient.stop (what the server calls --shutdown-timeout after SIGTERM) ends each open
    request with a 503 shutting_down, which app.py sends as an error event then `data: [DONE]` on
    a stream, cancels its replica's response (the replica aborts it), and refuses new requests
    with the same 503."""
    from specdec import SamplingParams
    from specdec.serve.protocol import APIError
    from specdec.serve.ray_serve import ReplicaClient

    replica = EndlessReplica()

    async def run() -> tuple[list[BaseException | None], BaseException | None, int]:
        ingress = ReplicaClient(None, [replica], MODEL)  # pyright: ignore[reportArgumentType]
        params = SamplingParams(max_tokens=100)
        streams = [ingress.generate(f"r{i}", [1, 2, 3], params) for i in range(3)]
        for stream in streams:
            await anext(stream)  # each is running on the replica
        await ingress.stop()
        ended = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
        late = await asyncio.gather(anext(ingress.generate("late", [1], params)), return_exceptions=True)
        return ended, late[0], sum(ingress.router.in_flight)

    ended, late, in_flight = asyncio.run(run())
    for error in [*ended, late]:
        assert isinstance(error, APIError), error
        assert (error.status, error.body()["error"]["code"]) == (503, "shutting_down"), error.body()
    assert [response.cancelled for response in replica.responses] == [True, True, True]
    assert in_flight == 0  # the router no longer counts their work


@pytest.fixture(scope="module")
def ray_address():
    assert ray is not None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def server(dirs, ray_address, tmp_path_factory):
    args = [str(dirs["target"]), "--draft", str(dirs["draft"]), "-k", "4", "--max-num-seqs", "4"]
    args += ["--compile", "off", "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--replicas", "2", "--replica-threads", "1", "--ray-address", ray_address]
    args += ["--api-key", API_KEY, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    server = ServerProcess(args, tmp_path_factory.mktemp("log") / "server.log")
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def offline(dirs):
    return LLM(str(dirs["target"]), speculative_model=str(dirs["draft"]), num_speculative_tokens=4, dtype="float32")


def client(server: ServerProcess, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def greedy(max_tokens: int) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_completions_and_streams_are_what_generate_gives_offline(server, offline):
    for prompt, max_tokens in (("def add(a, b):", 30), ("class Point:\n", 12), ("import os\n", 20)):
        want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        got = client(server).completions.create(prompt=prompt, **greedy(max_tokens))
        assert got.choices[0].text == want.outputs[0].text
        chunks = list(client(server).completions.create(prompt=prompt, stream=True, **greedy(max_tokens)))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_a_shared_prefix_goes_back_to_its_replica(server):
    prefix = "def a_long_shared_system_prompt(x):\n" * 6  # several whole 16-token blocks
    before = server.metric("router_requests_total", reason="prefix")
    for tail in ("    return 1\n", "    return 2\n"):
        client(server).completions.create(prompt=prefix + tail, **greedy(4))
    assert server.metric("router_requests_total", reason="prefix") == before + 1
    assert server.metric("prefix_cache_hits_total") > 0  # the second found its prefix in that replica's cache


@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_metrics_cover_both_replicas(server):
    for prompt in ("a = 1\n", "b = 2\n"):  # two at once would spread; one after another: least loaded
        client(server).completions.create(prompt=prompt, **greedy(5))
    for replica in ("0", "1"):
        assert server.metric("replica_up", replica=replica) == 1
        assert server.metric("generation_tokens_total", replica=replica) > 0
        assert server.metric("router_requests_total", replica=replica) > 0


def replica_actor(index: int):
    """The Ray actor of engine replica index."""
    from specdec.serve.ray_serve import app_name, engine_name

    prefix = f"SERVE_REPLICA::{app_name(index)}#{engine_name(index)}#"
    names = [name for name in actor_names() if name.startswith(prefix)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def actor_names() -> list[str]:
    """The names of the Ray instance's named actors (Serve's controller, replicas and proxies)."""
    return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.25)


@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_a_killed_replica_ends_its_stream_and_comes_back(server):
    stream = client(server).completions.create(prompt="def forever():", stream=True, **greedy(1900))
    next(iter(stream))  # running now on one replica
    running = [server.metric("num_requests_running", replica=r) for r in ("0", "1")]
    victim = running.index(max(running))
    assert running[victim] == 1, running
    killed_at = time.monotonic()
    ray.kill(replica_actor(victim))
    with pytest.raises(openai.APIError) as raised:  # the stream's error event
        for _ in stream:
            pass
    assert time.monotonic() - killed_at < KILL_ANSWER_S
    assert "replica" in str(raised.value)
    # the other replica serves meanwhile; Ray restarts the victim, and it serves again
    assert client(server).completions.create(prompt="x = 1\n", **greedy(3)).choices[0].text
    wait_until(lambda: server.metric("replica_up", replica=str(victim)) == 1, RESTART_S, "the replica restarted")
    for prompt in ("y = 2\n", "z = 3\n"):
        assert client(server).completions.create(prompt=prompt, **greedy(3)).choices[0].finish_reason == "length"


@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_every_route_asks_for_the_key(server):
    """With --api-key every route the process serves asks for it but /health and /metrics (as the
    single server): Ray Serve's proxy, which answered /-/routes and /-/healthz to anyone, does not
    run, and no ingress replica runs apart from the server (the routes are served in its process)."""
    for path in ("/-/routes", "/-/healthz", "/v1/models", "/openapi.json", "/docs"):
        refused = httpx.get(f"{server.url}{path}")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/-/routes", "/-/healthz"):
        missing = httpx.get(f"{server.url}{path}", headers=keyed)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error", path
    for path in ("/health", "/metrics"):  # open, for probes and scrapers, as in vLLM
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").models.list()
    assert [model.id for model in client(server).models.list().data] == [MODEL]
    assert not [name for name in actor_names() if name.startswith("SERVE_PROXY_ACTOR")]
    replicas = [name for name in actor_names() if name.startswith("SERVE_REPLICA::")]
    assert sorted(name.split("#")[1] for name in replicas) == ["engine-0", "engine-1"], replicas


def stream_events(server: ServerProcess, started: threading.Barrier, events: list[str]) -> None:
    """Stream a long completion; wait at started once its first event is in; then keep every
    event's data (the last two: an error event, then [DONE], where SIGTERM ended it)."""
    body = {"model": MODEL, "prompt": "def", "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=120) as response:
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line)
        events.append(next(lines))
        started.wait()
        events.extend(lines)


# last in the module: it stops the module's server
@pytest.mark.slow  # the module's Ray instance and server of 2 replicas: under a minute
@needs_ray
def test_sigterm_ends_every_stream_with_an_error_event_then_done(server):
    """SIGTERM with 6 streams and a whole completion in flight past --shutdown-timeout: each stream
    ends with an OpenAI error event (shutting_down), then data: [DONE] (they were cut with
    neither); the completion is a 503 in OpenAI's shape; meanwhile a new request is a 503
    shutting_down (it was refused a connection); the server exits 0 with no traceback."""
    streams = 6
    started = threading.Barrier(streams + 1)
    events: list[list[str]] = [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream_events, args=(server, started, e)) for e in events]
    whole: list[Exception] = []

    def complete() -> None:
        try:
            client(server).completions.create(prompt="def", **greedy(1900))
        except openai.APIError as e:
            whole.append(e)

    threads.append(threading.Thread(target=complete))
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    wait_until(lambda: server.metric("num_requests_running") == streams + 1, 60, "every request running")
    logged_before = len(server.output())  # an earlier test's replica kill may have logged its own
    server.process.send_signal(signal.SIGTERM)
    assert_drains(server.url, API_KEY, MODEL)
    for thread in threads:
        thread.join(timeout=120)
    for stream in events:
        assert stream[-1] == "[DONE]", stream[-3:]
        error = json.loads(stream[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "shutting_down"), error
    assert len(whole) == 1 and isinstance(whole[0], openai.InternalServerError), whole
    assert whole[0].status_code == 503 and whole[0].code == "shutting_down"
    assert whole[0].response.headers["content-type"] == "application/json"
    assert server.process.wait(timeout=120) == 0, server.output()
    assert "Traceback" not in server.output()[logged_before:], server.output()[logged_before:]
