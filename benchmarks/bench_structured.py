"""Structured output on a real model: JSON answers under their schemas, plain decoding against
speculation, the same schema for both (issue: everything a request can ask).

Each prompt asks for a held-out standard-library function described as JSON by one of SCHEMAS
(our own set: a summary, test cases, a review, what it calls), with the schema in the prompt
and enforced as structured output. Greedy, one request after another, end to end (prefill
included). For each system: tokens per second, end to end and after the first token (the decode
rate, 1 / vLLM's TPOT: what speculation speeds up, where the prefill, the same for every system,
weighs on the end-to-end rate), the time to the first tokens (TTFT, summed), how many answers
parse and validate against their schema, and whether each answer's tokens equal plain
decoding's.

    python benchmarks/bench_structured.py [--model qwen2.5-coder-1.5b-instruct] [--prompts 8]
        [--systems none,auto]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from specdec import LLM, SamplingParams, StructuredOutputsParams
from specdec.metrics import SpecStats
from specdec.tools.benchmark.prompts import held_out_sources
from specdec.tools.training.chat_prompts import code_block, find_functions
from specdec.tools.training.corpus import Document

STRING = {"type": "string", "maxLength": 200}
SCHEMAS = {
    "summary": {
        "type": "object",
        "properties": {
            "name": STRING,
            "parameters": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": STRING, "default": {"type": ["string", "null"], "maxLength": 60}},
                    "required": ["name", "default"],
                    "additionalProperties": False,
                },
                "maxItems": 8,
            },
            "returns": STRING,
            "summary": STRING,
        },
        "required": ["name", "parameters", "returns", "summary"],
        "additionalProperties": False,
    },
    "tests": {
        "type": "object",
        "properties": {
            "tests": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"call": STRING, "expected": STRING},
                    "required": ["call", "expected"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tests"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "issues": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "severity": {"type": "string", "enum": ["low", "medium", "high"]},
                        "comment": STRING,
                    },
                    "required": ["severity", "comment"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
            "verdict": {"type": "string", "enum": ["approve", "request changes"]},
        },
        "required": ["issues", "verdict"],
        "additionalProperties": False,
    },
    "calls": {
        "type": "object",
        "properties": {
            "name": STRING,
            "calls": {"type": "array", "items": STRING, "maxItems": 10},
            "is_pure": {"type": "boolean"},
        },
        "required": ["name", "calls", "is_pure"],
        "additionalProperties": False,
    },
}
INSTRUCTIONS = {
    "summary": (
        "Describe this Python function as JSON: its name, its parameters with their defaults, what it returns, "
        "and a one-sentence summary."
    ),
    "tests": "Write up to three test cases for this Python function as JSON: a call and its expected result each.",
    "review": "Review this Python function as JSON: up to three issues with their severity, and a verdict.",
    "calls": "List what this Python function calls, as JSON: its name, the functions it calls, and whether it is pure.",
}


def prompts(count: int, max_chars: int = 900) -> list[tuple[str, list[dict], dict]]:
    """(name, chat messages, schema) for count held-out functions, the schemas in turn."""
    functions = [
        f for module, source in held_out_sources() for f in find_functions([Document(module, source)], max_chars)[0]
    ]
    kinds = list(SCHEMAS)
    chosen = []
    for i, function in enumerate(functions[:: max(1, len(functions) // count)][:count]):
        kind = kinds[i % len(kinds)]
        schema_text = json.dumps(SCHEMAS[kind])
        text = f"{INSTRUCTIONS[kind]}\nAnswer with JSON following this schema:\n{schema_text}\n\n{code_block(function)}"
        chosen.append((f"{function.where} ({kind})", [{"role": "user", "content": text}], SCHEMAS[kind]))
    return chosen


def run(llm: LLM, work, max_tokens: int) -> tuple[list[list[int]], list[str], float, int, list, int, SpecStats]:
    """Each prompt answered alone, in turn: (token ids, texts, seconds, tokens, finish reasons,
    tokens the grammar forced: jump-forward, the requests' stats merged)."""
    ids, texts, seconds, reasons, forced, stats = [], [], 0.0, [], 0, []
    for _, messages, schema in work:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema)
        )
        start = time.perf_counter()
        (output,) = llm.chat([messages], params)
        seconds += time.perf_counter() - start
        ids.append(output.outputs[0].token_ids)
        texts.append(output.outputs[0].text)
        reasons.append(output.outputs[0].finish_reason)
        forced += output.metrics.num_forced_tokens
        stats.append(output.metrics)
    merged = SpecStats.merge(stats, one_after_another=True)
    return ids, texts, seconds, sum(len(i) for i in ids), reasons, forced, merged


def decode_rate(stats: SpecStats, requests: int) -> float:
    """Tokens after each request's first ÷ the seconds after it (merged one after another); nan
    where no answer went past its first token."""
    seconds = stats.seconds - stats.first_token_seconds
    return (stats.num_emitted_tokens - requests) / seconds if seconds > 0 else float("nan")


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--systems", default="none,auto", help="speculative_method values, comma-separated")
    args = parser.parse_args()
    work = prompts(args.prompts)
    results = {}
    for method in args.systems.split(","):
        llm = LLM(args.model, speculative_method=method)
        run(llm, work[:1], 16)  # warm: packs weights, calibrates
        results[method] = run(llm, work, args.max_tokens)
        del llm
    base_ids, _, base_seconds, base_tokens, _, _, base_stats = results[args.systems.split(",")[0]]
    n = len(work)
    print(f"{args.model}, {n} prompts, greedy, one after another\n")
    print(
        "| system | tok/s | x first | decode tok/s | x first | TTFT, all prompts | answers valid "
        "| ended by the grammar | equal to first | forced tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method, (ids, texts, seconds, tokens, reasons, forced, stats) in results.items():
        ok = sum(valid(text, schema) for text, (_, _, schema) in zip(texts, work))
        equal = sum(a == b for a, b in zip(ids, base_ids))
        rate = tokens / seconds
        stopped = sum(reason == "stop" for reason in reasons)
        speedup = rate / (base_tokens / base_seconds)
        decode = decode_rate(stats, n)
        print(
            f"| {method} | {rate:.1f} | {speedup:.2f}x | {decode:.1f} | {decode / decode_rate(base_stats, n):.2f}x "
            f"| {stats.first_token_seconds:.1f} s | {ok}/{n} | {stopped}/{n} | {equal}/{n} | {forced}/{tokens} |"
        )
    for method, (ids, *_rest) in results.items():
        for (name, _, _), mine, base in zip(work, ids, base_ids):
            if mine != base:
                at = next((i for i, (a, b) in enumerate(zip(mine, base)) if a != b), min(len(mine), len(base)))
                print(
                    f"\n{method} differs from the first system, {name}: from token {at} of {len(base)}: "
                    f"{mine[at : at + 5]} against {base[at : at + 5]}"
                )
    last = results[args.systems.split(",")[-1]]
    for (name, _, schema), text, reason in zip(work, last[1], last[4]):
        if not valid(text, schema):
            print(f"\nnot valid ({reason}), {name}: ...{text[-200:]!r}")


if __name__ == "__main__":
    main()
