"""The command line's shared vocabulary: the model every subcommand names first (add_model_argument:
`specdec generate MODEL`, `specdec serve MODEL`, `specdec bench MODEL`), one flag per
SpeculativeConfig field with the spelling, help and default its metadata gives
(add_speculative_arguments, used by generate, serve and bench), the flags that build an LLM
(add_model_arguments, make_llm: generate and serve), and the flags' words for a ConfigError
(flag_words: `-k must be an integer >= 0` where LLM says `num_speculative_tokens must be ...`)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import fields

from specdec.config import (
    COMPILE_HELP,
    COMPILE_MODES,
    NGRAM_STAGE,
    NO_SPECULATION,
    QUANTIZATION_ARGS,
    QUANTIZATION_HELP,
    SpeculativeConfig,
    Wording,
    as_stages,
    keyword,
    quantization_from_arg,
)

DEFAULT_EXIT = object()  # --early-exit without a layer: the drafter's default depth
MODEL_HELP = "the target: a Hugging Face directory, a .gguf file or a model's name (`specdec fetch`)"


# The model, first and positional in every subcommand (--model, the older spelling, still taken)


def add_model_argument(p, dest: str = "model", help: str = MODEL_HELP, old_flag: str = "--model") -> None:
    """MODEL (or another dest, e.g. TARGET), positional; old_flag gives it too, as before."""
    p.add_argument(dest, nargs="?", metavar=dest.upper(), action=_OneModel, help=help)
    p.add_argument(old_flag, dest=dest, metavar=dest.upper(), action=_OneModel, help=argparse.SUPPRESS)


class _OneModel(argparse.Action):
    """The positional model or its flag; both at once only if they agree."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the positional, not given
            return
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"two {self.dest}s given, {given} and {values}: give one")
        setattr(namespace, self.dest, values)


def require_model(args, command: str, dest: str = "model", what: str = MODEL_HELP) -> str:
    """The model the command was given, else a ValueError that shows where it goes."""
    model = getattr(args, dest)
    if not model:
        raise ValueError(f"{command} needs a {dest}: specdec {command} {dest.upper()} ... ({what})")
    return model


# SpeculativeConfig's fields as flags, the same in every subcommand


def speculative_fields() -> dict:
    """SpeculativeConfig's fields by name (their metadata: help, flags, old_flags, metavar, ...)."""
    return {f.name: f for f in fields(SpeculativeConfig)}


def dest(name: str) -> str:
    """Where argparse keeps a SpeculativeConfig field's flag: its long flag's name (--draft: draft)."""
    return speculative_fields()[name].metadata["flags"][-1].lstrip("-").replace("-", "_")


def flag(name: str) -> str:
    """A SpeculativeConfig field's flag as messages say it: its first spelling (-k, --draft, ...)."""
    return speculative_fields()[name].metadata["flags"][0]


def add_speculative_arguments(
    p,
    group=None,
    grouped: tuple[str, ...] = (),
    notes: dict | None = None,
    shown: dict | None = None,
    options: dict | None = None,
    hidden: tuple[str, ...] = (),
) -> None:
    """One flag per SpeculativeConfig field: its spellings, help and default as its metadata says
    (setting() in config.py), its older spellings taken but not shown. Not given, a flag is None
    (its field's default applies), unless options give a default. A command says what differs
    for it: group (an argparse group) holds the grouped fields' flags; notes: field -> a sentence
    added to its help; shown: field -> its default as the command says it; options: field ->
    argparse keywords (default, action); hidden: fields taken but not shown."""
    notes, shown, options = notes or {}, shown or {}, options or {}
    for name, f in speculative_fields().items():
        meta = f.metadata
        where = group if name in grouped else p
        assert where is not None, "grouped fields need a group"
        kwargs = dict(
            dest=dest(name),
            default=None,
            metavar=meta["metavar"],
            type=meta["parse"] if meta["choices"] is None else str,
            choices=meta["choices"],
        )
        if meta["bare"]:
            kwargs.update(nargs="?", const=DEFAULT_EXIT)
        if meta["repeat"]:  # each use adds an entry: --draft A --draft B
            kwargs.update(action="append")
        kwargs.update(options.get(name, {}))
        if kwargs.get("action") == "append":
            kwargs.pop("const", None)
            kwargs.pop("nargs", None)
        note = f"; {notes[name]}" if name in notes else ""
        help = f"{meta['help']}{note} (default: {shown.get(name, meta['shown'])})".replace("%", "%%")
        where.add_argument(*meta["flags"], help=argparse.SUPPRESS if name in hidden else help, **kwargs)
        for old in meta["old_flags"]:
            where.add_argument(old, help=argparse.SUPPRESS, **kwargs)


def given_settings(args, names=None) -> dict:
    """{field: value} of the SpeculativeConfig flags given (as their field takes it: --draft-quantization
    none is None); names: the fields to look at (default all)."""
    given = {}
    for name, f in speculative_fields().items():
        value = getattr(args, dest(name), None)
        if (names is None or name in names) and value is not None:
            is_text = f.metadata["choices"] is not None and isinstance(value, str)
            given[name] = f.metadata["parse"](value) if is_text else value
    return given


def flag_words(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Wording:
    """A ConfigError in the words of this (sub)command: each field by the flag the user typed
    (in argv; else its first spelling), `--tree auto` for speculative_tree='auto'; a field the
    command has no flag for, by its Python keyword."""
    options = {option for action in parser._actions for option in action.option_strings}
    typed = set(argv or ())

    def spellings(owner, name):
        meta = next((f.metadata for f in fields(owner) if f.name == name), {})
        return [
            s
            for s in (*meta.get("flags", ("--" + name.replace("_", "-"),)), *meta.get("old_flags", ()))
            if s in options
        ]

    def name_of(owner, name):
        known = spellings(owner, name)
        return next(
            (s for s in known if s in typed or any(a.startswith(s + "=") for a in typed)),
            known[0] if known else keyword(owner, name),
        )

    def value_of(owner, name, value):
        if not spellings(owner, name):
            return f"{keyword(owner, name)}={value!r}"
        if isinstance(value, tuple):  # a repeated flag's entries: --draft A --draft B
            return " ".join(f"{name_of(owner, name)} {_typed(entry)}" for entry in value) or name_of(owner, name)
        return f"{name_of(owner, name)} {_typed(value)}"

    def placeholder(owner, name, text):
        meta = next((f.metadata for f in fields(owner) if f.name == name), {})
        if not spellings(owner, name):
            return f"{keyword(owner, name)}={text}"
        return f"{name_of(owner, name)} {meta.get('metavar') or text}"

    return Wording(name_of, value_of, placeholder)


def _typed(value) -> str:
    """A value as it is typed after its flag."""
    return "none" if value is None else shlex.quote(value) if isinstance(value, str) else str(value)


# The flags that build an LLM: generate and serve


def add_model_arguments(p) -> None:
    """The flags that make the LLM, shared by generate and serve: the drafter (SpeculativeConfig's
    fields, and --ngram / --lookup / --early-exit, which imply its method), dtypes, quantization,
    device, compile (read back by make_llm)."""
    speculation = p.add_argument_group("speculation (SpeculativeConfig; the same flags in generate, serve and bench)")
    drafter = speculation.add_mutually_exclusive_group()
    drafter.add_argument("--ngram", action="store_true", help="draft by prompt lookup (no draft model)")
    speculation.add_argument(
        "--lookup",
        action="store_true",
        help="with --draft: prompt lookup where the context repeats, the draft model elsewhere",
    )
    add_speculative_arguments(speculation, group=drafter, grouped=("model", "early_exit_layer"))
    p.add_argument(
        "--dtype",
        default="auto",
        help="the target's dtype: auto (the checkpoint's), float32, bfloat16 or float16 (default: auto)",
    )
    p.add_argument("--quantization", choices=QUANTIZATION_ARGS, default="auto", help=QUANTIZATION_HELP)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)


def make_llm(args, **options):
    """The LLM the flags of add_model_arguments describe (options: more of LLM's arguments)."""
    from specdec.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        compile=args.compile,
        quantization=quantization_from_arg(args.quantization),
        speculative_config=speculative_config_from_flags(args),
        **options,
    )


def speculative_config_from_flags(args) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags describe (None: no drafter), validated by SpeculativeConfig
    alone; what it refuses is said in the flags' words by the command line (flag_words)."""
    method = _speculative_method(args)
    given = given_settings(args)
    model = as_stages(given.pop("model", None))  # --draft given once: a directory; more: the stages
    given.pop("method", None)
    if given.get("early_exit_layer") is DEFAULT_EXIT:
        del given["early_exit_layer"]
    if method == NO_SPECULATION:
        flags = [flag(name) for name in given] + (["--draft"] if model is not None else [])
        if flags:
            raise ValueError(
                f"{_listed(flags)} {'sets' if len(flags) == 1 else 'set'} speculation, which --speculative-method "
                f"{NO_SPECULATION} turns off: drop {'it' if len(flags) == 1 else 'them'}, or the method"
            )
        return None
    if method is None and model is None:
        return SpeculativeConfig(method="auto", **given)
    if method is None and model == NGRAM_STAGE:  # --draft '[ngram]', as LLM(speculative_model="[ngram]")
        method, model = "ngram", None
    if method is None:  # stages, or a directory: a head's says what it is
        from specdec.models.eagle import is_head_directory

        method = "staged" if isinstance(model, tuple) else "eagle" if is_head_directory(model) else "draft_model"
    return SpeculativeConfig(method=method, model=model, **given)


def _speculative_method(args) -> str | None:
    """The drafter flags -> SpeculativeConfig's method (None: none, or --draft alone)."""
    implied = _implied_method(args)
    given = args.speculative_method
    if given is None or given == implied:
        return implied
    if implied is None:
        return given  # --draft DIR --speculative-method eagle, or a method with no flag of its own
    raise ValueError(
        f"--speculative-method {given} contradicts the drafter flags, which say {implied}; give one or the other"
    )


DRAFT_MODEL_FIELDS = ("draft_confidence_threshold", "draft_dtype", "draft_quantization")  # set the draft model
LOOKUP_FIELDS = ("ngram_min", "ngram_max")  # set prompt lookup


def _implied_method(args) -> str | None:
    """The method generate's drafter flags imply (None: none, or --draft alone)."""
    if args.lookup and args.draft is not None and len(args.draft) > 1:
        raise ValueError(
            "--lookup puts prompt lookup in front of one draft model; with stages, give prompt lookup as the "
            f"first of them: --draft '{NGRAM_STAGE}' --draft DIR ..."
        )
    if args.lookup and args.draft is None:
        raise ValueError(
            "--lookup falls back to a draft model where prompt lookup finds nothing: add --draft DIR"
            + (" (instead of --ngram, which is prompt lookup alone)" if args.ngram else "")
        )
    given = given_settings(args)
    draft_flags = [flag(name) for name in DRAFT_MODEL_FIELDS if name in given]
    lookup_flags = [flag(name) for name in LOOKUP_FIELDS if name in given]
    if args.early_exit is not None:
        if args.lookup or lookup_flags or [f for f in draft_flags if f != flag("draft_confidence_threshold")]:
            raise ValueError(
                "--early-exit drafts with the target's own layers: drop --lookup, --draft-dtype, "
                "--draft-quantization, --ngram-min and --ngram-max"
            )
        return "early_exit"
    if args.ngram:
        if draft_flags:
            raise ValueError(
                f"{_listed(draft_flags)} {'sets' if len(draft_flags) == 1 else 'set'} the draft "
                "model, and --ngram uses none; drop them, or give --draft DIR --lookup for prompt lookup "
                "with a draft model behind it"
            )
        return "ngram"
    if args.draft is None and args.speculative_method is None:
        return None  # auto: the registry's drafter behind the free ones (drafters/auto.py)
    drafts = args.draft or []
    if len(drafts) > 1 and lookup_flags and drafts[0] != NGRAM_STAGE:
        raise ValueError(
            f"{_listed(lookup_flags)} {'sets' if len(lookup_flags) == 1 else 'set'} prompt lookup, which these "
            f"stages do not use: give it as the first, --draft '{NGRAM_STAGE}', or drop them"
        )
    if len(drafts) > 1 or (drafts == [NGRAM_STAGE] and not args.lookup):  # stages, or prompt lookup as a draft
        return None
    if lookup_flags and not args.lookup and args.speculative_method not in ("ngram", "lookup_then_draft"):
        raise ValueError(
            f"{_listed(lookup_flags)} {'sets' if len(lookup_flags) == 1 else 'set'} prompt lookup, "
            "which --draft alone does not use: add --lookup (or use --ngram), or drop them"
        )
    return "lookup_then_draft" if args.lookup else None  # None: a draft model, an EAGLE head's directory, or none


def _listed(words: list[str]) -> str:
    return " and ".join(words)
