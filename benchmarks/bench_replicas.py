"""Replicas on Ray Serve against one engine, at the same total threads, under the same load.

    python benchmarks/bench_replicas.py [--model DIR --draft DIR] [-k 5] [--threads 2] [--replicas 2]

Two servers take turns (--rounds times each, interleaved, the first of each round alternating:
these machines are noisy, and a server started right after Ray has run was seen slower):
  one engine     specdec serve MODEL, with --threads torch threads
  N replicas     specdec serve MODEL --replicas N --replica-threads threads/N (a local Ray instance)
Load: --clients clients each stream --requests completions one after another (held-out code
prompts, greedy, --max-tokens each, EOS ignored). Throughput = all output tokens / wall time.
The goal (issue 30): N replicas at >= 0.9x one engine's throughput (the router costs little).
Each server's log is kept per round: --log-dir/engine-roundR.log, replicas-N-roundR.log.
Before each server starts, the bench waits until the machine is quiet (all CPUs under 10% busy
over 2 s, --quiet-timeout at most) and prints how long that took and what it saw.
--replicas 1 --threads 1: one replica on Ray against one engine, both of one thread: the cost of
the ingress, the router and streaming through Ray alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from specdec.paths import ROOT, SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.serve.process import ServerProcess
from specdec.tools.benchmark.prompts import held_out_code_prompts


async def stream_tokens(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    """One streaming completion; the output tokens it brought (from the usage chunk)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def load(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> float:
    """Output tokens per second of clients streaming requests each, one after another."""

    async def one_client(index: int) -> int:
        mine = [prompts[(index * requests + i) % len(prompts)] for i in range(requests)]
        return sum([await stream_tokens(client, url, prompt, max_tokens) for prompt in mine])

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as client:
        await stream_tokens(client, url, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one_client(i) for i in range(clients))))
        return tokens / (time.perf_counter() - start)


def server_args(args, on_ray: bool) -> list[str]:
    """One engine (on_ray False), or args.replicas replicas on Ray (--replica-threads puts even
    one there)."""
    common = [str(args.model), "--draft", str(args.draft), "-k", str(args.k), "--max-num-seqs", str(args.clients)]
    if not on_ray:
        return common
    return [*common, "--replicas", str(args.replicas), "--replica-threads", str(max(1, args.threads // args.replicas))]


def wait_for_replicas(server: ServerProcess, replicas: int, timeout: float = 900) -> None:
    """Until every replica answers: /health is 200 once one does (what a load balancer needs), and
    a load started then goes all to the first replica up while the others still load."""
    deadline = time.monotonic() + timeout
    while server.metric("replica_up") < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.metric('replica_up'):.0f} of {replicas} replicas answer after {timeout:.0f} s")
        time.sleep(1)


def what_ran(server: ServerProcess, replicas: int) -> str:
    """The rounds' k (goodput's choice: k = 0 is a plain step), the mean TTFT and the routing."""
    by_k: dict[str, float] = {}
    for series, value in server.metrics().items():
        if series.startswith("specdec:spec_decode_rounds_by_k_total{"):
            k = series.split('k="')[1].split('"')[0]
            by_k[k] = by_k.get(k, 0) + value
    rounds = sum(by_k.values()) or 1
    ks = ", ".join(f"k={k} {count / rounds:.0%}" for k, count in sorted(by_k.items(), key=lambda kv: int(kv[0])))
    ttft = server.metric("time_to_first_token_seconds_sum") / max(1, server.metric("time_to_first_token_seconds_count"))
    routed = [int(server.metric("router_requests_total", replica=str(r))) for r in range(replicas)]
    prompt_tokens = [int(server.metric("prompt_tokens_total", replica=str(r))) for r in range(replicas)]
    routing = f"; requests by replica {routed}, prompt tokens {prompt_tokens}" if any(routed) else ""
    return f"rounds {ks}; mean TTFT {ttft:.1f} s{routing}"


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat's first line)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(max_busy: float = 0.1, interval: float = 2.0, timeout: float = 180.0) -> str:
    """Until the CPUs were under max_busy busy over one interval (a server that just stopped may
    leave work behind: Ray's processes exiting, the page cache writing back); what it saw."""
    start, seen = time.monotonic(), []
    while True:
        busy0, total0 = cpu_times()
        time.sleep(interval)
        busy1, total1 = cpu_times()
        seen.append((busy1 - busy0) / max(1, total1 - total0))
        if seen[-1] < max_busy or time.monotonic() - start > timeout:
            break
    trace = " ".join(f"{x:.0%}" for x in seen[:12]) + (" ..." if len(seen) > 12 else "")
    return f"waited {time.monotonic() - start:.0f} s for a quiet machine (busy: {trace})"


def measure(args, on_ray: bool, prompts: list[str], round_index: int = 0) -> float:
    """One server's throughput under the load; its log kept per round (a slow round can be read
    afterwards: its start-up, compiling, admissions)."""
    env = {} if on_ray else {"OMP_NUM_THREADS": str(args.threads)}
    name = f"replicas-{args.replicas}" if on_ray else "engine"
    log = Path(args.log_dir) / f"{name}-round{round_index + 1}.log"
    print(f"    {wait_for_quiet(timeout=args.quiet_timeout)}", file=sys.stderr)
    server = ServerProcess(server_args(args, on_ray), log, env=env, timeout=900)  # replicas load for minutes
    try:
        if on_ray:
            wait_for_replicas(server, args.replicas)
        rate = asyncio.run(load(server.url, prompts, args.clients, args.requests, args.max_tokens))
        print(f"    {what_ran(server, args.replicas if on_ray else 0)}", file=sys.stderr)
        return rate
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SHIPPED_TARGET)
    parser.add_argument("--draft", type=Path, default=SHIPPED_DRAFT)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="total torch threads (default 2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quiet-timeout", type=float, default=180.0, help="wait at most this for a quiet machine")
    parser.add_argument("--log-dir", default=str(ROOT / "build" / "bench_replicas"))
    args = parser.parse_args()

    prompts = [prompt.text for prompt in held_out_code_prompts(per_module=4, max_chars=600)]  # fit 512 positions
    results: dict[bool, list[float]] = {False: [], True: []}  # on Ray?
    for round_index in range(args.rounds):
        for on_ray in (False, True) if round_index % 2 == 0 else (True, False):
            results[on_ray].append(measure(args, on_ray, prompts, round_index))
            what = f"{args.replicas} replica(s) on Ray" if on_ray else "one engine"
            print(f"  {what}: {results[on_ray][-1]:.1f} tok/s", file=sys.stderr)
    one, many = statistics.median(results[False]), statistics.median(results[True])
    runs = {on_ray: str([round(x) for x in measured]) for on_ray, measured in results.items()}
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads in all")
    print(f"{'server':<34} {'tok/s (median)':>15} {'runs':>24}")
    print(f"{'one engine, ' + str(args.threads) + ' threads':<34} {one:>15.1f} {runs[False]:>24}")
    label = f"{args.replicas} replicas on Ray, {args.threads // args.replicas} thread(s) each"
    print(f"{label:<34} {many:>15.1f} {runs[True]:>24}")
    print(f"ratio: {many / one:.2f}x (goal >= 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
