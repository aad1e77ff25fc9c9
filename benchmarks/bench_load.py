"""Load and fault benchmark: `specdec serve` under a mix of good, rude and bad clients (issue 30).

    python benchmarks/bench_load.py [--model DIR --draft DIR] [--streams 500] [--seconds 60]

One server starts (the shipped pair by default; `--model smollm2 --draft models/smollm2-draft`
for SmolLM2) as a `specdec serve` subprocess. After a warm-up round (a tenth of the mix) and
once it is idle, its memory (VmRSS) is read; then --streams requests arrive at random times over
--seconds, from asyncio + httpx clients, each of one kind, answered as docs/server.md says:

    kind        what the client does                                what it must get
    stream      a streaming completion, read to the end             200, chunks, data: [DONE]
    whole       a completion, not streamed                          200, a JSON completion
    disconnect  a long stream, closed after a few chunks            200 and chunks until it leaves
    abort       a long stream, given up 20-500 ms after it is sent  nothing but a 200 before it gives up
    oversize    a body over --max-request-bytes (sized or chunked)  413 request_too_large
    malformed   broken JSON or a field out of range                 400 invalid_request_error
    unknown     a model this server does not serve                  404 model_not_found

Every error body is OpenAI's shape ({"error": {message, type, param, code}}) and never a
traceback. A probe asks /health every 100 ms throughout and keeps its slowest answer. At the end:
every request ended (none past --request-timeout: a hang), each as its kind must, the server is
alive, the block manager holds no block once the server is idle (specdec:kv_cache_blocks_held;
blocks kept only for the prefix cache are not held), and its memory is within 10% of before the
load. Prints a table of the kinds and one of the goals; exits 1 if a goal is missed. Speed is
printed, never judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from specdec.paths import ROOT, SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.serve.process import ServerProcess
from specdec.tools.benchmark.prompts import held_out_code_prompts

LOGS = ROOT / "bench_out" / "load-logs"  # the server's output
KIND_WEIGHTS = {  # the share of each kind of request in the mix
    "stream": 0.40,
    "whole": 0.10,
    "disconnect": 0.12,
    "abort": 0.12,
    "oversize": 0.08,
    "malformed": 0.12,
    "unknown": 0.06,
}
MALFORMED = [  # (a body that is not a valid request, as bytes or as JSON)
    b'{"prompt": "def add(a, b):", "max_tokens": ',
    b"\xff\xfe not JSON at all",
    {"prompt": "def add(a, b):", "max_tokens": -3},
    {"prompt": "def add(a, b):", "temperature": -1},
    {"prompt": "def add(a, b):", "n": 0},
    {"max_tokens": 4},
    {"prompt": {"text": "a prompt in the wrong shape"}},
    {"prompt": "def add(a, b):", "presence_penalty": 2.5},
    {"prompt": "def add(a, b):", "guided_json": {"type": "objekt"}},
    {"prompt": "def add(a, b):", "temprature": 0.5},
]
UNKNOWN_MODEL = "gpt-unknown"
HEALTH_INTERVAL = 0.1  # seconds between /health probes
GOAL_MAX_STALL = 1.0  # seconds: the slowest /health answer
GOAL_RSS_GROWTH = 0.10  # the server's memory after the load over before, less 1


@dataclass
class Outcome:
    """How one request ended. ended: "completed" (read to its end), "disconnected" / "aborted"
    (the client left), "refused" (an error status), "hung" (no end within the timeout), "failed"
    (the connection broke, or the answer was not what its kind must get: problem says why)."""

    kind: str
    ended: str = "failed"
    status: int | None = None
    chunks: int = 0
    done: bool = False
    seconds: float = 0.0
    longest_gap: float = 0.0  # the longest wait between two chunks of a stream
    problem: str = ""


@dataclass
class HealthProbe:
    """/health every HEALTH_INTERVAL seconds while the load runs: its answers, those not 200, and
    the slowest (a probe that got no answer counts as slow as its timeout)."""

    answers: int = 0
    not_ok: int = 0
    slowest: float = 0.0
    latencies: list[float] = field(default_factory=list)

    async def run(self, client: httpx.AsyncClient, url: str, stop: asyncio.Event, timeout: float = 10.0) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = (await client.get(f"{url}/health", timeout=timeout)).status_code == 200
            except httpx.HTTPError:
                ok = False
            latency = time.perf_counter() - start
            self.answers, self.not_ok = self.answers + 1, self.not_ok + (not ok)
            self.slowest = max(self.slowest, latency)
            self.latencies.append(latency)
            try:
                await asyncio.wait_for(stop.wait(), HEALTH_INTERVAL)
            except asyncio.TimeoutError:
                pass


# --- the mix ------------------------------------------------------------------------------------


@dataclass
class MixSettings:
    """The requests of one run: how many, over how long, what they ask for."""

    streams: int
    seconds: float
    prompts: list[str]
    max_request_bytes: int
    min_tokens: int = 8
    max_tokens: int = 48
    long_tokens: int = 256  # a stream the client leaves early: long enough to be left mid-way
    request_timeout: float = 180.0
    seed: int = 0


def kinds_for(count: int, rng: random.Random) -> list[str]:
    """count kinds in KIND_WEIGHTS' shares (each at least once where count allows), shuffled."""
    counts = {kind: max(1, round(weight * count)) for kind, weight in KIND_WEIGHTS.items()}
    while sum(counts.values()) > count and counts["stream"] > 1:
        counts["stream"] -= 1
    counts["stream"] += count - sum(counts.values())
    kinds = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(kinds)
    return kinds


def completion_body(settings: MixSettings, rng: random.Random, kind: str) -> dict:
    """A valid streaming completion request (whole: not streamed) for kind."""
    long = kind in ("disconnect", "abort")
    body = {
        "prompt": rng.choice(settings.prompts),
        "max_tokens": settings.long_tokens if long else rng.randint(settings.min_tokens, settings.max_tokens),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1 << 30),
        "stream": kind != "whole",
        "ignore_eos": long or rng.random() < 0.5,
    }
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


async def run_mix(url: str, settings: MixSettings) -> tuple[list[Outcome], HealthProbe]:
    """settings.streams requests at random times over settings.seconds, a /health probe all the
    while; returns each request's outcome (in the order sent) and the probe."""
    rng = random.Random(settings.seed)
    kinds = kinds_for(settings.streams, rng)
    starts = sorted(rng.uniform(0, settings.seconds) for _ in kinds)
    plans = [(kind, start, random.Random(rng.randrange(1 << 30))) for kind, start in zip(kinds, starts)]
    limits = httpx.Limits(max_connections=settings.streams + 16, max_keepalive_connections=32)
    timeout = httpx.Timeout(settings.request_timeout, connect=30)
    probe, stop = HealthProbe(), asyncio.Event()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        probing = asyncio.ensure_future(probe.run(client, url, stop))
        began = time.perf_counter()
        outcomes = await asyncio.gather(
            *(_timed(client, url, settings, kind, began + start, kind_rng) for kind, start, kind_rng in plans)
        )
        stop.set()
        await probing
    return list(outcomes), probe


async def _timed(
    client: httpx.AsyncClient, url: str, settings: MixSettings, kind: str, at: float, rng: random.Random
) -> Outcome:
    """One request of kind, sent at perf_counter time at, ended within the request timeout (else
    it hung: the client gives up on it)."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    outcome = Outcome(kind)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(SENDERS[kind](client, url, settings, rng, outcome), settings.request_timeout)
    except asyncio.TimeoutError:
        outcome.ended, outcome.problem = "hung", f"no end after {settings.request_timeout:.0f} s"
    except httpx.HTTPError as e:
        outcome.ended, outcome.problem = "failed", f"{type(e).__name__}: {e}"
    outcome.seconds = time.perf_counter() - start
    return outcome


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, outcome: Outcome, leave_after: int | None = None
) -> None:
    """A streaming completion read chunk by chunk, to data: [DONE] (or left after leave_after
    chunks: the client disconnects); an error status or an error event is a problem."""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.ended, outcome.problem = "refused", (await response.aread()).decode(errors="replace")[:200]
            return
        last = time.perf_counter()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            outcome.longest_gap, last = max(outcome.longest_gap, now - last), now
            if line == "data: [DONE]":
                outcome.done, outcome.ended = True, "completed"
                return
            outcome.chunks += 1
            if "error" in json.loads(line[6:]):
                outcome.problem = f"an error event: {line[6:206]}"
            if leave_after is not None and outcome.chunks >= leave_after:
                outcome.ended = "disconnected"
                return  # leaving the block closes the connection mid-stream
        outcome.problem = outcome.problem or f"the stream ended after {outcome.chunks} chunks without data: [DONE]"


async def send_stream(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    await _stream(client, url, completion_body(settings, rng, "stream"), outcome)
    if outcome.ended != "completed" or outcome.chunks < 1:
        outcome.problem = outcome.problem or "no chunk before data: [DONE]"


async def send_whole(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    response = await client.post(f"{url}/v1/completions", json=completion_body(settings, rng, "whole"))
    outcome.status = response.status_code
    choices = response.json().get("choices") if response.status_code == 200 else None
    if not choices or choices[0].get("finish_reason") not in ("length", "stop"):
        outcome.ended, outcome.problem = "failed", f"not a completion: {response.text[:200]}"
    else:
        outcome.ended = "completed"


async def send_disconnect(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    await _stream(client, url, completion_body(settings, rng, "disconnect"), outcome, leave_after=rng.randint(1, 4))
    if outcome.ended not in ("disconnected", "completed"):
        outcome.problem = outcome.problem or "no chunk before it left"


async def send_abort(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    """A long stream given up after a random 20-500 ms: whatever the server had sent by then
    (nothing, a 200's headers, some chunks), nothing else but a 200."""
    try:
        await asyncio.wait_for(
            _stream(client, url, completion_body(settings, rng, "abort"), outcome), rng.uniform(0.02, 0.5)
        )
    except asyncio.TimeoutError:
        outcome.ended = "aborted"
    if outcome.status not in (None, 200):
        outcome.ended = "refused"


async def send_oversize(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    """A body twice the server's limit: half of them say their length, half come in chunks."""
    body = json.dumps({"prompt": "def add(a, b): " * (2 * settings.max_request_bytes // 15)}).encode()
    sized = rng.random() < 0.5
    content = body if sized else _chunks(body, 64 * 1024)
    headers = {"Content-Type": "application/json"}
    response = await client.post(f"{url}/v1/completions", content=content, headers=headers)
    _check_error(response, outcome, 413, code="request_too_large")


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def send_malformed(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    body = rng.choice(MALFORMED)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    response = await client.post(f"{url}/v1/completions", content=content, headers=headers)
    _check_error(response, outcome, 400, type_="invalid_request_error")


async def send_unknown(client, url, settings: MixSettings, rng: random.Random, outcome: Outcome) -> None:
    body = {**completion_body(settings, rng, "whole"), "model": UNKNOWN_MODEL}
    response = await client.post(f"{url}/v1/completions", json=body)
    _check_error(response, outcome, 404, code="model_not_found")


SENDERS = {
    "stream": send_stream,
    "whole": send_whole,
    "disconnect": send_disconnect,
    "abort": send_abort,
    "oversize": send_oversize,
    "malformed": send_malformed,
    "unknown": send_unknown,
}


def _check_error(response: httpx.Response, outcome: Outcome, status: int, code=None, type_=None) -> None:
    """outcome refused, with a problem unless response is an OpenAI-shaped error of status (and
    code, type_) whose message is no traceback."""
    outcome.status, outcome.ended = response.status_code, "refused"
    problem = error_shape_problem(response.text)
    if response.status_code != status:
        problem = f"status {response.status_code}, not {status}: {response.text[:200]}"
    elif problem is None:
        error = response.json()["error"]
        if code is not None and error["code"] != code or type_ is not None and error["type"] != type_:
            problem = f"not code {code} / type {type_}: {error}"
    outcome.problem = problem or ""


def error_shape_problem(text: str) -> str | None:
    """What is wrong with an error body (None: OpenAI's shape, a message with no traceback)."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not OpenAI's error shape: {text[:200]!r}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"not OpenAI's error shape: {error}"
    if "Traceback" in error["message"] or 'File "' in error["message"]:
        return f"a traceback shown to the client: {error['message'][:200]}"
    return None


# --- the server ---------------------------------------------------------------------------------


async def server_state(url: str) -> dict[str, float]:
    """/metrics' gauges that say whether the server is idle: requests running and waiting, blocks held."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    wanted = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_held", "engine_step_failures_total")
    values = {}
    for line in text.splitlines():
        name = line.split("{")[0].removeprefix("specdec:")
        if name in wanted:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The idle gauges once nothing runs, waits or holds blocks (aborts are taken between engine
    steps), or as they are after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        state = await server_state(url)
        idle = not any(
            state.get(name, 1) for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_held")
        )
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


def rss_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


# --- checks and tables --------------------------------------------------------------------------


def problems(outcomes: list[Outcome]) -> list[str]:
    """Every request that did not end as its kind must: one line each."""
    expected = {
        "stream": ("completed",),
        "whole": ("completed",),
        "disconnect": ("disconnected", "completed"),
        "abort": ("aborted", "completed", "disconnected"),
        "oversize": ("refused",),
        "malformed": ("refused",),
        "unknown": ("refused",),
    }
    return [
        f"#{i} {o.kind}: ended {o.ended}, status {o.status}: {o.problem}"
        for i, o in enumerate(outcomes)
        if o.problem or o.ended not in expected[o.kind]
    ]


def kind_table(outcomes: list[Outcome]) -> str:
    rows = [
        "| kind | sent | statuses | ended | as it must | p50 s | max s | longest chunk gap s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in KIND_WEIGHTS:
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        ok = len(mine) - len(problems(mine))
        statuses = ", ".join(f"{s or '-'}×{n}" for s, n in sorted(Counter(o.status for o in mine).items(), key=str))
        ended = ", ".join(f"{e}×{n}" for e, n in Counter(o.ended for o in mine).most_common())
        seconds = [o.seconds for o in mine]
        gap = max(o.longest_gap for o in mine)
        rows.append(
            f"| {kind} | {len(mine)} | {statuses} | {ended} | {ok}/{len(mine)}{'' if ok == len(mine) else ' !'} "
            f"| {statistics.median(seconds):.2f} | {max(seconds):.2f} | {gap:.2f} |"
        )
    return "\n".join(rows)


def goal_rows(report: dict) -> list[tuple[str, str, str, bool]]:
    """(goal, measured, target, met) for the run's report."""
    rss_growth = report["rss_after"] / report["rss_before"] - 1
    return [
        ("requests hanging", str(report["hung"]), "0", report["hung"] == 0),
        ("requests not as documented", str(len(report["problems"])), "0", not report["problems"]),
        ("server alive after the load", str(report["alive"]), "True", report["alive"]),
        (
            "slowest /health answer",
            f"{report['slowest_health']:.3f} s",
            f"< {GOAL_MAX_STALL:g} s",
            report["slowest_health"] < GOAL_MAX_STALL,
        ),
        ("/health answers not 200", str(report["health_not_ok"]), "0", report["health_not_ok"] == 0),
        ("blocks held once idle", f"{report['blocks_held']:g}", "0", report["blocks_held"] == 0),
        (
            "server memory (VmRSS) after / before",
            f"{report['rss_after'] / 2**20:.0f} / {report['rss_before'] / 2**20:.0f} MiB ({rss_growth:+.1%})",
            f"within {GOAL_RSS_GROWTH:.0%}",
            abs(rss_growth) <= GOAL_RSS_GROWTH,
        ),
        ("failed engine steps", f"{report['step_failures']:g}", "0", report["step_failures"] == 0),
    ]


def goal_table(report: dict) -> str:
    rows = ["| goal | measured | target | met |", "|---|---|---|---|"]
    rows += [
        f"| {goal} | {value} | {target} | {'yes' if met else 'NO'} |" for goal, value, target, met in goal_rows(report)
    ]
    return "\n".join(rows)


# --- the run ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--model", default=str(SHIPPED_TARGET), help="the target to serve (default: the shipped code target)"
    )
    p.add_argument(
        "--draft", default=str(SHIPPED_DRAFT), help="its draft model ('none' for none; default: the shipped draft)"
    )
    p.add_argument("--streams", type=int, default=500, help="requests in the load (default 500)")
    p.add_argument("--seconds", type=float, default=60.0, help="the time they arrive over (default 60)")
    p.add_argument("--max-tokens", type=int, default=48, help="the most tokens a whole stream asks for (default 48)")
    p.add_argument("--long-tokens", type=int, default=256, help="tokens of a stream the client leaves (default 256)")
    p.add_argument("--prompt-chars", type=int, default=400, help="a prompt's characters at most (default 400)")
    p.add_argument(
        "--max-request-bytes", type=int, default=256 * 1024, help="the server's body limit (default 256 KiB)"
    )
    p.add_argument("--request-timeout", type=float, default=180.0, help="seconds before a request counts as hung")
    p.add_argument("--loads", type=int, default=1, help="run the load this many times, one after another (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more flags for specdec serve, in one string")
    p.add_argument("--json", type=Path, help="write the report here too")
    return p.parse_args(argv)


def server_args(args: argparse.Namespace) -> list[str]:
    flags = [args.model, "--max-request-bytes", str(args.max_request_bytes)]
    if args.draft != "none":
        flags += ["--draft", args.draft]
    return flags + args.server_args.split()


def settings_for(args: argparse.Namespace, streams: int, seconds: float, seed: int) -> MixSettings:
    prompts = [p.text for p in held_out_code_prompts(per_module=2, max_chars=args.prompt_chars)]
    return MixSettings(
        streams=streams,
        seconds=seconds,
        prompts=prompts,
        max_request_bytes=args.max_request_bytes,
        max_tokens=args.max_tokens,
        long_tokens=args.long_tokens,
        request_timeout=args.request_timeout,
        seed=seed,
    )


async def measure(server: ServerProcess, args: argparse.Namespace) -> dict:
    """Warm up, read the idle server's memory, run the load (--loads times), waiting for idle
    and reading the memory after each."""
    warm_up = settings_for(args, max(len(KIND_WEIGHTS), args.streams // 10), max(1.0, args.seconds / 10), args.seed + 1)
    await run_mix(server.url, warm_up)
    await wait_until_idle(server.url)
    rss = [rss_bytes(server.process.pid)]
    outcomes, probes, load_seconds, idle = [], [], [], {}
    for load in range(args.loads):
        start = time.perf_counter()
        ended, probe = await run_mix(server.url, settings_for(args, args.streams, args.seconds, args.seed + 2 * load))
        load_seconds.append(time.perf_counter() - start)
        outcomes += ended
        probes.append(probe)
        idle = await wait_until_idle(server.url)
        rss.append(rss_bytes(server.process.pid))
    alive = server.process.poll() is None and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    return {
        "outcomes": [asdict(o) for o in outcomes],
        "problems": problems(outcomes),
        "hung": sum(o.ended == "hung" for o in outcomes),
        "alive": alive,
        "slowest_health": max(probe.slowest for probe in probes),
        "health_answers": sum(probe.answers for probe in probes),
        "health_not_ok": sum(probe.not_ok for probe in probes),
        "blocks_held": idle.get("kv_cache_blocks_held", -1),
        "idle": idle,
        "step_failures": idle.get("engine_step_failures_total", 0),
        "rss": rss,  # bytes: before the load, then after each
        "rss_before": rss[0],
        "rss_after": rss[-1],
        "load_seconds": load_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cpu = f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"
    print(f"specdec serve {' '.join(server_args(args))}\nCPU: {cpu}; {args.streams} requests over {args.seconds:g} s")
    server = ServerProcess(server_args(args), LOGS / "server.log")
    try:
        report = asyncio.run(measure(server, args))
    finally:
        exit_code = server.stop()
    report.update(cpu=cpu, exit_code=exit_code, server_log_tracebacks=server.output().count("Traceback"))
    outcomes = [Outcome(**o) for o in report["outcomes"]]
    loads = ", ".join(f"{seconds:.1f}" for seconds in report["load_seconds"])
    memory = " -> ".join(f"{value / 2**20:.0f}" for value in report["rss"])
    print(
        f"\nThe load: {len(outcomes)} requests, ended in {loads} s; /health answered {report['health_answers']} "
        f"times; server VmRSS before and after each load: {memory} MiB\n"
    )
    print(kind_table(outcomes) + "\n")
    print(goal_table(report))
    print(
        f"\nThe server exited {exit_code} on SIGTERM; tracebacks in its log: "
        f"{report['server_log_tracebacks']} ({server.log_path})"
    )
    for line in report["problems"][:20]:
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(met for *_, met in goal_rows(report)) and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
