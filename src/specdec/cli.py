"""specdec's command line.

    specdec generate --model DIR|FILE.gguf [--draft DIR [--lookup] | --ngram] [-k N] (--prompt TEXT | --chat TEXT)
        [--compare]
    specdec train --corpus PATH --out DIR (--preset NAME | size flags)
    specdec distill --target DIR --out DIR
    specdec chat-data --target DIR --out DIR
    specdec bench [--quick] [--model DIR --draft DIR] [--device cuda] [--out DIR] [--write-docs]
    specdec convert FILE.gguf OUT_DIR [--dtype auto] [--force]
    specdec fetch smollm2
    specdec serve MODEL [--draft DIR | --ngram] [-k N] [--port 8000] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import logging
import sys

from specdec.config import (COMPILE_HELP, COMPILE_MODES, K_POLICIES, QUANTIZATION_ARGS, QUANTIZATION_HELP,
                            SPECULATIVE_METHODS, SamplingParams, quantization_from_arg)


def build_parser() -> argparse.ArgumentParser:
    from specdec.benchmark.commands import add_bench_parser  # these import torch: after main's try begins
    from specdec.models.commands import add_convert_parser, add_fetch_parser
    from specdec.serve.commands import add_serve_parser
    from specdec.training.chat_data import add_chat_data_parser
    from specdec.training.commands import (add_distill_parser, add_restrict_head_parser, add_train_heads_parser,
                                           add_train_parser)

    from specdec import __version__

    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for LLMs")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_train_parser(commands)
    add_distill_parser(commands)
    add_train_heads_parser(commands)
    add_restrict_head_parser(commands)
    add_chat_data_parser(commands)
    add_bench_parser(commands)
    add_convert_parser(commands)
    add_fetch_parser(commands)
    add_serve_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    show_log()
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (ValueError, OSError) as e:  # bad input, a path that cannot be read or written: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # train and distill say what they kept; the others have nothing to keep
        print("\ninterrupted", file=sys.stderr)
        return 130


def show_log() -> None:
    """specdec's log lines (the dtype chosen and why, compile times) on stderr, once."""
    log = logging.getLogger("specdec")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("specdec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


DEFAULT_EXIT = object()  # --early-exit without a layer: the drafter's default depth

def add_generate_parser(commands) -> None:
    p = commands.add_parser("generate", help="generate a completion, speculatively",
                            description="Generate a completion with the target model, verified against "
                                        "a draft model's or prompt lookup's proposals.")
    p.add_argument("--model", required=True, help="target model: a Hugging Face directory or a .gguf file")
    add_model_arguments(p)
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the prompt text, as is")
    text.add_argument("--chat", metavar="MESSAGE", help="a user message, rendered with the model's chat template "
                                                        "(the reply is printed alone)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], type=unescape,
                   help=r"a stop string (repeatable); \n, \t and \\ stand for a newline, a tab and a backslash")
    p.add_argument("--compare", action="store_true",
                   help="also run the target alone and print the speedup (each timed twice, the faster kept)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="mark accepted draft tokens in color (auto: when printing to a terminal)")
    p.set_defaults(run=run_generate)


def add_model_arguments(p) -> None:
    """The flags that make the LLM, shared by generate and serve: the drafter, k, dtypes,
    quantization, device, compile (read back by make_llm)."""
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft", help="draft model directory (shares the target's tokenizer), or an EAGLE head's "
                                         "directory (`specdec train-heads`)")
    drafter.add_argument("--ngram", action="store_true", help="draft by prompt lookup (no draft model)")
    drafter.add_argument("--early-exit", type=int, nargs="?", const=DEFAULT_EXIT, metavar="LAYER",
                         help="self-speculation: the target's first LAYER layers draft (default: half its depth)")
    p.add_argument("--lookup", action="store_true",
                   help="with --draft: prompt lookup where the context repeats, the draft model elsewhere")
    p.add_argument("-k", "--num-speculative-tokens", type=int,
                   help="draft tokens per round: the most, with --k-policy goodput (default 5)")
    p.add_argument("--k-policy", choices=K_POLICIES,
                   help="goodput (default): each round picks k from 0 to -k for the most expected tokens per "
                        "second, switching speculation off where it does not pay; fixed: always -k")
    p.add_argument("--tree", metavar="SHAPE",
                   help="draft a tree of -k candidate tokens each round, verified in one forward: 'auto' (EAGLE-2's "
                        "dynamic tree) or children per depth like '3,2,1'; default 'chain' (with --draft or "
                        "--early-exit)")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   help="the drafter, as LLM's speculative_method; the flags above imply it (--draft: draft_model, "
                        "or eagle for a head's directory)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--draft-dtype", default="auto",
                   help="the draft model's dtype: auto (float32 for a small draft on the CPU, else --dtype's), "
                        "float32, bfloat16 or float16")
    p.add_argument("--draft-confidence", type=float, metavar="P",
                   help="adaptive k: stop a round's drafting after a draft token the draft gave less than P "
                        "(default 0: always k)")
    p.add_argument("--quantization", choices=QUANTIZATION_ARGS, default="auto", help=QUANTIZATION_HELP)
    p.add_argument("--draft-quantization", choices=QUANTIZATION_ARGS, default="auto",
                   help="the same for the draft model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)


def make_llm(args, **options):
    """The LLM the flags of add_model_arguments describe (options: more of LLM's arguments)."""
    from specdec.llm import LLM

    return LLM(args.model, speculative_model=args.draft, speculative_method=_speculative_method(args),
               num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype, device=args.device,
               draft_dtype=args.draft_dtype, draft_confidence_threshold=args.draft_confidence, compile=args.compile,
               quantization=quantization_from_arg(args.quantization), speculative_k_policy=args.k_policy,
               draft_quantization=quantization_from_arg(args.draft_quantization),
               early_exit_layer=None if args.early_exit is DEFAULT_EXIT else args.early_exit,
               speculative_tree=args.tree, **options)


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


def _speculative_method(args) -> str | None:
    """The drafter flags -> LLM's speculative_method."""
    implied = _implied_method(args)
    given = args.speculative_method
    if given is None or given == implied:
        return implied
    if implied is None:
        return given  # --draft DIR --speculative-method eagle, or a method with no flag of its own
    raise ValueError(f"--speculative-method {given} contradicts the drafter flags, which say {implied}; "
                     "give one or the other")


def _implied_method(args) -> str | None:
    """The speculative_method generate's drafter flags imply (None: none, or --draft alone)."""
    if args.lookup and args.draft is None:
        raise ValueError("--lookup falls back to a draft model where prompt lookup finds nothing: add --draft DIR"
                         + (" (instead of --ngram, which is prompt lookup alone)" if args.ngram else ""))
    draft_flags = [flag for flag, given in (("--draft-confidence", args.draft_confidence is not None),
                                            ("--draft-dtype", args.draft_dtype != "auto"),
                                            ("--draft-quantization", args.draft_quantization != "auto")) if given]
    if args.early_exit is not None:
        if args.lookup or [flag for flag in draft_flags if flag != "--draft-confidence"]:
            raise ValueError("--early-exit drafts with the target's own layers: drop --lookup, --draft-dtype and "
                             "--draft-quantization")
        return "early_exit"
    if args.ngram:
        if draft_flags:
            raise ValueError(f"{' and '.join(draft_flags)} {'sets' if len(draft_flags) == 1 else 'set'} the draft "
                             "model, and --ngram uses none; drop them, or give --draft DIR --lookup for prompt lookup "
                             "with a draft model behind it")
        return "ngram"
    if args.draft is None and args.speculative_method is None:
        flags = draft_flags + (["-k"] if args.num_speculative_tokens is not None else []) + \
            (["--k-policy"] if args.k_policy is not None else []) + (["--tree"] if args.tree is not None else [])
        if flags:
            raise ValueError(f"{' and '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a drafter: add --draft "
                             "DIR or --ngram, or drop them")
        return None
    return "lookup_then_draft" if args.lookup else None  # None: a draft model, an EAGLE head's directory, or none


def run_generate(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    llm = make_llm(args)
    method = llm.speculative_config.method if llm.speculative_config else None  # as inferred from --draft
    prompt = args.prompt if args.chat is None else llm.chat_token_ids([{"role": "user", "content": args.chat}])
    llm.prompt_token_ids(prompt, params)  # a bad request is refused as itself, not as the warm-up
    baseline_llm = llm.target_only() if args.compare else None
    for warming in (llm, baseline_llm):  # first calls are slow
        if warming is not None:
            warming.warm_up(prompt, params)
    output = llm.generate(prompt, params)[0]
    baseline = baseline_llm.generate(prompt, params)[0] if args.compare else None
    if args.compare:  # timed twice each, interleaved; the faster of each (2-core machines are shared)
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
    label = f"{method} k={llm.speculative_config.num_speculative_tokens}" if method else "target alone"
    if method and llm.speculative_config.tree != "chain":  # k nodes of a tree; by position = by depth
        label += f" tree {llm.speculative_config.tree}"
    print(f"[{label}] {output.metrics.summary()}")
    if args.compare:
        print(f"[target alone] {baseline.metrics.summary()}")
        # tokens/s, not seconds: sampled or stopped, the two outputs differ in length
        speedup = output.metrics.tokens_per_second / baseline.metrics.tokens_per_second
        same = baseline.outputs[0].token_ids == output.outputs[0].token_ids
        print(f"speedup {speedup:.2f}x" + (f"; greedy outputs identical: {same}" if params.greedy else ""))
        if params.greedy and not same:
            print(divergence_note(baseline.outputs[0].token_ids, output.outputs[0].token_ids, llm.target.model.dtype))
    return 0


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
        note += (f": in {str(dtype).removeprefix('torch.')} a forward over k+1 tokens can round differently from a "
                 "one-token step and flip a near-tie between two tokens (--dtype float32 is exact)")
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
        runs.append((text[len(decoded):], draft[start]))
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
