"""Serving benchmark: `specdec serve` with speculation against without, under concurrent load.

    python benchmarks/bench_serve.py [--model DIR --draft DIR] [-k 5] [--write-docs]

Two servers start (the target with its draft, the target alone), both on this machine, as
`specdec serve` subprocesses; the client is asyncio + httpx streaming over loopback.

1. Burst check: --burst (200) streaming requests at once to the speculative server, each of
   --burst-tokens tokens (EOS ignored): every one must end with `data: [DONE]`, a usage chunk
   and finish_reason "length", with exactly that many tokens: none lost, none cut short.
2. Load: at each concurrency C (1, 4, 16, 64), C clients each send streaming requests one after
   another (held-out code prompts, greedy by default, --max-tokens each), --rounds requests per
   client; the two servers take turns, level by level. Per request: time to first token (TTFT),
   and inter-token latency = (end - first token) / (tokens - 1), the mean time per output token
   after the first (speculation brings tokens several at a time, so the gaps between chunks are
   not per token). Throughput = all output tokens / the level's wall time.

Prints a table, writes docs/benchmarks/serving/<cpu>.json and a plot of all CPUs measured;
--write-docs rewrites the "Serving" section of docs/benchmarks.md from those files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from specdec.paths import DOCS, SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.paths import ROOT as CHECKOUT
from specdec.serve.process import ServerProcess
from specdec.tools.benchmark.prompts import held_out_code_prompts

ROOT = Path(__file__).resolve().parents[1]

OUT = DOCS / "benchmarks" / "serving"
LOGS = CHECKOUT / "bench_out" / "serve-logs"  # the servers' output
GOAL_ITL_RATIO = 1.5  # at concurrency 1-4: plain inter-token latency / speculative
GOAL_THROUGHPUT_RATIO = 0.95  # at concurrency 64: speculative throughput / plain
SECTION_START = "<!-- serving: written by benchmarks/bench_serve.py --write-docs -->"
SECTION_END = "<!-- /serving -->"


async def stream_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    """One streaming completion: its timings, token count (from the usage chunk), finish
    reason, and whether [DONE] came."""
    body = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    result = {"tokens": 0, "finish_reason": None, "done": False, "text": ""}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice["text"] and first is None:
                    first = time.perf_counter()
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    result.update(start=start, first=first or end, end=end)
    return result


async def burst_check(url: str, prompts: list[str], count: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count + 8)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_request(client, url, prompts[i % len(prompts)], max_tokens, 0.0) for i in range(count)),
            return_exceptions=True,
        )
        seconds = time.perf_counter() - start
    failed = [r for r in results if isinstance(r, Exception) or "error" in r]
    complete = [
        r
        for r in results
        if not isinstance(r, Exception)
        and "error" not in r
        and r["done"]
        and r["finish_reason"] == "length"
        and r["tokens"] == max_tokens
    ]
    return {
        "requests": count,
        "tokens": max_tokens,
        "complete": len(complete),
        "failed": len(failed),
        "seconds": seconds,
        "cut_short": count - len(complete) - len(failed),
        "errors": [str(r if isinstance(r, Exception) else r["error"]) for r in failed][:3],
    }


async def load(
    url: str, prompts: list[str], concurrency: int, rounds: int, max_tokens: int, temperature: float
) -> dict:
    queue = asyncio.Queue()
    for i in range(concurrency * rounds):
        queue.put_nowait(i)
    results = [None] * (concurrency * rounds)  # in the order sent, whatever order they finish in

    async def worker(client):
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await stream_request(client, url, prompts[i % len(prompts)], max_tokens, temperature)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    bad = [r for r in results if "error" in r or r["tokens"] != max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed or came back short: {bad[0]}")
    ttft = [r["first"] - r["start"] for r in results]
    itl = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in results]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "seconds": seconds,
        "ttft_mean": statistics.mean(ttft),
        "ttft_p50": statistics.median(ttft),
        "itl_mean": statistics.mean(itl),
        "itl_p50": statistics.median(itl),
        "throughput": sum(r["tokens"] for r in results) / seconds,
        "texts": [r["text"] for r in results],
    }


def speculation_counts(before: dict, after: dict) -> dict:
    def delta(name):
        return sum(v for k, v in after.items() if k.startswith(f"specdec:{name}{{")) - sum(
            v for k, v in before.items() if k.startswith(f"specdec:{name}{{")
        )

    drafted, accepted = delta("spec_decode_num_draft_tokens_total"), delta("spec_decode_num_accepted_tokens_total")
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafts": delta("spec_decode_num_drafts_total"),
        "generated": delta("generation_tokens_total"),
    }


def cpu_label() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHIPPED_TARGET))
    p.add_argument("--draft", default=str(SHIPPED_DRAFT))
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency (default 2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--burst-tokens", type=int, default=32)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--docs-only",
        action="store_true",
        help="rewrite the plot and the docs section from the results "
        "already in docs/benchmarks/serving, measuring nothing",
    )
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.docs_only:
        plot(sorted(OUT.glob("*.json")))
        write_docs(sorted(OUT.glob("*.json")))
        return 0
    prompts = [prompt.text for prompt in held_out_code_prompts(per_module=4, max_chars=600)]
    common = [
        args.model,
        "--served-model-name",
        "model",
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--max-waiting",
        str(args.burst + 64),
    ]
    servers = {
        "speculative": ServerProcess(
            [*common, "--draft", args.draft, "-k", str(args.k)], LOGS / "speculative.log", timeout=600
        ),
        "plain": ServerProcess(common, LOGS / "plain.log", timeout=600),
    }
    target_dtype = re.search(r"the target runs in (\w+)", servers["plain"].output())
    try:
        burst = asyncio.run(burst_check(servers["speculative"].url, prompts, args.burst, args.burst_tokens))
        print(
            f"burst: {burst['requests']} streaming requests at once: {burst['complete']} complete, "
            f"{burst['cut_short']} cut short, {burst['failed']} failed, in {burst['seconds']:.1f} s"
        )
        rows = []
        for level, concurrency in enumerate(args.concurrency):
            order = ["speculative", "plain"] if level % 2 == 0 else ["plain", "speculative"]
            measured = {}
            for name in order:
                before = servers[name].metrics()
                measured[name] = asyncio.run(
                    load(servers[name].url, prompts, concurrency, args.rounds, args.max_tokens, args.temperature)
                )
                measured[name].update(speculation_counts(before, servers[name].metrics()))
            same = measured["speculative"].pop("texts") == measured["plain"].pop("texts")
            rows.append(
                {
                    "concurrency": concurrency,
                    "speculative": measured["speculative"],
                    "plain": measured["plain"],
                    "identical_outputs": same,
                }
            )
            print_row(rows[-1])
    finally:
        codes = {name: server.stop() for name, server in servers.items()}
    result = {
        "cpu": cpu_label(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "draft": args.draft,
        "k": args.k,
        "dtype": args.dtype,
        "target_dtype": target_dtype.group(1) if target_dtype else args.dtype,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "rounds": args.rounds,
        "burst": burst,
        "rows": rows,
        "exit_codes": codes,
        "date": time.strftime("%Y-%m-%d"),
    }
    path = OUT / f"{result['cpu'].lower().replace(' ', '-')}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(sorted(OUT.glob("*.json")))
    print(f"wrote {path} and {OUT / 'serving.png'}")
    if args.write_docs:
        write_docs(sorted(OUT.glob("*.json")))
    return 0 if burst["complete"] == burst["requests"] else 1


def print_row(row: dict) -> None:
    s, b = row["speculative"], row["plain"]
    alpha = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else float("nan")
    print(
        f"C={row['concurrency']:>3}: ITL {s['itl_mean'] * 1e3:6.2f} vs {b['itl_mean'] * 1e3:6.2f} ms "
        f"({b['itl_mean'] / s['itl_mean']:.2f}x), TTFT {s['ttft_mean'] * 1e3:6.1f} vs {b['ttft_mean'] * 1e3:6.1f} ms, "
        f"throughput {s['throughput']:7.1f} vs {b['throughput']:7.1f} tok/s "
        f"({s['throughput'] / b['throughput']:.2f}x), "
        f"accepted/drafted {alpha:.2f}, identical {row['identical_outputs']}",
        flush=True,
    )


def table(result: dict) -> str:
    lines = [
        "| concurrency | ITL spec / plain (ms/token) | ITL ratio | TTFT spec / plain (ms) | "
        "throughput spec / plain (tok/s) | throughput ratio | drafted tokens per output token | "
        "accepted / drafted | greedy outputs identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in result["rows"]:
        s, b = row["speculative"], row["plain"]
        alpha = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else float("nan")
        lines.append(
            f"| {row['concurrency']} | {s['itl_mean'] * 1e3:.2f} / {b['itl_mean'] * 1e3:.2f} | "
            f"{b['itl_mean'] / s['itl_mean']:.2f}x | {s['ttft_mean'] * 1e3:.1f} / {b['ttft_mean'] * 1e3:.1f} | "
            f"{s['throughput']:.0f} / {b['throughput']:.0f} | {s['throughput'] / b['throughput']:.2f}x | "
            f"{s['draft_tokens'] / max(s['generated'], 1):.3f} | {alpha:.2f} | "
            f"{'yes' if row['identical_outputs'] else 'no'} |"
        )
    return "\n".join(lines)


def goals(result: dict) -> str:
    """The issue's two goals, met or missed, from a result."""
    rows = {row["concurrency"]: row for row in result["rows"]}
    said = []
    low = [c for c in (1, 4) if c in rows]
    if low:
        ratios = [rows[c]["plain"]["itl_mean"] / rows[c]["speculative"]["itl_mean"] for c in low]
        said.append(
            f"inter-token latency at concurrency {'/'.join(map(str, low))}: "
            f"{' / '.join(f'{r:.2f}x' for r in ratios)} lower with speculation (goal ≥ {GOAL_ITL_RATIO}x: "
            f"{'met' if min(ratios) >= GOAL_ITL_RATIO else 'missed'})"
        )
    if 64 in rows:
        ratio = rows[64]["speculative"]["throughput"] / rows[64]["plain"]["throughput"]
        said.append(
            f"throughput at 64: {ratio:.2f}x (goal ≥ {GOAL_THROUGHPUT_RATIO}x: "
            f"{'met' if ratio >= GOAL_THROUGHPUT_RATIO else 'missed'})"
        )
    return "Goals: " + "; ".join(said) + "." if said else ""


def plot(paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (itl_axes, throughput_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for path, color in zip(paths, ("tab:blue", "tab:orange", "tab:green")):
        result = json.loads(path.read_text())
        levels = [row["concurrency"] for row in result["rows"]]
        for kind, style in (("speculative", "-o"), ("plain", "--s")):
            itl_axes.plot(
                levels,
                [row[kind]["itl_mean"] * 1e3 for row in result["rows"]],
                style,
                color=color,
                label=f"{result['cpu']}: {kind}",
            )
            throughput_axes.plot(
                levels,
                [row[kind]["throughput"] for row in result["rows"]],
                style,
                color=color,
                label=f"{result['cpu']}: {kind}",
            )
    for axes, title, unit in (
        (itl_axes, "inter-token latency", "ms per token"),
        (throughput_axes, "throughput", "output tokens / s"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent streaming clients")
        axes.set_ylabel(unit)
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    fig.suptitle("specdec serve, shipped code pair: draft model (k ≤ 5, goodput) vs target alone")
    fig.tight_layout()
    fig.savefig(OUT / "serving.png", dpi=110)


def write_docs(paths: list[Path]) -> None:
    parts = [
        SECTION_START,
        "## Serving: `specdec serve` under load",
        "",
        "`python benchmarks/bench_serve.py --write-docs` (this section is written by it). Two servers on the "
        "same machine, the shipped target with its draft model (`-k 5`, goodput policy) and the target alone, "
        "both `--max-num-seqs 64`, eager; an asyncio client on the same two cores streams held-out code "
        "prompts. Inter-token latency is the mean time per output token after the first; throughput is all "
        "output tokens over the level's wall time.",
        "",
    ]
    for path in paths:
        result = json.loads(path.read_text())
        burst = result["burst"]
        parts += [
            f"### {result['cpu']} CPU (target in {result['target_dtype']}; {result['date']}, "
            f"{result['max_tokens']} tokens a request, temperature {result['temperature']}, "
            f"{result['rounds']} requests per client)",
            "",
            f"Burst check: {burst['requests']} streaming requests at once, {burst['tokens']} "
            f"tokens each: {burst['complete']} complete, {burst['cut_short']} cut short, {burst['failed']} "
            f"failed ({burst['seconds']:.1f} s).",
            "",
            table(result),
            "",
            goals(result),
            "",
        ]
    parts += [
        "Greedy outputs are identical, request by request, where the target runs in float32; in bfloat16 "
        "a verify forward over k+1 tokens can round differently from a one-token step and flip a near-tie "
        "(the tests check float32 identity through the server). At 64 streams the goodput policy (k ≤ 5) "
        "drafts almost nothing: a verify forward over 64 rows costs too much more than a step for drafts "
        "to pay, and the server runs as the target alone.",
        "",
        "![serving](benchmarks/serving/serving.png)",
        "",
        SECTION_END,
    ]
    docs = DOCS / "benchmarks.md"
    text = docs.read_text()
    section = "\n".join(parts)
    if SECTION_START in text:
        before, rest = text.split(SECTION_START, 1)
        text = before + section + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    docs.write_text(text)
    print(f"wrote the serving section of {docs}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
