"""Structured output on a real model: JSON answers under their schemas, plain decoding against
speculation, the same schema for both (issue: everything a request can ask).

Each prompt asks for a held-out standard-library function described as JSON by one of SCHEMAS
(our own set: a summary, test cases, a review, what it calls), with the schema in the prompt
and enforced as structured output. Greedy, one request after another, end to end (prefill
included). For each system: tokens per second, how many answers parse and validate against
their schema, and whether each answer's tokens equal plain decoding's.

    python benchmarks/bench_structured.py [--model qwen2.5-coder-1.5b-instruct] [--prompts 8]
        [--systems none,auto]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from specdec import LLM, SamplingParams, StructuredOutputsParams
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


def run(llm: LLM, work, max_tokens: int) -> tuple[list[list[int]], list[str], float, int, list, int]:
    """Each prompt answered alone, in turn: (token ids, texts, seconds, tokens, finish reasons,
    tokens the grammar forced: jump-forward)."""
    ids, texts, seconds, reasons, forced = [], [], 0.0, [], 0
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
    return ids, texts, seconds, sum(len(i) for i in ids), reasons, forced


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
    base_ids, _, base_seconds, base_tokens, _, _ = results[args.systems.split(",")[0]]
    print(f"{args.model}, {len(work)} prompts, greedy, one after another\n")
    print("| system | tok/s | x first | answers valid | ended by the grammar | equal to first | forced tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method, (ids, texts, seconds, tokens, reasons, forced) in results.items():
        ok = sum(valid(text, schema) for text, (_, _, schema) in zip(texts, work))
        equal = sum(a == b for a, b in zip(ids, base_ids))
        rate = tokens / seconds
        stopped = sum(reason == "stop" for reason in reasons)
        speedup = rate / (base_tokens / base_seconds)
        n = len(work)
        print(
            f"| {method} | {rate:.1f} | {speedup:.2f}x | {ok}/{n} | {stopped}/{n} | {equal}/{n} | {forced}/{tokens} |"
        )
    last = results[args.systems.split(",")[-1]]
    for (name, _, schema), text, reason in zip(work, last[1], last[4]):
        if not valid(text, schema):
            print(f"\nnot valid ({reason}), {name}: ...{text[-200:]!r}")


if __name__ == "__main__":
    main()
