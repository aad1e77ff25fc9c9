"""The `specdec bench` subcommand (argparse, wired in by cli.py).

    specdec bench [MODEL --draft DIR] [--head DIR] [--tree SHAPE]... [--early-exit [LAYER]]
                  [--device cpu|cuda] [--quick] [--out DIR]
                  [--max-tokens N] [--ks 1,2,... | -k K] [--prompts N] [--no-transformers] [--write-docs]
    specdec bench --llama-cpp [GGUF --draft GGUF] [--cross-tokenizer-draft MODEL] [--head DIR]
                  [--systems NAME,...] [--cpu-kinds native|avx2|both] ...  (llama_cpp.py)

Without MODEL it benchmarks the shipped pair (models/code-target, models/code-draft), with the
shipped EAGLE head (models/code-target-eagle), "auto" trees and early exit at half the depth.
Its speculative flags are SpeculativeConfig's, as generate's and serve's, each setting the rows
it measures; those the bench varies itself (--speculative-method, --k-policy, --ngram-min,
--ngram-max) are refused. Progress goes to stderr, the Markdown report to stdout; files go under --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec.config import (
    COMPILE_HELP,
    COMPILE_MODES,
    QUANTIZATION_ARGS,
    QUANTIZATION_HELP,
    SpeculativeConfig,
    quantization_from_arg,
)
from specdec.model_flags import DEFAULT_EXIT, add_model_argument, add_speculative_arguments, flag, given_settings
from specdec.paths import DOCS, SHIPPED_DRAFT, SHIPPED_HEAD, SHIPPED_TARGET, in_checkout

FULL = {"prompts": 8, "max_tokens": 128, "ks": (1, 2, 3, 4, 5, 6, 7, 8)}
ADAPTIVE_CONFIDENCE = 0.5
QUICK = {"prompts": 4, "max_tokens": 32, "ks": (1, 3, 5)}
# SpeculativeConfig's fields the bench does not take: it measures each drafter, fixed k and goodput,
# prompt lookup with its default n-grams
VARIED = ("method", "k_policy", "ngram_min", "ngram_max")


def add_bench_parser(commands) -> None:
    p = commands.add_parser(
        "bench",
        help="benchmark speculative decoding against the target alone and transformers",
        usage="%(prog)s [MODEL [--draft DIR]] [options]",
        description="Measure, in one run with the methods interleaved prompt by prompt: the "
        "target alone, the draft model at each k, prompt lookup, an EAGLE head, "
        "trees and early exit at k = 5, and transformers' "
        "generate (plain, assisted, prompt lookup), greedy and sampled, on held-out "
        "code prompts and on prompts that repeat code. Reports tokens/s, speedup, "
        "α, τ, acceptance by position, the cost ratio c, the predicted speedup, the "
        "memory-bandwidth roofline and a greedy exactness check.",
    )
    add_model_argument(
        p,
        help=f"the target's directory (default: the shipped pair, {in_checkout(SHIPPED_TARGET)}); "
        "with --llama-cpp a GGUF file or a model's name",
    )
    p.add_argument(
        "--head",
        metavar="DIR",
        help="an EAGLE head for the target: rows for it at the comparison k (5), chain and trees "
        f"(default with no MODEL: {in_checkout(SHIPPED_HEAD)}); with --llama-cpp its rows (eagle, and "
        "lookup_then_eagle: prompt lookup, else the head), none without it",
    )
    speculation = p.add_argument_group("speculation (SpeculativeConfig; the same flags as generate's and serve's)")
    add_speculative_arguments(
        speculation,
        hidden=VARIED,
        notes={
            "model": "in the bench: rows of it at each k, plain, adaptive, by goodput, behind prompt lookup",
            "num_speculative_tokens": "in the bench: the one k of the speculative rows, as --ks K",
            "draft_confidence_threshold": "in the bench: a row of the draft model with adaptive k at P, up to the "
            "largest k (0: no such row)",
            "early_exit_layer": "in the bench: a row for it at the comparison k (5)",
            "tree": "in the bench: rows of the draft model and the head growing each shape, of 5 nodes; repeatable",
        },
        shown={
            "model": f"{in_checkout(SHIPPED_DRAFT)} with no MODEL, else none",
            "num_speculative_tokens": "--ks's",
            "draft_confidence_threshold": f"{ADAPTIVE_CONFIDENCE} in the bench",
            "draft_quantization": "none: as loaded, as auto for the bench's model directories",
            "early_exit_layer": "half the target's depth with no MODEL, else no such row",
            "tree": "auto with no MODEL, else none",
        },
        options={
            "draft_confidence_threshold": {"default": ADAPTIVE_CONFIDENCE},
            "draft_dtype": {"default": "auto"},
            "draft_quantization": {"default": "none"},
            "tree": {"action": "append"},
        },
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_ARGS,
        default="none",
        help=QUANTIZATION_HELP + "; a quantized target is also compared with the unquantized one "
        "(greedy agreement, perplexity, speed)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a few minutes: {QUICK['prompts']} prompts per set, {QUICK['max_tokens']} tokens, "
        f"k in {{{','.join(map(str, QUICK['ks']))}}}",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="bench_out",
        help="directory for results.json, results.md and the plots (default bench_out); an earlier "
        "bench's is replaced, a directory of other files refused",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --out that holds other files: the whole directory, once the results are written",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help=f"new tokens per prompt (default {FULL['max_tokens']}, --quick {QUICK['max_tokens']})",
    )
    p.add_argument(
        "--ks",
        type=_int_list,
        metavar="K,K,...",
        help="comma-separated k values of the speculative rows (default 1..8, --quick 1,3,5)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        metavar="N",
        help=f"prompts per set (default {FULL['prompts']}, --quick {QUICK['prompts']})",
    )
    p.add_argument(
        "--prompt-sets",
        type=_name_list,
        metavar="SET,SET",
        help="code (held-out code completion), repeat (code repeated from the prompt), chat (held-out "
        'chat prompts about functions, for a chat model), edit (its "edit this function" '
        "ones) and batch (one instruction over many functions, sent one after another: a batch job), "
        'and with --llama-cpp write (its "write a function" ones); default code,repeat '
        "(--llama-cpp: write,edit)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds of the sampled runs (prompt i uses seed + i)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' generate rows")
    p.add_argument("--write-docs", action="store_true", help="also write docs/benchmarks.md (and its plots)")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="instead, compare with llama.cpp on the same GGUF file (default --model "
        "qwen2.5-coder-1.5b-instruct, --draft qwen2.5-coder-0.5b-instruct), prompts (default "
        "--prompt-sets write,edit) and threads: llama.cpp plain, prompt lookup and draft model "
        "(its own tools, built from source under build/llama-cpp on first use, ~6 minutes) against "
        "specdec plain, prompt lookup, draft model and lookup_then_draft, greedy, k = the largest "
        "of --ks (default 5), with specdec's staged drafts, other-tokenizer draft and EAGLE head "
        "(--systems); --write-docs writes its section of docs/benchmarks.md only",
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="with --llama-cpp: both engines sample at temperature 0.8, top-p 0.95 (prompt i seeded "
        "--seed + i; llama.cpp's top-k and min-p off) instead of decoding greedily",
    )
    p.add_argument(
        "--systems",
        type=_name_list,
        metavar="NAME,NAME",
        help="with --llama-cpp: the systems compared, by method: plain (always run: both engines' "
        "baselines), ngram and draft_model (both engines), lookup_then_draft, staged (prompt lookup "
        "drafting for --draft), cross_tokenizer (--cross-tokenizer-draft), eagle and lookup_then_eagle "
        "(--head), suffix and suffix_then_eagle (--head) (suffix decoding; specdec's); default every one whose "
        "model is given or fetched",
    )
    p.add_argument(
        "--adapt",
        type=int,
        metavar="N",
        help="with --llama-cpp: the adaptation row. The first N requests of the one prompt set (default "
        "batch) served by the default and recorded as `serve --learn` records them, `specdec adapt` run on "
        "them for --adapt-minutes from --head (default: the registry's head for the model), then the "
        "--prompts requests after them measured: plain, the head, the adapted head",
    )
    p.add_argument(
        "--adapt-minutes",
        type=float,
        metavar="M",
        help="with --adapt: the most minutes of adapt's training (default 10)",
    )
    p.add_argument(
        "--cross-tokenizer-draft",
        metavar="MODEL",
        help="with --llama-cpp: the draft of another tokenizer than the target's for the "
        "cross_tokenizer row, a GGUF file, model directory or registered name (default "
        "SmolLM2-135M-Instruct's GGUF file where `specdec fetch smollm2` has fetched it)",
    )
    p.add_argument(
        "--cpu-kinds",
        choices=("native", "avx2", "both"),
        default=None,
        help="with --llama-cpp: this CPU as it is (native), held to AVX2 (PyTorch and oneDNN held by "
        "ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, llama.cpp built for AVX2), or both, one after "
        "the other (default: the kind this process runs as, so avx2 where those variables hold it)",
    )
    p.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from specdec.tools.benchmark.report import markdown, write_docs, write_report
    from specdec.tools.benchmark.run import run_benchmark

    args.draft = _one_draft(args.draft)
    only_llama_cpp = [
        f for f in ("systems", "cross_tokenizer_draft", "adapt", "adapt_minutes") if getattr(args, f) is not None
    ]
    only_llama_cpp += ["sampled"] if args.sampled else []
    if only_llama_cpp and not args.llama_cpp:
        raise ValueError(
            f"{', '.join('--' + f.replace('_', '-') for f in only_llama_cpp)}: for the comparison with "
            "llama.cpp only (add --llama-cpp)"
        )
    if args.llama_cpp:
        from specdec.tools.benchmark.llama_cpp import run_llama_cpp_bench

        _check_speculative_flags(args, llama_cpp=True)
        args.ks = _ks(args)
        return run_llama_cpp_bench(args)
    config = bench_config(args)
    with open_bench_output(args, config) as output:  # before the minutes of measuring, not after
        output.clear_staging()
        results = run_benchmark(config, progress=lambda message: print(message, file=sys.stderr, flush=True))
        paths = write_report(results, output.staging)
        written = [output.final / path.name for path in paths.values()]
        if args.write_docs:
            written.append(write_docs(results, paths, DOCS, command_line(args)))
        output.commit()
    print(markdown(results))
    print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    return 0


def bench_config(args):
    """BenchConfig from the parsed flags: the shipped pair by default, --quick's sizes unless
    a flag names its own."""
    from specdec.tools.benchmark.run import BenchConfig

    _check_speculative_flags(args)
    model, draft = resolve_pair(args.model, _one_draft(args.draft))
    shipped = args.model is None
    head = args.head if args.head is not None or not shipped else str(SHIPPED_HEAD)
    trees = tuple(args.tree) if args.tree else (("auto",) if shipped else ())
    early_exit = args.early_exit if args.early_exit is not None or not shipped else DEFAULT_EXIT
    if early_exit is DEFAULT_EXIT:
        early_exit = _half_depth(model)
    sizes = QUICK if args.quick else FULL
    return BenchConfig(
        model=model,
        draft=draft,
        device=args.device,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        compile=args.compile,
        quantization=quantization_from_arg(args.quantization),
        draft_quantization=quantization_from_arg(args.draft_quantization),
        adaptive_confidence=args.draft_confidence,
        ks=_given_or(_ks(args), sizes["ks"]),
        max_tokens=_given_or(args.max_tokens, sizes["max_tokens"]),
        prompts_per_set=_given_or(args.prompts, sizes["prompts"]),
        prompt_sets=args.prompt_sets or ("code", "repeat"),
        with_transformers=not args.no_transformers,
        seed=args.seed,
        head=head,
        trees=trees,
        early_exit_layer=early_exit,  # pyright: ignore[reportArgumentType]  # DEFAULT_EXIT is replaced above
    )


def _ks(args) -> tuple[int, ...] | None:
    """--ks, or -k's one k (None: neither given)."""
    if args.num_speculative_tokens is None:
        return args.ks
    if args.ks is not None:
        raise ValueError(f"{flag('num_speculative_tokens')} K is --ks K: give one of them")
    return (args.num_speculative_tokens,)


def _check_speculative_flags(args, llama_cpp: bool = False) -> None:
    """The speculative flags' values, checked by SpeculativeConfig as generate's are (before
    anything loads); those the bench varies itself refused."""
    varied = [flag(name) for name in given_settings(args, VARIED)]
    if varied:
        raise ValueError(
            f"the bench measures every drafter, at fixed k and by goodput, prompt lookup with its default "
            f"n-grams: {' and '.join(varied)} {'does' if len(varied) == 1 else 'do'} not apply to it "
            "(generate and serve take it)"
        )
    if llama_cpp and args.draft_confidence != ADAPTIVE_CONFIDENCE:
        raise ValueError(
            f"--llama-cpp runs every system as LLM does by default on a GGUF file; "
            f"{flag('draft_confidence_threshold')} does not apply to it"
        )
    given = given_settings(
        args, ("num_speculative_tokens", "draft_dtype", "draft_confidence_threshold", "draft_quantization")
    )
    SpeculativeConfig(method="draft_model", model=_one_draft(args.draft) or "DRAFT", **given)
    for shape in args.tree or ():
        SpeculativeConfig(method="draft_model", model="DRAFT", tree=shape)
    if args.early_exit not in (None, DEFAULT_EXIT):
        SpeculativeConfig(method="early_exit", early_exit_layer=args.early_exit)


def _half_depth(model: str) -> int:
    """Half the layers of the target in the directory model (early exit's default depth)."""
    return max(1, json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"] // 2)


def open_bench_output(args, config):
    """--out (output_dir.py): new, empty, or an earlier bench's results (replaced), never an
    input model or the docs --write-docs writes."""
    from specdec.output_dir import open_output_dir
    from specdec.tools.benchmark.report import PLOTS, is_bench_output

    inputs = {"--model": config.model, "--draft": config.draft}
    if args.write_docs:
        inputs["the docs --write-docs updates"] = DOCS
    return open_output_dir(
        args.out,
        "bench",
        inputs,
        args.force,
        is_bench_output,
        own_entries=("results.json", "results.md", *PLOTS),
        resumable=False,
    )


def _one_draft(drafts: list[str] | str | None) -> str | None:
    """--draft's directory: the bench measures one draft model (its rows at each k, adaptive, by
    goodput, behind prompt lookup, trees); --draft given more than once (staged drafts) is refused."""
    if drafts is None or isinstance(drafts, str):
        return drafts
    if len(drafts) > 1:
        raise ValueError(
            "the bench measures one draft model (--draft DIR); staged drafts (--draft given "
            f"{len(drafts)} times) run in generate (--compare: against the target alone) and serve"
        )
    return drafts[0]


def resolve_pair(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """(target, draft) directories: as given, or the shipped pair when no --model is given."""
    if model is not None:
        return model, draft
    if draft is not None:
        raise ValueError("--draft needs --model (the target it drafts for)")
    missing = [path for path in (SHIPPED_TARGET, SHIPPED_DRAFT) if not (path / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"the shipped model pair is missing ({', '.join(in_checkout(p) for p in missing)}): pass --model DIR "
            "[--draft DIR], or train the pair with `specdec train` and `specdec distill` (see the README)"
        )
    return str(SHIPPED_TARGET), str(SHIPPED_DRAFT)


def command_line(args) -> str:
    """The `specdec bench` command that reproduces this run (the flags given, written out)."""
    words = ["specdec", "bench"] + ([args.model] if args.model is not None else [])
    for draft in [args.draft] if isinstance(args.draft, str) else args.draft or []:
        words += ["--draft", draft]
    for name in (
        "device",
        "dtype",
        "draft_dtype",
        "draft_confidence",
        "out",
        "max_tokens",
        "prompts",
        "seed",
        "head",
    ):
        value = getattr(args, name)
        if value is not None:
            words += ["--" + name.replace("_", "-"), str(value)]
    for name, default in (("compile", "auto"), ("quantization", "none"), ("draft_quantization", "none")):
        if getattr(args, name) != default:
            words += ["--" + name.replace("_", "-"), getattr(args, name)]
    if args.num_speculative_tokens is not None:
        words += [flag("num_speculative_tokens"), str(args.num_speculative_tokens)]
    if args.early_exit is not None:
        words += ["--early-exit"] + ([] if args.early_exit is DEFAULT_EXIT else [str(args.early_exit)])
    for shape in args.tree or ():
        words += ["--tree", shape]
    if args.ks:
        words += ["--ks", ",".join(map(str, args.ks))]
    if args.prompt_sets and args.prompt_sets != ("code", "repeat"):
        words += ["--prompt-sets", ",".join(args.prompt_sets)]
    for name in ("quick", "no_transformers", "write_docs"):
        if getattr(args, name):
            words.append("--" + name.replace("_", "-"))
    return " ".join(shlex.quote(word) for word in words)


def _given_or(value, default):
    return default if value is None else value


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ks takes comma-separated integers, e.g. 1,3,5; got {text!r}") from None
