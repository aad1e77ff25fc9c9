"""Disconnect benchmark: what clients that leave before their first token cost a live request (issue 49, item 3).

    python benchmarks/bench_disconnect.py [--model smollm2] [--draft none] [--clients 60] [--rounds 3]

One `specdec serve` subprocess (SmolLM2-135M-Instruct, `specdec fetch smollm2`, without a drafter
by default: which requests run is the scheduler's, whatever drafts; a drafter's server spends
minutes timing its rounds before it listens). After a warm-up (a leaver's prompt and the live
request, untimed), each round:

1. idle: a live request (a whole completion of --live-tokens tokens, greedy) on the idle server,
   timed from send to its answer;
2. load: --clients clients each send a completion of a --prompt-tokens-token prompt (text, one
   of its own, no shared prefix; --leave-tokens tokens asked for, half of them streamed) and
   close their connection --leave-after s later, before any token reaches them; --live-after s
   after they were sent, the live request is sent again and timed.

After each round, once the server is idle, /metrics says what the leavers cost: the prompt
tokens prefilled and the tokens generated for them (the live request's own taken off, where it
was answered within --live-timeout), and how they were counted (specdec:request_aborted by
stage, specdec:request_success). Prints a table of the rounds and the goal: the live request's
time after the leavers, less its time on the idle server, under --goal-extra s (median over
rounds). Speed is printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from specdec.paths import ROOT
from specdec.prompts import PromptEncoder
from specdec.serve.process import ServerProcess
from specdec.tools.benchmark.prompts import held_out_sources

LOGS = ROOT / "bench_out" / "disconnect-logs"  # the server's output
LIVE_PROMPT = "def fibonacci(n):"
IDLE_TIMEOUT = 900.0  # seconds: the most the server may take to be idle after a round


@dataclass
class Round:
    """One round's measurements. idle_seconds / loaded_seconds: the live request on the idle
    server, and after the leavers; the rest are /metrics' counters over the round, the live
    request's share taken off: the leavers' prompt tokens prefilled and tokens generated, their
    aborts by stage, and requests counted as successes (the live one's not)."""

    idle_seconds: float
    loaded_seconds: float
    prefilled: float
    generated: float
    aborted_waiting: float
    aborted_running: float
    successes: float

    @property
    def extra_seconds(self) -> float:
        return self.loaded_seconds - self.idle_seconds


# --- the clients ----------------------------------------------------------------------------------


def leaver_prompts(model: str, count: int, prompt_tokens: int) -> list[str]:
    """count code prompts of about prompt_tokens tokens each (the model's tokenizer), each from
    its own place in the held-out sources and starting with its own line (no shared prefix)."""
    tokenizer = PromptEncoder.load(model).need_tokenizer("the leavers' prompts")
    source = "\n".join(text for _, text in held_out_sources())
    step = max(1, (len(source) - 8 * prompt_tokens) // count)
    prompts = []
    for i in range(count):
        text = f"# client {i}\n" + source[i * step : i * step + 8 * prompt_tokens]
        prompts.append(tokenizer.decode(tokenizer.encode(text)[:prompt_tokens]))
    return prompts


async def leave_early(port: int, body: dict, leave_after: float) -> None:
    """body POSTed to /v1/completions on a connection of its own, closed leave_after s later
    with nothing read."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + data)
    await writer.drain()
    await asyncio.sleep(leave_after)
    writer.close()
    await writer.wait_closed()


async def live_request(client: httpx.AsyncClient, url: str, tokens: int, timeout: float) -> float:
    """Seconds from sending the live request to its whole answer; inf past timeout s (the client
    gives up)."""
    body = {"prompt": LIVE_PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return math.inf
    seconds = time.perf_counter() - start
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == tokens, response.text
    return seconds


# --- the server's counters ------------------------------------------------------------------------


async def counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The /metrics counters and gauges a round reads, each summed over its series."""
    wanted = {
        "specdec:prompt_tokens_total": "prompt",
        "specdec:generation_tokens_total": "generated",
        "specdec:request_success_total": "successes",
        "specdec:num_requests_running": "running",
        "specdec:num_requests_waiting": "waiting",
    }
    values = dict.fromkeys([*wanted.values(), "aborted_waiting", "aborted_running"], 0.0)
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.split("{")[0]
        if name in wanted:
            values[wanted[name]] += float(value)
        elif name == "specdec:request_aborted_total":
            values["aborted_waiting" if 'stage="waiting"' in series else "aborted_running"] += float(value)
    return values


async def wait_until_idle(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_TIMEOUT
    while True:
        values = await counters(client, url)
        if values["running"] + values["waiting"] == 0:
            return values
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not idle {IDLE_TIMEOUT:g} s after the round: {values}")
        await asyncio.sleep(0.1)


# --- a round --------------------------------------------------------------------------------------


async def run_round(
    server: ServerProcess, args: argparse.Namespace, prompts: list[str], live_prompt_tokens: int
) -> Round:
    """One round (the module's docstring): the live request idle, then after the leavers."""
    async with httpx.AsyncClient(timeout=IDLE_TIMEOUT) as client:
        await wait_until_idle(client, server.url)
        idle_seconds = await live_request(client, server.url, args.live_tokens, args.live_timeout)
        before = await wait_until_idle(client, server.url)
        leavers = [
            asyncio.ensure_future(
                leave_early(
                    server.port,
                    {
                        "prompt": prompt,
                        "max_tokens": args.leave_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": i % 2 == 0,
                    },
                    args.leave_after,
                )
            )
            for i, prompt in enumerate(prompts)
        ]
        await asyncio.sleep(args.live_after)
        loaded_seconds = await live_request(client, server.url, args.live_tokens, args.live_timeout)
        await asyncio.gather(*leavers)
        after = await wait_until_idle(client, server.url)
    counted = {name: after[name] - before[name] for name in after}
    answered = math.isfinite(loaded_seconds)  # else the live request's own share is not known: none is taken off
    return Round(
        idle_seconds=idle_seconds,
        loaded_seconds=loaded_seconds,
        prefilled=counted["prompt"] - live_prompt_tokens * answered,
        generated=counted["generated"] - args.live_tokens * answered,
        aborted_waiting=counted["aborted_waiting"],
        aborted_running=counted["aborted_running"],
        successes=counted["successes"] - answered,
    )


async def warm_up(server: ServerProcess, args: argparse.Namespace, prompt: str) -> None:
    """A leaver's prompt and the live request, run to their ends before the rounds (untimed): the
    first prefill and the first decode of a fresh server are slower."""
    async with httpx.AsyncClient(timeout=IDLE_TIMEOUT) as client:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        (await client.post(f"{server.url}/v1/completions", json=body)).raise_for_status()
        await live_request(client, server.url, args.live_tokens, IDLE_TIMEOUT)


def round_table(rounds: list[Round], args: argparse.Namespace) -> str:
    rows = [
        f"| round | live request, idle server (s) | live request, {args.clients} clients left (s) | extra (s) "
        "| leavers' prompt tokens prefilled | leavers' tokens generated | aborted waiting / running "
        "| leavers counted as successes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for number, r in enumerate(rounds, 1):
        rows.append(
            f"| {number} | {r.idle_seconds:.3f} | {r.loaded_seconds:.3f} | {r.extra_seconds:+.3f} | {r.prefilled:,.0f} "
            f"| {r.generated:,.0f} | {r.aborted_waiting:.0f} / {r.aborted_running:.0f} | {r.successes:.0f} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", default="smollm2", help="the target to serve (default smollm2: specdec fetch smollm2)")
    p.add_argument("--draft", default="none", help="its draft model (default none; models/smollm2-draft is SmolLM2's)")
    p.add_argument("--clients", type=int, default=60, help="clients that leave early, per round (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="tokens of a leaver's prompt (default 400)")
    p.add_argument("--leave-tokens", type=int, default=256, help="tokens a leaver asks for (default 256)")
    p.add_argument("--leave-after", type=float, default=0.5, help="seconds until a leaver closes (default 0.5)")
    p.add_argument(
        "--live-after", type=float, default=1.0, help="seconds from the leavers' sending to the live request's (1.0)"
    )
    p.add_argument("--live-tokens", type=int, default=16, help="tokens the live request asks for (default 16)")
    p.add_argument(
        "--live-timeout", type=float, default=120.0, help="seconds the live request waits at most (default 120)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--goal-extra", type=float, default=0.5, help="the goal: extra seconds at most (default 0.5)")
    p.add_argument("--server-args", default="", help="more flags for specdec serve, in one string")
    return p.parse_args(argv)


def server_args(args: argparse.Namespace) -> list[str]:
    flags = [args.model]
    if args.draft != "none":
        flags += ["--draft", args.draft]
    return flags + args.server_args.split()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cpu = f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"
    print(f"specdec serve {' '.join(server_args(args))}\nCPU: {cpu}")
    prompts = leaver_prompts(args.model, args.clients, args.prompt_tokens)
    live_prompt_tokens = len(PromptEncoder.load(args.model).need_tokenizer("the live prompt").encode(LIVE_PROMPT))
    server = ServerProcess(server_args(args), LOGS / "server.log")
    try:
        asyncio.run(warm_up(server, args, prompts[0]))
        rounds = [asyncio.run(run_round(server, args, prompts, live_prompt_tokens)) for _ in range(args.rounds)]
    finally:
        exit_code = server.stop()
    print(
        f"\n{args.clients} clients send {args.prompt_tokens}-token prompts ({args.leave_tokens} tokens asked, half "
        f"streamed) and close after {args.leave_after:g} s; the live request ({args.live_tokens} tokens, whole) is "
        f"sent {args.live_after:g} s after them\n"
    )
    print(round_table(rounds, args))
    extra = statistics.median(r.extra_seconds for r in rounds)
    met = extra < args.goal_extra
    print(
        f"\ngoal: the live request's extra time, median of {len(rounds)}: {extra:+.3f} s "
        f"(< {args.goal_extra:g} s: {'yes' if met else 'NO'}); the server exited {exit_code} on SIGTERM"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
