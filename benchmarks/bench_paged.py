"""The paged key/value cache under load: prefix caching's time to first token, and many streams
in a small pool.

    python benchmarks/bench_paged.py [--model smollm2] [--draft DIR] [--system-tokens 2000]
        [--streams 200] [--pool-gb 4]

1. Prefix caching: two `specdec serve` processes of the model, with and without
   --enable-prefix-caching. Each gets --questions requests one after another, each a long shared
   system prompt (about --system-tokens tokens of held-out code) and a short question of its own,
   streaming --answer-tokens tokens. Time to first token (TTFT) of each request after the first
   (the first fills the cache in both), and to its last token (with --draft, the draft's cache
   skips the cached prefix too, in the first round after the prefill); the ratios of the means.
2. Many streams: one server with --max-num-seqs --streams, --max-model-len the model's context
   and a --pool-gb key/value cache; --streams streaming requests at once, each of a held-out code
   prompt and --stream-tokens tokens: every one must end with [DONE] and exactly that many tokens
   (none lost, none cut short); the preemptions the pool made, from /metrics.

Prints tables, the CPU kind and the pool each server logged. Speed is printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time

import httpx

from specdec.paths import ROOT as CHECKOUT
from specdec.serve.process import ServerProcess
from specdec.tools.benchmark.prompts import held_out_code_prompts

LOGS = CHECKOUT / "bench_out" / "paged-logs"
QUESTIONS = [
    "Which function above is the longest?",
    "Name every class defined above.",
    "Write a docstring for the first function.",
    "What does the second function return?",
    "List the imports used above.",
    "Is there any recursion above?",
    "Which names are private?",
    "Suggest one test for the code above.",
    "What would you rename, and why?",
    "Summarise the code in one sentence.",
]


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming chat or completion request: TTFT, tokens (from usage), whether [DONE] came."""
    route = "chat/completions" if "messages" in body else "completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens, done = time.perf_counter(), None, 0, False
    async with client.stream("POST", f"{url}/v1/{route}", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and first is None and '"usage"' not in line:
                first = time.perf_counter()
            if '"completion_tokens"' in line:
                tokens = int(re.search(r'"completion_tokens":\s*(\d+)', line).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "seconds": end - start, "tokens": tokens, "done": done}


def system_prompt(num_tokens: int) -> str:
    """About num_tokens tokens of held-out code (4 characters a token, roughly)."""
    text, prompts = "", held_out_code_prompts(per_module=8, max_chars=2000)
    for prompt in prompts:
        if len(text) >= 4 * num_tokens:
            break
        text += prompt.text + "\n\n"
    return "You answer questions about this code:\n\n" + text[: 4 * num_tokens]


async def prefix_run(url: str, system: str, questions: int, answer_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        results = []
        for question in QUESTIONS[:questions]:
            body = {
                "model": "model",
                "prompt": f"{system}\n\nQuestion: {question}\nAnswer:",
                "max_tokens": answer_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            results.append(await stream(client, url, body))
        return results


def measure_prefix_caching(args, common: list[str]) -> dict:
    system = system_prompt(args.system_tokens)
    measured = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        server = ServerProcess([*common, caching], LOGS / f"prefix{caching}.log", timeout=900)
        try:
            results = asyncio.run(prefix_run(server.url, system, args.questions, args.answer_tokens))
            hits, queries = server.metric("prefix_cache_hits_total"), server.metric("prefix_cache_queries_total")
        finally:
            server.stop()
        bad = [r for r in results if "error" in r or not r["done"]]
        if bad:
            raise RuntimeError(f"{caching}: {bad[0]}")
        later = [r["ttft"] for r in results[1:]]
        measured[caching] = {
            "ttft_first": results[0]["ttft"],
            "ttft_mean_later": statistics.mean(later),
            "ttft_p50_later": statistics.median(later),
            "whole_mean_later": statistics.mean(r["seconds"] for r in results[1:]),
            "hit_fraction": hits / queries if queries else 0.0,
            "pool": pool_line(server),
        }
    on, off = measured["--enable-prefix-caching"], measured["--no-enable-prefix-caching"]
    print(
        f"\nprefix caching: a shared system prompt of ~{args.system_tokens} tokens, {args.questions} requests in turn"
    )
    print(
        "| prefix caching | TTFT, first | TTFT, later (mean) | later (median) "
        f"| {args.answer_tokens} tokens, later (mean) | prompt tokens found |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in (("on", on), ("off", off)):
        print(
            f"| {name} | {row['ttft_first'] * 1e3:,.0f} ms | {row['ttft_mean_later'] * 1e3:,.0f} ms "
            f"| {row['ttft_p50_later'] * 1e3:,.0f} ms | {row['whole_mean_later'] * 1e3:,.0f} ms "
            f"| {row['hit_fraction']:.0%} |"
        )
    print(f"TTFT off / on (later requests, mean): {off['ttft_mean_later'] / on['ttft_mean_later']:.1f}x")
    print(f"whole answer off / on (later requests, mean): {off['whole_mean_later'] / on['whole_mean_later']:.1f}x")
    return measured


async def many_streams(url: str, prompts: list[str], count: int, tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=count + 8)) as client:
        bodies = [
            {"model": "model", "prompt": prompts[i % len(prompts)], "max_tokens": tokens, "ignore_eos": True}
            for i in range(count)
        ]
        return list(await asyncio.gather(*(stream(client, url, body) for body in bodies), return_exceptions=True))


def measure_many_streams(args, common: list[str]) -> dict:
    prompts = [p.text for p in held_out_code_prompts(per_module=4, max_chars=600)]
    server = ServerProcess(
        [
            *common,
            "--max-num-seqs",
            str(args.streams),
            "--max-waiting",
            str(args.streams + 8),
            "--kv-cache-memory",
            str(args.pool_gb),
        ],
        LOGS / "many.log",
        timeout=900,
    )
    try:
        start = time.perf_counter()
        results = asyncio.run(many_streams(server.url, prompts, args.streams, args.stream_tokens))
        seconds = time.perf_counter() - start
        preemptions = server.metric("num_preemptions_total")
        pool = pool_line(server)
    finally:
        code = server.stop()
    complete = [r for r in results if isinstance(r, dict) and r.get("done") and r.get("tokens") == args.stream_tokens]
    failed = [r for r in results if isinstance(r, Exception) or "error" in r]
    print(f"\n{args.streams} streams at once, {args.stream_tokens} tokens each, a {args.pool_gb} GB pool ({pool})")
    print("| streams | complete | cut short | failed | preemptions | seconds | tokens/s | server exit |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    cut = len(results) - len(complete) - len(failed)
    print(
        f"| {args.streams} | {len(complete)} | {cut} | {len(failed)} | {preemptions:.0f} | {seconds:.1f} "
        f"| {len(complete) * args.stream_tokens / seconds:,.0f} | {code} |"
    )
    if failed:
        print("first failure:", failed[0])
    return {"complete": len(complete), "failed": len(failed), "cut_short": cut, "preemptions": preemptions}


def pool_line(server: ServerProcess) -> str:
    found = re.search(r"the KV cache holds ([\d,]+) tokens \(([\d.]+) GB\)", server.output())
    return f"{found.group(1)} tokens, {found.group(2)} GB" if found else "pool size not logged"


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft", help="a draft model for the servers (--draft): its cache shares the prefixes too")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--pool-gb", type=float, default=4.0)
    p.add_argument("--skip", choices=("prefix", "streams"), action="append", default=[])
    args = p.parse_args()
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}; model {args.model}, draft {args.draft}")
    common = [args.model, "--served-model-name", "model", "--dtype", args.dtype, "--log-level", "warning"]
    if args.draft:
        common += ["--draft", args.draft]
    if "prefix" not in args.skip:
        measure_prefix_caching(args, common)
    if "streams" not in args.skip:
        measure_many_streams(args, common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
