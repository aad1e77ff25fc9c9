"""The `specdec train`, `specdec distill` and `specdec train-heads` subcommands (argparse, wired in by cli.py).

    specdec train --corpus PATH --out DIR (--preset NAME | size flags) [training flags]
    specdec distill TARGET --out DIR [--preset draft | size flags | --init DIR] [flags]
    specdec train-heads TARGET --out DIR [--context N] [head flags] [training flags]

The model a command starts from comes first, positionally, as in every subcommand (--target
TARGET, the earlier spelling, is still taken).

Flags left out take the defaults of TrainConfig / DistillConfig / HeadsConfig / the preset, so each
default lives in one place. Progress goes to stderr, the final summary to stdout. A run stopped by
Ctrl-C or a full disk says in one line what it kept (its last checkpoint) and how to go on.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.model_flags import add_model_argument, require_model
from specdec.tools.training.train import PRESETS, model_shape

SIZE_FLAGS = {  # flag -> ModelShape field
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size",
    "context": "context",
}
TRAIN_FIELDS = (
    "steps",
    "batch_size",
    "grad_accum",
    "lr",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "grad_clip",
    "seed",
    "device",
    "eval_every",
    "eval_tokens",
    "checkpoint_every",
    "log_every",
    "stop_after",
)
DISTILL_FIELDS = (
    "temperature",
    "on_policy_fraction",
    "sample_temperature",
    "prompt_tokens",
    "divergence",
    "target_dtype",
    "embeddings_from_target",
    "output_vocab",
)
HEADS_FIELDS = (
    "context",
    "feature_weight",
    "token_weight",
    "feature_noise",
    "on_policy_fraction",
    "sample_temperatures",
    "prompt_tokens",
    "target_dtype",
    "output_vocab",
)
# (TrainConfig, DistillConfig and HeadsConfig fields, each set by the flag of the same name)


def add_train_parser(commands) -> None:
    p = commands.add_parser(
        "train",
        help="train a tokenizer and a Llama model on a text corpus",
        description="Train a byte-level BPE tokenizer and a Llama-architecture model on a "
        "corpus, writing a Hugging Face model directory. Rerunning the same "
        "command with the same --out resumes from its checkpoint.",
    )
    p.add_argument(
        "--corpus",
        help="a text file or a directory of text files (default: this Python's "
        "standard library, with fixed modules held out)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output directory for the model (written as OUT.incomplete/ "
        "until the run finishes; OUT/checkpoint/ resumes or lengthens it)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="reuse the tokenizer.json in DIR (e.g. the target's, to "
        "train a draft that shares it) instead of training one",
    )
    p.add_argument(
        "--init",
        metavar="DIR",
        help="go on training the model in DIR (its weights, size and tokenizer) with a new schedule",
    )
    _add_size_flags(p, default_preset=None)
    _add_training_flags(p)
    p.set_defaults(run=run_train)


def _target_command(commands, name: str, help: str, description: str, out: str):
    """A subcommand that trains something for a TARGET model into --out DIR (out: what DIR holds)."""
    p = commands.add_parser(name, help=help, usage="%(prog)s TARGET --out DIR [options]", description=description)
    add_model_argument(p, "target", "the target's model directory", old_flag="--target")
    p.add_argument(
        "--out", required=True, help=f"output directory for {out} (written as OUT.incomplete/ until the run finishes)"
    )
    return p


def add_distill_parser(commands) -> None:
    p = _target_command(
        commands,
        "distill",
        help="distill a draft model from a target model",
        description="Train a draft that shares the target's tokenizer to match the target's "
        "next-token distributions; reports the acceptance rate α = 1 - TV(p, q) "
        "on held-out text before and after.",
        out="the draft",
    )
    p.add_argument("--corpus", help="text to distill on (default: this Python's standard library)")
    p.add_argument("--init", metavar="DIR", help="start from this trained draft instead of a random one")
    _add_size_flags(p, default_preset="draft")
    p.add_argument("--temperature", type=float, help="temperature of both distributions (default 1)")
    p.add_argument(
        "--on-policy-fraction", type=float, help="fraction of batches of text sampled from the target (default 0)"
    )
    p.add_argument(
        "--sample-temperature",
        type=float,
        help="temperature on-policy text is sampled at; 0 is the target's greedy text (default: --temperature)",
    )
    p.add_argument("--prompt-tokens", type=int, help="corpus tokens an on-policy sample continues (default 32)")
    p.add_argument("--divergence", choices=("fkl+tv", "tv", "fkl"), help="the loss (default fkl+tv)")
    p.add_argument(
        "--target-dtype",
        choices=("auto", "float32", "bfloat16"),
        help="the target's weights while distilling (default auto: as saved)",
    )
    p.add_argument(
        "--output-vocab",
        type=int,
        metavar="N",
        help="the draft's output layer scores only the N tokens most frequent in the training text "
        "(FR-Spec): a cheaper draft step with a large vocabulary; default 0, all of them",
    )
    p.add_argument(
        "--embeddings-from-target",
        action="store_true",
        default=None,
        help="start the draft's embedding from the target's, projected onto its top principal directions",
    )
    _add_training_flags(p)
    p.set_defaults(run=run_distill)


def add_train_heads_parser(commands) -> None:
    p = _target_command(
        commands,
        "train-heads",
        help="train an EAGLE draft head for a target model",
        description="Train an EAGLE head (one decoder layer over the target's own features, "
        "Li et al. 2024) on text the target writes; reports the held-out greedy "
        "agreement and α = 1 - TV(p, q) of its first draft token before and after. "
        "Rerunning the same command with the same --out resumes from its "
        "checkpoint.",
        out="the head (head.json, head.safetensors)",
    )
    p.add_argument(
        "--corpus",
        help="text whose windows the target continues, and held-out text to evaluate on "
        "(default: this Python's standard library)",
    )
    h = p.add_argument_group("the head's training (defaults: specdec.tools.training.heads.HeadsConfig)")
    h.add_argument("--context", type=int, help="tokens per training window (default 512; at most the target's)")
    h.add_argument("--feature-weight", type=float, help="weight of the smooth L1 loss on the next feature (default 1)")
    h.add_argument(
        "--token-weight", type=float, help="weight of the KL(p || q) loss on the token after it (default 0.1)"
    )
    h.add_argument(
        "--feature-noise",
        type=float,
        help="uniform noise on the features the head reads in training, as a fraction of their root "
        "mean square (default 0.1)",
    )
    h.add_argument(
        "--on-policy-fraction",
        type=float,
        help="fraction of batches of text the target writes; the rest are corpus windows (default 1)",
    )
    h.add_argument(
        "--sample-temperatures",
        type=_temperatures,
        metavar="T[,T...]",
        help="temperatures the target's text is sampled at, one chosen at random per batch; 0 is its "
        "greedy text (default 0,0.8)",
    )
    h.add_argument("--prompt-tokens", type=int, help="corpus tokens the target's text continues (default 32)")
    h.add_argument(
        "--target-dtype",
        choices=("auto", "float32", "bfloat16"),
        help="the target's weights while training (default auto: as saved)",
    )
    h.add_argument(
        "--output-vocab",
        type=int,
        metavar="N",
        help="the head scores only the N tokens most frequent in the training text (FR-Spec), through "
        "those rows of the target's output layer: a cheaper step for a large vocabulary; default 0, "
        "all of them",
    )
    e = p.add_argument_group(
        "EAGLE-3 (--eagle3; defaults: specdec.tools.training.eagle3.Eagle3Config; --context and --output-vocab "
        "apply too, default 512 and 32768, or every token the target scores where it scores no more)"
    )
    e.add_argument(
        "--eagle3",
        action="store_true",
        help="train an EAGLE-3 head: it reads a low, a middle and a high layer of the target, is trained on "
        "its tokens with its own predictions fed back (training-time test), over the target's features "
        "stored once from a chat-data corpus (--data)",
    )
    e.add_argument("--data", help="the chat-data corpus (`specdec chat-data`) whose documents it trains on")
    e.add_argument(
        "--text",
        metavar="CORPUS",
        help="a text corpus the head also trains on, every token of it (a directory of text files, a file, "
        "or 'stdlib' for the Python standard library): its features cost only a prefill, so it is where a "
        "head gets most of its tokens; the evaluation stays on --data's held-out answers",
    )
    e.add_argument(
        "--text-tokens", type=int, metavar="N", help="how many of --text's tokens (default 1,000,000, shuffled)"
    )
    e.add_argument(
        "--init-head",
        metavar="DIR",
        help="start from this EAGLE-3 head's weights and scored tokens (the same shape: --output-vocab, "
        "--head-intermediate and --feature-layers as it was trained with) instead of random ones: to go "
        "on training a head, a shipped one, on more data",
    )
    e.add_argument(
        "--features",
        help="where the target's features are stored (default: OUT.features); a new or empty directory, or "
        "one holding stored features (--force: one holding other files too, written beside them)",
    )
    e.add_argument(
        "--feature-layers",
        type=_layers,
        metavar="I,J,K",
        help="the target layers read (default: 1, L/2 - 1 and L - 4 of L)",
    )
    e.add_argument("--ttt-steps", type=int, help="drafting steps unrolled in training (default 4)")
    e.add_argument("--head-intermediate", type=int, metavar="N", help="the head's MLP width (default: the target's)")
    e.add_argument("--top-k", type=int, help="the target's most likely next tokens stored per position (default 32)")
    _add_training_flags(p, sharded=False)
    p.set_defaults(run=run_train_heads)


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 1,13,24, got {text!r}") from None


def add_restrict_head_parser(commands) -> None:
    p = commands.add_parser(
        "restrict-head",
        help="cut an EAGLE head's output layer to the most frequent tokens",
        description="Copy an EAGLE head with its output layer cut to the N tokens most frequent "
        "in the corpus (FR-Spec, no training): a cheaper drafting step for a large "
        "vocabulary; the drafts it loses are of rare tokens.",
    )
    p.add_argument("head", metavar="HEAD", help="the head's directory (from `specdec train-heads`)")
    p.add_argument("--target", required=True, help="the target's model directory (the head's own)")
    p.add_argument("--output-vocab", type=int, required=True, metavar="N", help="how many tokens the head scores")
    p.add_argument(
        "--corpus",
        help="text whose token counts decide (default: this Python's standard library, as train-heads reads it)",
    )
    p.add_argument("--out", required=True, help="output directory for the cut head")
    p.add_argument("--force", action="store_true", help="replace an --out that holds other files")
    p.set_defaults(run=run_restrict_head)


def run_restrict_head(args) -> int:
    from specdec.tools.training.heads import restrict_head

    shares = restrict_head(args.head, args.target, args.out, args.output_vocab, args.corpus, args.force)
    print(
        f"wrote {args.out}: the head scores {args.output_vocab:,} tokens, "
        f"{shares['training_tokens_kept']:.1%} of the training text's tokens and "
        f"{shares['held_out_tokens_kept']:.1%} of the held-out text's"
    )
    return 0


def _temperatures(text: str) -> tuple[float, ...]:
    """--sample-temperatures: comma-separated numbers."""
    try:
        return tuple(float(word) for word in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0,0.8, got {text!r}") from None


def _add_size_flags(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    sizes = p.add_argument_group("model size (a preset, optionally with some sizes replaced)")
    sizes.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset,
        help=f"target ~22M, draft ~2M, tiny ~0.25M parameters (default {default_preset})",
    )
    for flag in SIZE_FLAGS:
        sizes.add_argument("--" + flag.replace("_", "-"), type=int)
    sizes.add_argument("--untie-embeddings", action="store_true", help="a separate output matrix")


def _add_training_flags(p: argparse.ArgumentParser, sharded: bool = True) -> None:
    """The shared training flags; sharded: the output is a model whose weights --max-shard-mb splits."""
    t = p.add_argument_group("training (defaults: specdec.tools.training.loop.TrainConfig)")
    for flag in (
        "steps",
        "batch_size",
        "grad_accum",
        "warmup",
        "seed",
        "eval_every",
        "eval_tokens",
        "checkpoint_every",
        "log_every",
        "stop_after",
    ):
        t.add_argument("--" + flag.replace("_", "-"), type=int)
    for flag in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
        t.add_argument("--" + flag.replace("_", "-"), type=float)
    t.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    t.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16: bfloat16 autocast (default); fp32: plain float32",
    )
    t.add_argument(
        "--save-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the saved weights (default bfloat16)",
    )
    if sharded:
        t.add_argument("--max-shard-mb", type=float, default=15.0, help="largest safetensors file, in MB (default 15)")
    t.add_argument(
        "--force",
        action="store_true",
        help="replace an --out that holds other files (not an earlier run of this command): the whole "
        "directory, when the run finishes; an input model is never replaced",
    )
    resume = t.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="require a checkpoint in --out to resume from (resuming is automatic when one exists)",
    )
    resume.add_argument("--restart", action="store_true", help="ignore a checkpoint in --out and start over")


def run_train(args) -> int:
    from specdec.tools.training.train import train

    if args.init is not None and (
        args.preset is not None
        or args.tokenizer is not None
        or args.untie_embeddings
        or any(getattr(args, flag) is not None for flag in SIZE_FLAGS)
    ):
        raise ValueError(
            "--init takes the model's size and tokenizer from its directory; drop --preset, "
            "the size flags and --tokenizer"
        )
    if args.tokenizer is not None and args.vocab_size is not None:
        raise ValueError("--tokenizer brings its vocabulary (and its model's vocab_size); drop --vocab-size")
    shape = None if args.init is not None else _shape(args)
    try:
        with _full_disk_said(args, "train"):
            result = train(
                args.out,
                shape,
                _train_config(args),
                corpus_path=args.corpus,
                tokenizer_dir=args.tokenizer,
                init_dir=args.init,
                **_output_options(args),
            )
    except KeyboardInterrupt:
        return _interrupted(args)
    print(_summary(result, "held_out_loss", args.out))
    return 0


def run_distill(args) -> int:
    from specdec.tools.training.distill import DistillConfig, alpha_summary, distill

    require_model(args, "distill", "target", "the target's model directory")
    if args.init is not None and (
        args.untie_embeddings or args.preset != "draft" or any(getattr(args, flag) is not None for flag in SIZE_FLAGS)
    ):
        raise ValueError("--init takes the draft's size from its config.json; drop --preset and the size flags")
    if args.init is not None and args.output_vocab:
        raise ValueError("--output-vocab shapes a new draft and --init goes on with a trained one; drop one")
    if args.init is not None and args.embeddings_from_target:
        raise ValueError("--embeddings-from-target starts a new draft and --init goes on with a trained one; drop one")
    if args.vocab_size is not None:
        raise ValueError("a draft's vocabulary is its target's (the same tokenizer); drop --vocab-size")
    if not args.on_policy_fraction and (args.sample_temperature is not None or args.prompt_tokens is not None):
        raise ValueError(
            "--sample-temperature and --prompt-tokens shape the text the target writes, which only "
            "--on-policy-fraction F > 0 uses; add it, or drop them"
        )
    distill_config = DistillConfig(**_given(args, DISTILL_FIELDS))
    shape = None if args.init is not None else _shape(args)
    try:
        with _full_disk_said(args, "distill"):
            result = distill(
                args.target,
                args.out,
                shape,
                _train_config(args),
                distill_config,
                corpus_path=args.corpus,
                init_dir=args.init,
                **_output_options(args),
            )
    except KeyboardInterrupt:
        return _interrupted(args)
    print(_summary(result, "held_out_alpha", args.out))
    print(alpha_summary(result))
    return 0


def run_train_heads(args) -> int:
    from specdec.tools.training.heads import HeadsConfig, agreement_summary, train_heads

    require_model(args, "train-heads", "target", "the target's model directory")
    if args.eagle3 or args.data is not None:
        return _run_train_eagle3(args)
    if args.text is not None or args.text_tokens is not None:
        raise ValueError(
            "--text and --text-tokens feed an EAGLE-3 head's training (--eagle3 --data); an EAGLE-1 "
            "head trains on --corpus"
        )
    if args.init_head is not None:
        raise ValueError(
            "--init-head starts an EAGLE-3 head's training (--eagle3 --data) from a head of the same shape"
        )
    if args.on_policy_fraction == 0 and (args.sample_temperatures is not None or args.prompt_tokens is not None):
        raise ValueError(
            "--sample-temperatures and --prompt-tokens shape the text the target writes, which "
            "--on-policy-fraction 0 leaves out; drop them, or raise the fraction"
        )
    heads_config = HeadsConfig(**_given(args, HEADS_FIELDS))
    try:
        with _full_disk_said(args, "train-heads"):
            result = train_heads(
                args.target,
                args.out,
                _train_config(args),
                heads_config,
                corpus_path=args.corpus,
                **_output_options(args),
            )
    except KeyboardInterrupt:
        return _interrupted(args)
    print(_summary(result, "held_out_greedy_agreement", args.out, made="head"))
    print(agreement_summary(result))
    return 0


# the flags that shape an EAGLE-1 head's training only (--eagle3 refuses them)
EAGLE1_ONLY = ("corpus", *(name for name in HEADS_FIELDS if name not in ("context", "output_vocab")))
EAGLE3_FIELDS = {
    "context": "context",
    "output_vocab": "output_vocab",
    "feature_layers": "feature_layers",
    "ttt_steps": "ttt_steps",
    "head_intermediate": "intermediate_size",
    "top_k": "top_k",
}


def _run_train_eagle3(args) -> int:
    from specdec.tools.training.eagle3 import Eagle3Config, train_eagle3

    if not args.eagle3 or args.data is None:
        raise ValueError("an EAGLE-3 head needs both --eagle3 and --data (a `specdec chat-data` corpus)")
    given = [f"--{name.replace('_', '-')}" for name in EAGLE1_ONLY if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} shape an EAGLE-1 head's training; drop them with --eagle3")
    values = {field: getattr(args, flag) for flag, field in EAGLE3_FIELDS.items() if getattr(args, flag) is not None}
    try:
        with _full_disk_said(args, "train-heads"):
            result = train_eagle3(
                args.target,
                args.data,
                args.out,
                _train_config(args),
                Eagle3Config(**values),
                args.features,
                **_output_options(args),
                **_text_options(args),
                **_init_options(args),
            )
    except KeyboardInterrupt:
        return _interrupted(args)
    print(_summary(result, "held_out_tau_estimate", args.out, made="head"))
    return 0


def _text_options(args) -> dict:
    """--text and --text-tokens as train_eagle3's arguments (--text-tokens needs --text)."""
    if args.text is None:
        if args.text_tokens is not None:
            raise ValueError("--text-tokens says how much of --text to read; give --text CORPUS too")
        return {}
    return {"text": args.text, **({"text_tokens": args.text_tokens} if args.text_tokens is not None else {})}


def _init_options(args) -> dict:
    """--init-head as train_eagle3's argument."""
    return {} if args.init_head is None else {"init_head": args.init_head}


def _interrupted(args) -> int:
    """Ctrl-C: a line on what was kept and how to go on, instead of a traceback."""
    found = _last_checkpoint(args)
    if found is None:
        message = (
            "interrupted before this run's first checkpoint (--checkpoint-every); nothing was kept, and "
            "rerunning the command starts over"
        )
    elif args.restart:
        message = f"interrupted; rerun without --restart to resume from the last checkpoint, {found}"
    else:
        message = f"interrupted; rerun the same command to resume from the last checkpoint, {found}"
    print(f"\n{message}", file=sys.stderr)
    return 130


def _last_checkpoint(args) -> Path | None:
    """The checkpoint a rerun of the command would resume from, if there is one."""
    from specdec.tools.training.loop import CHECKPOINT_FILE
    from specdec.tools.training.train import checkpoint_dirs

    return next((d / CHECKPOINT_FILE for d in checkpoint_dirs(args.out) if (d / CHECKPOINT_FILE).is_file()), None)


@contextmanager
def _full_disk_said(args, command: str) -> Iterator[None]:
    """A run stopped by a full disk: one line (a DiskFullError, which cli.py prints) saying where,
    how much is free, and the checkpoint it kept, if any."""
    from specdec.output_dir import said_when_disk_full, staging_path

    def kept() -> str:
        found = _last_checkpoint(args)
        if found is None:
            return (
                "nothing was kept (the run stopped before its first checkpoint, --checkpoint-every): free "
                "some space and rerun the command, which starts over"
            )
        how = " without --restart" if args.restart else ""
        return f"kept the last checkpoint, {found}: free some space and rerun the command{how} to resume from it"

    with said_when_disk_full(staging_path(args.out), f"the `specdec {command}` run", kept):
        yield


def _shape(args):
    sizes = _given(args, SIZE_FLAGS)
    if args.untie_embeddings:
        sizes["tie_word_embeddings"] = False
    return model_shape(args.preset, **sizes)


def _train_config(args):
    import torch

    from specdec.tools.training.loop import TrainConfig

    values = _given(args, TRAIN_FIELDS)
    values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    return TrainConfig(bf16=args.precision == "bf16", **values)


def _output_options(args) -> dict:
    arguments = {k: v for k, v in sorted(vars(args).items()) if k != "run" and v is not None and v is not False}
    options = {
        "save_dtype": args.save_dtype,
        "restart": args.restart,
        "require_checkpoint": args.resume,
        "force": args.force,
        "arguments": arguments,
    }
    if hasattr(args, "max_shard_mb"):  # a model's weights (not a head's single file)
        if not (math.isfinite(args.max_shard_mb) and args.max_shard_mb * 1_000_000 >= 1):
            raise ValueError(
                f"--max-shard-mb must be a number of at least 0.000001 (one byte), got {args.max_shard_mb}"
            )
        options["max_shard_bytes"] = int(args.max_shard_mb * 1_000_000)
    return options


def _given(args, names: dict[str, str] | tuple[str, ...]) -> dict:
    """{field: value} for the flags given on the command line; names: {flag: field}, or
    fields named like their flags."""
    names = names if isinstance(names, dict) else {name: name for name in names}
    return {field: getattr(args, flag) for flag, field in names.items() if getattr(args, flag) is not None}


def _summary(result, metric: str, out: str, made: str = "model") -> str:
    from specdec.output_dir import staging_path

    state = result.state
    where = (
        f"{made} written to {out}"
        if result.out is not None
        else f"stopped at step {state.step} of {result.steps} (--stop-after), its checkpoint in "
        f"{staging_path(out)}; rerun with a later --stop-after, or without it, to continue"
    )
    return (
        f"{where}\nsteps {state.step}  train loss {result.train_loss:.4f}  {metric} "
        f"{result.first_evaluation[metric]:.4f} (step 0) -> {result.last_evaluation[metric]:.4f}  "
        f"tokens seen {state.tokens_seen:,}  wall time {state.seconds / 60:.1f} min"
    )


def add_adapt_parser(commands) -> None:
    p = commands.add_parser(
        "adapt",
        help="fine-tune an EAGLE head on the traffic a server recorded (serve --learn)",
        usage="%(prog)s MODEL --from DIR [--out NEW] [options]",
        description="Fine-tune the EAGLE-3 head in use on the requests `specdec serve MODEL --learn DIR` "
        "recorded, and print its held-out agreement and tau before and after (the last quarter of "
        "the requests, never trained on). Exits 1 where the new head does not beat the old one. "
        "Without --out, into DIR/heads: a better head becomes the next version, which servers "
        "learning into DIR swap in while they run.",
    )
    add_model_argument(p, help="the target's model: a directory, a GGUF file or a registered name")
    p.add_argument("--from", dest="traffic", required=True, metavar="DIR", help="what `serve --learn DIR` recorded")
    p.add_argument(
        "--head",
        help="the EAGLE-3 head to start from (default: DIR/heads' current version without --out, else the one "
        "the registry ships for MODEL)",
    )
    p.add_argument(
        "--out",
        metavar="NEW",
        help="the directory of the new head (default: the next version in DIR/heads, where it is better)",
    )
    p.add_argument("--minutes", type=float, default=10.0, help="the most minutes of training (default 10)")
    p.add_argument("--steps", type=int, default=1000, help="the most training steps (default 1000)")
    p.add_argument("--force", action="store_true", help="replace a NEW that holds other files")
    p.set_defaults(run=run_adapt)


def run_adapt(args) -> int:
    from specdec.tools.training.adapt import adapt, adapt_into_store

    require_model(args, "adapt", "model", "the target's model")
    if not (math.isfinite(args.minutes) and args.minutes > 0) or args.steps < 1:
        raise ValueError(f"--minutes must be above 0 and --steps at least 1, got {args.minutes:g} and {args.steps}")
    arguments = {k: v for k, v in sorted(vars(args).items()) if k != "run" and v is not None and v is not False}
    version = None
    try:
        if args.out is None:
            adapted, version = adapt_into_store(
                args.model, args.traffic, args.head, args.minutes, args.steps, arguments=arguments
            )
        else:
            adapted = adapt(
                args.model,
                args.traffic,
                args.out,
                args.head,
                args.minutes,
                args.steps,
                force=args.force,
                arguments=arguments,
            )
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to resume from its last checkpoint", file=sys.stderr)
        return 130
    before, after = adapted.before, adapted.after
    print(
        f"held-out agreement {before['held_out_greedy_agreement']:.3f} -> {after['held_out_greedy_agreement']:.3f}, "
        f"tau estimate {before['held_out_tau_estimate']:.2f} -> {after['held_out_tau_estimate']:.2f} "
        f"({adapted.result.state.step} steps)"
    )
    if adapted.result.out is None:
        print("the run stopped before its end: rerun the same command to finish it", file=sys.stderr)
        return 1
    if not adapted.improved and args.out is None:
        print("the new head does not beat the one it started from: it is deleted, the current version stays")
        return 1
    if not adapted.improved:
        print(f"the new head in {adapted.result.out} does not beat the one it started from: serve the old one")
        return 1
    if version is not None:
        print(f"the new head: version {version.number}, {version.path} (servers learning into it swap it in)")
        return 0
    print(f"the new head: {adapted.result.out}")
    return 0
