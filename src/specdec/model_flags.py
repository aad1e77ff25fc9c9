"""The command-line flags that build an LLM, shared by `specdec generate` and `specdec serve`:
the drafter, k, dtypes, quantization, device, compile (add_model_arguments), and the LLM they
describe (make_llm)."""

from __future__ import annotations

from specdec.config import (COMPILE_HELP, COMPILE_MODES, K_POLICIES, QUANTIZATION_ARGS, QUANTIZATION_HELP,
                            SPECULATIVE_METHODS, quantization_from_arg)

DEFAULT_EXIT = object()  # --early-exit without a layer: the drafter's default depth


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
