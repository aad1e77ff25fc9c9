"""Structured output's libraries side by side: the time to build each one's view of a model's
tokenizer, to compile a JSON schema, and to compute a token mask per token of a valid answer
(the cost a verify pays per position), llguidance (what specdec uses: grammar.py) and xgrammar
where it is installed (`pip install xgrammar==0.2.8`: it brings triton and transformers).

    python benchmarks/bench_grammar.py [--model qwen2.5-coder-1.5b-instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec.prompts import PromptEncoder

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
ANSWER = {
    "name": "Ann Lee",
    "age": 31,
    "email": "ann@example.com",
    "tags": ["a", "bb"],
    "address": {"city": "Paris", "zip": "75001"},
}


def timed(f):
    start = time.perf_counter()
    result = f()
    return result, time.perf_counter() - start


def llguidance_row(tokenizer, vocab_size: int, eos: int, ids: list[int]) -> tuple:
    import llguidance

    ll, build = timed(lambda: llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, compile_ = timed(lambda: llguidance.LLMatcher(ll, grammar, log_level=0))
    masks = []
    for token in ids:
        masks.append(timed(matcher.compute_bitmask)[1])
        assert matcher.consume_token(token)
    return "llguidance", build, compile_, masks


def xgrammar_row(tokenizer, vocab_size: int, eos: int, ids: list[int]) -> tuple | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info, build = timed(
        lambda: xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
    )
    compiled, compile_ = timed(lambda: xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    matcher, bitmask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, vocab_size)
    masks = []
    for token in ids:
        masks.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask))[1])
        assert matcher.accept_token(token)
    return "xgrammar", build, compile_, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", help="a registered name, directory or GGUF file"
    )
    args = parser.parse_args()
    encoder = PromptEncoder.load(args.model)
    tokenizer = encoder.need_tokenizer("the masks")
    eos = tokenizer.backend.token_to_id("<|im_end|>") or tokenizer.backend.token_to_id("</s>") or 0
    ids = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    print(f"{args.model}: vocabulary {encoder.vocab_size}, an answer of {len(ids)} tokens\n")
    print("| library | tokenizer (s) | compile (ms) | mask median (ms) | mask mean (ms) | mask max (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in (llguidance_row, xgrammar_row):
        result = row(tokenizer, encoder.vocab_size, eos, ids)
        if result is None:
            print("| xgrammar | not installed | | | | |")
            continue
        name, build, compile_, masks = result
        print(
            f"| {name} | {build:.2f} | {compile_ * 1e3:.1f} | {statistics.median(masks) * 1e3:.3f} | "
            f"{statistics.mean(masks) * 1e3:.3f} | {max(masks) * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
