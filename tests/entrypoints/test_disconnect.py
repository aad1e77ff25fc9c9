"""A client that disconnects is aborted at once, wherever its request is (issue 49, item 3):
waiting for a slot (dropped before any prefill), in the step that prefills it (out of the batch
right after that step: the engine's thread takes aborts between steps, so between prefill chunks
of --max-prefill-tokens), or decoding; completions and chat, streamed and whole.

The server's app runs on uvicorn in a thread of this process (as in test_faults.py), so that a
test can hold a prefill until the server has seen its client leave, slow the rounds down, and
see which requests the engine prefilled. Clients are raw sockets: a test sends a request, reads
nothing, and closes the socket when its client is to leave. Each abort is counted in /metrics as
aborted (specdec:request_aborted, by stage), never as a success, and the engine holds no request
and no block soon after."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import torch
from test_faults import InProcessServer as ServerWithFaults
from test_faults import wait_for

from helpers import save_tiny_pair
from specdec import LLM

# slow: a server in this process (seconds); alone: its requests are timed against each other's steps
pytestmark = [pytest.mark.slow, pytest.mark.alone]

CONTEXT = 1024
SLOTS = 2
K = 3
PREFILL_BUDGET = 600  # tokens one step prefills: one prompt of LONG_PROMPT tokens per step
LONG_PROMPT = 400
ROUND_SECONDS = 0.02  # each round is held this long: a long request decodes for seconds
LONG_TOKENS = 900  # a request that would decode for seconds: 225 rounds at least, of at most K + 1 tokens
WAIT = 30.0  # seconds: the most any condition may take (past it, a hang)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
ROUTES = [("completions", True), ("completions", False), ("chat", True), ("chat", False)]
ROUTE_IDS = ["completion-stream", "completion-whole", "chat-stream", "chat-whole"]


class HeldPrefills:
    """Stands in for the engine's prefill: records the request id of every sequence prefilled
    and passes the call on, but while held, a prefill waits (entered set) until released."""

    def __init__(self, prefill: Callable):
        self.prefill = prefill
        self.request_ids: list[str] = []
        self.entered = threading.Event()
        self.released = threading.Event()
        self.released.set()

    def hold(self) -> None:
        self.entered.clear()
        self.released.clear()

    def __call__(self, batch, *args, **kwargs):
        self.request_ids += [seq.request_id for seq in batch]
        self.entered.set()
        assert self.released.wait(WAIT), "a held prefill was never released"
        return self.prefill(batch, *args, **kwargs)


def slowed(run: Callable) -> Callable:
    """The engine's round, each call ROUND_SECONDS late (outputs unchanged)."""

    def run_slowly(*args, **kwargs):
        time.sleep(ROUND_SECONDS)
        return run(*args, **kwargs)

    return run_slowly


class InProcessServer(ServerWithFaults):
    """The tiny pair served in this process (test_faults' server) with a prefill budget of
    PREFILL_BUDGET, its prefills recorded (and holdable: HeldPrefills), its rounds slowed."""

    def __init__(self, llm: LLM):
        super().__init__(llm, max_prefill_tokens=PREFILL_BUDGET)

    def instrument(self) -> None:
        self.prefills = HeldPrefills(self.engine.round.prefill)
        self.engine.round.prefill = self.prefills
        self.engine.round.run = slowed(self.engine.round.run)

    def metric(self, name: str, **labels: str) -> float:
        """specdec:<name> from /metrics, summed over the series whose labels include labels."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] == f"specdec:{name}" and all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total

    def counts(self) -> dict[str, float]:
        """The counters a test compares before and after."""
        return {
            "success": self.metric("request_success_total"),
            "aborted waiting": self.metric("request_aborted_total", stage="waiting"),
            "aborted running": self.metric("request_aborted_total", stage="running"),
            "generated": self.metric("generation_tokens_total"),
        }

    def counted_since(self, before: dict[str, float]) -> dict[str, float]:
        return {name: value - before[name] for name, value in self.counts().items()}

    def wait_until_idle(self) -> None:
        """Until no request runs or waits and no block is held, the engine's and /metrics' word."""
        blocks = self.engine.capacity.blocks
        assert blocks is not None
        wait_for(
            lambda: not self.engine.has_unfinished_requests() and blocks.num_held == 0,
            "the engine to hold no request and no block",
        )
        wait_for(
            lambda: self.metric("num_requests_running") + self.metric("num_requests_waiting") == 0,
            "/metrics to show no request running or waiting",
        )


def prompt_ids(length: int, seed: int) -> list[int]:
    """A prompt of length token ids of the tiny vocabulary, one per seed (no shared prefix)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 300, (length,), generator=generator).tolist()


def request(route: str, stream: bool, max_tokens: int, prompt: list | None = None, seed: int = 0) -> tuple[str, dict]:
    """(path, body) of a greedy request on route, EOS ignored; prompt: the completion's prompt
    (token ids, or a list of them; default 16 ids of seed). A chat's message is text of seed."""
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if route == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {seed}"}], **common}
    return "/v1/completions", {"prompt": prompt if prompt is not None else prompt_ids(16, seed), **common}


def send(server: InProcessServer, path: str, body: dict) -> socket.socket:
    """body POSTed to path on a connection of its own; nothing is read. Closing the socket is the
    client leaving."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    client = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    client.sendall(head.encode() + data)
    return client


def read_to_the_end(client: socket.socket) -> bytes:
    """Everything the server answers on client's connection, until it closes it."""
    answer = b""
    while chunk := client.recv(65536):
        answer += chunk
    client.close()
    return answer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("disconnect"), 31, 32, "llama", max_position_embeddings=CONTEXT)
    config_path = pair["target"] / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": CHAT_TEMPLATE}))
    return pair


@pytest.fixture(scope="module")
def server(model_dirs):
    llm = LLM(
        str(model_dirs["target"]),
        speculative_model=str(model_dirs["draft"]),
        num_speculative_tokens=K,
        dtype="float32",
        compile="off",
        max_num_seqs=SLOTS,
    )
    server = InProcessServer(llm)
    yield server
    server.stop()


@pytest.fixture
def idle_server(server):
    """The module's server, idle before and after the test."""
    server.wait_until_idle()
    yield server
    server.prefills.released.set()
    server.wait_until_idle()


@pytest.mark.parametrize(("route", "stream"), ROUTES, ids=ROUTE_IDS)
def test_a_request_read_to_its_end_counts_as_a_success(idle_server, route, stream):
    before = idle_server.counts()
    answer = read_to_the_end(send(idle_server, *request(route, stream, max_tokens=8)))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert (b"data: [DONE]" in answer) == stream
    idle_server.wait_until_idle()
    assert idle_server.counted_since(before) == {
        "success": 1,
        "aborted waiting": 0,
        "aborted running": 0,
        "generated": 8,
    }


@pytest.mark.parametrize(("route", "stream"), ROUTES, ids=ROUTE_IDS)
def test_a_client_that_leaves_while_waiting_for_a_slot_is_dropped_before_any_prefill(idle_server, route, stream):
    """Every slot is taken by a long request; a third waits. Its client leaves: it is dropped
    from the queue, never prefilled, counted as aborted while waiting. Then the long requests'
    clients leave too: aborted while running, having generated far fewer tokens than asked."""
    server = idle_server
    before = server.counts()
    occupying = [send(server, *request("completions", True, LONG_TOKENS, seed=seed)) for seed in range(SLOTS)]
    wait_for(lambda: server.engine.num_running == SLOTS, f"{SLOTS} long requests to run")
    waiting = send(server, *request(route, stream, max_tokens=100, seed=7))
    wait_for(lambda: server.engine.num_waiting == 1, "a request to wait for a slot")
    waiting_id = server.engine.scheduler.waiting[0].request_id
    waiting.close()
    wait_for(lambda: server.engine.num_waiting == 0, "the waiting request to be dropped")
    assert server.engine.num_running == SLOTS  # the long requests go on
    assert waiting_id not in server.prefills.request_ids
    assert server.counted_since(before)["aborted waiting"] == 1
    for client in occupying:
        client.close()
    server.wait_until_idle()
    counted = server.counted_since(before)
    assert (counted["success"], counted["aborted waiting"], counted["aborted running"]) == (0, 1, SLOTS)
    assert counted["generated"] < SLOTS * LONG_TOKENS / 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_leaves_during_a_prefill_is_aborted_before_the_next_prefill_chunk(idle_server, stream):
    """Three prompts of LONG_PROMPT tokens in one completion: a step prefills one of them
    (PREFILL_BUDGET). The client leaves while the first prefill runs (held until the server has
    seen it leave): after that step, all three are aborted, the first while running (its first
    tokens, one round's at most), the other two while waiting, never prefilled."""
    server = idle_server
    before = server.counts()
    prefilled_before = len(server.prefills.request_ids)
    server.prefills.hold()
    prompts = [prompt_ids(LONG_PROMPT, seed=100 + i) for i in range(3)]
    client = send(server, *request("completions", stream, max_tokens=200, prompt=prompts))
    assert server.prefills.entered.wait(WAIT), "the first prompt's prefill did not start"
    client.close()
    wait_for(lambda: server.async_engine.num_open_requests == 0, "the server to see its client leave")
    server.prefills.released.set()
    server.wait_until_idle()
    assert len(server.prefills.request_ids) - prefilled_before == 1  # the first prompt's prefill only
    counted = server.counted_since(before)
    assert (counted["success"], counted["aborted waiting"], counted["aborted running"]) == (0, 2, 1)
    assert counted["generated"] <= 1 + K + 1  # the prefill's token and the round of its step


@pytest.mark.parametrize(("route", "stream"), ROUTES, ids=ROUTE_IDS)
def test_a_client_that_leaves_while_decoding_is_aborted(idle_server, route, stream):
    server = idle_server
    before = server.counts()
    client = send(server, *request(route, stream, LONG_TOKENS, seed=3))
    wait_for(lambda: server.counted_since(before)["generated"] >= 20, "the request to decode")
    client.close()
    server.wait_until_idle()
    counted = server.counted_since(before)
    assert (counted["success"], counted["aborted waiting"], counted["aborted running"]) == (0, 0, 1)
    assert counted["generated"] < LONG_TOKENS / 2
