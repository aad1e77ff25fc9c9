"""specdec's command line. Every subcommand names its model first, positionally; the flags of
speculation are SpeculativeConfig's fields, spelled the same in generate, serve and bench.

    specdec generate MODEL [--draft DIR [--lookup] | --ngram | --early-exit [LAYER]] [-k N]
        (--prompt TEXT | --chat TEXT) [--compare]
    specdec serve MODEL [--draft DIR | --ngram] [-k N] [--port 8000] [--api-key KEY]
    specdec bench [MODEL --draft DIR] [--quick] [--device cuda] [--out DIR] [--write-docs]
    specdec train --corpus PATH --out DIR (--preset NAME | size flags)
    specdec distill TARGET --out DIR
    specdec train-heads TARGET --out DIR
    specdec chat-data --target DIR --out DIR
    specdec convert FILE.gguf OUT_DIR [--dtype auto] [--force]
    specdec fetch smollm2

(--model MODEL and distill's --target TARGET, the earlier spellings, are still taken.) A value
SpeculativeConfig or SamplingParams refuses is said with the flag typed: `error: -k must be an
integer >= 0, got -1`, where LLM(...) says `num_speculative_tokens must be ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.config import ConfigError, SamplingParams
from specdec.log_lines import show_log
from specdec.model_flags import add_model_argument, add_model_arguments, flag_words, make_llm, require_model


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__
    from specdec.models.commands import add_convert_parser, add_fetch_parser
    from specdec.serve.commands import add_serve_parser
    from specdec.tools.benchmark.commands import add_bench_parser  # these import torch: after main's try begins
    from specdec.tools.training.chat_data import add_chat_data_parser
    from specdec.tools.training.commands import (
        add_adapt_parser,
        add_distill_parser,
        add_restrict_head_parser,
        add_train_heads_parser,
        add_train_parser,
    )

    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for LLMs")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.commands = commands.choices  # pyright: ignore[reportAttributeAccessIssue]  # name -> its parser (main says a ConfigError in its flags)
    add_generate_parser(commands)
    add_train_parser(commands)
    add_distill_parser(commands)
    add_train_heads_parser(commands)
    add_restrict_head_parser(commands)
    add_adapt_parser(commands)
    add_chat_data_parser(commands)
    add_bench_parser(commands)
    add_convert_parser(commands)
    add_fetch_parser(commands)
    add_serve_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    show_log()
    parser = args = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return args.run(args)
    except ConfigError as e:  # a value SpeculativeConfig or SamplingParams refuses: named by its flag
        command = parser.commands.get(getattr(args, "command", None)) if parser is not None else None  # pyright: ignore[reportAttributeAccessIssue]
        words = flag_words(command, sys.argv[1:] if argv is None else argv) if command is not None else None
        print(f"error: {e.in_words(words) if words else e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # bad input, a path that cannot be read or written: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # train and distill say what they kept; the others have nothing to keep
        print("\ninterrupted", file=sys.stderr)
        return 130


def add_generate_parser(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate a completion, speculatively",
        usage="%(prog)s MODEL (--prompt TEXT | --chat MESSAGE) [options]",
        description="Generate a completion with the target model, verified against "
        "a draft model's or prompt lookup's proposals.",
    )
    add_model_argument(p)
    add_model_arguments(p)
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the prompt text, as is")
    text.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="a user message, rendered with the model's chat template (the reply is printed alone)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default: 1)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the K most likely tokens (default: -1, all)")
    p.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens less likely than P times the most likely one (default: 0)"
    )
    p.add_argument("--seed", type=int, default=None, help="the request's seed (default: none)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        type=unescape,
        help=r"a stop string (repeatable); \n, \t and \\ stand for a newline, a tab and a backslash",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the target alone and print the speedup (each timed twice, the faster kept)",
    )
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="mark accepted draft tokens in color (auto: when printing to a terminal)",
    )
    p.set_defaults(run=run_generate)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """A command-line string with \\n, \\t, \\r and \\\\ read as a newline, a tab, a carriage return
    and a backslash (a shell passes them as two characters); other backslashes stay."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in ESCAPES:
            out.append(ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def run_generate(args) -> int:
    require_model(args, "generate")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = make_llm(args)
    spec = llm.speculative_config
    method = spec.method if spec else None  # as inferred from --draft
    prompt = args.prompt if args.chat is None else llm.chat_token_ids([{"role": "user", "content": args.chat}])
    llm.prompt_token_ids(prompt, params)  # a bad request is refused as itself, not as the warm-up
    baseline_llm = llm.target_only() if args.compare else None
    for warming in (llm, baseline_llm):  # first calls are slow
        if warming is not None:
            warming.warm_up(prompt, params)
    output = llm.generate(prompt, params)[0]
    baseline = None
    if baseline_llm is not None:  # --compare: timed twice each, interleaved; the faster of each (shared machines)
        baseline = baseline_llm.generate(prompt, params)[0]
        output = _faster(output, llm.generate(prompt, params)[0])
        baseline = _faster(baseline, baseline_llm.generate(prompt, params)[0])
    completion = output.outputs[0]
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    shown_prompt = args.prompt or ""  # a chat's reply is shown alone
    if color and method:
        print(f"{DRAFT_COLOR}accepted draft tokens look like this{RESET}; the target's own tokens are plain\n")
        print(shown_prompt + mark_draft_tokens(llm.tokenizer, output.prompt_token_ids, completion))
    else:
        print(shown_prompt + completion.text)
    print()
    label = f"{method} k={spec.num_speculative_tokens}" if spec and method else "target alone"
    if spec and method and spec.tree != "chain":  # k nodes of a tree; by position = by depth
        label += f" tree {spec.tree}"
    if spec and isinstance(spec.model, tuple):  # staged: the stages, first to last
        label = f"{method} {' -> '.join(Path(stage).name for stage in spec.model)} k={spec.num_speculative_tokens}"
    print(f"[{label}] {output.metrics.summary()}")
    for line in stage_summaries(llm.engine.drafter):
        print(line)
    if baseline is not None:  # --compare
        print(f"[target alone] {baseline.metrics.summary()}")
        # tokens/s, not seconds: sampled or stopped, the two outputs differ in length
        speedup = output.metrics.tokens_per_second / baseline.metrics.tokens_per_second
        same = baseline.outputs[0].token_ids == output.outputs[0].token_ids
        print(f"speedup {speedup:.2f}x" + (f"; greedy outputs identical: {same}" if params.greedy else ""))
        if params.greedy and not same:
            print(divergence_note(baseline.outputs[0].token_ids, output.outputs[0].token_ids, llm.target.model.dtype))
    return 0


def stage_summaries(drafter) -> list[str]:
    """For staged drafts, a line per stage drafted for, last first: its inner rounds in the last
    generate, their τ (tokens per forward of the stage's model) and α; nothing for other drafters."""
    from specdec.spec.staged import StagedDrafter

    lines = []
    while isinstance(drafter, StagedDrafter):
        stats = drafter.stats
        model, inner = (Path(stage).name for stage in drafter.stages[-2:][::-1])
        judged = (
            f"α {stats.acceptance_rate:.3f} ({stats.num_accepted_tokens} accepted/{stats.num_judged_tokens} judged/"
            f"{stats.num_draft_tokens} proposed)  "
            if stats.num_draft_tokens
            else ""
        )
        lines.append(
            f"[{model} drafted for by {inner}] tokens {stats.num_emitted_tokens}  forwards "
            f"{stats.num_target_forwards}  τ {stats.tokens_per_forward:.2f}  {judged}{stats.k_summary()}".rstrip()
        )
        drafter = drafter.inner
    return lines


def _faster(first, second):
    """Of two runs of one request, the one with more tokens per second (the first if the second
    sampled other tokens: unseeded, it drew other random numbers)."""
    if second.outputs[0].token_ids != first.outputs[0].token_ids:
        return first
    return second if second.metrics.tokens_per_second > first.metrics.tokens_per_second else first


def divergence_note(expected: list[int], got: list[int], dtype) -> str:
    """Where greedy speculative output first leaves the target's own, and why that can happen."""
    import torch

    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    note = f"the outputs first differ at generated token {position}"
    if dtype != torch.float32:
        note += (
            f": in {str(dtype).removeprefix('torch.')} a forward over k+1 tokens can round differently from a "
            "one-token step and flip a near-tie between two tokens (--dtype float32 is exact)"
        )
    return note


DRAFT_COLOR, RESET = "\033[32;1m", "\033[0m"


def mark_draft_tokens(tokenizer, prompt_ids: list[int], completion) -> str:
    """The completion's text with each run of accepted draft tokens in color. Each run's text
    is what its tokens add to the text decoded so far (after the prompt, as the engine
    decodes); a character split between two runs goes with the first. A completion a stop
    string cut is marked whole, then cut to its text's length."""
    ids, draft = completion.token_ids, completion.from_draft
    runs, start, decoded = [], 0, ""  # runs: (text, is_draft)
    for end in range(1, len(ids) + 1):
        if end < len(ids) and draft[end] == draft[start]:
            continue
        text = tokenizer.decode_after(prompt_ids, ids[:end])
        if end < len(ids) and text.endswith("\ufffd"):
            continue  # the run ends inside a character: it takes the rest of it
        runs.append((text[len(decoded) :], draft[start]))
        start, decoded = end, text
    if not decoded.startswith(completion.text):
        return completion.text
    pieces, left = [], len(completion.text)
    for text, is_draft in runs:
        text, left = text[:left], left - len(text[:left])
        pieces.append(f"{DRAFT_COLOR}{text}{RESET}" if is_draft and text else text)
    return "".join(pieces)


if __name__ == "__main__":
    sys.exit(main())
