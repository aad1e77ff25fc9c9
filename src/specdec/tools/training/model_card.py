"""The model card (README.md) that `specdec train` and `specdec distill` write beside the weights.

Everything in it comes from the run itself: training_log.json (the command's arguments, the
optimizer settings, steps, tokens, wall time, device, evaluations) and config.json. Rerun
`python -m specdec.tools.training.model_card DIR` to write it again for a finished run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.platform import cpu_model
from specdec.tools.training.corpus import HELD_OUT_MODULES, load_corpus

# flags whose value the command line shows as a bare switch
SWITCHES = ("untie_embeddings", "resume", "restart", "force")


def write_model_card(out: str | Path, moved: dict[str, str] | None = None, name: str | None = None) -> Path:
    """Write out/README.md from out/training_log.json and out/config.json; return its path.
    moved: {directory the run used: where it is now}, for a run copied after it finished (the
    card's command then names the new places). name: the model's (default: out's name; a run
    writes its card in a staging directory named after the model's)."""
    out = Path(out)
    log = json.loads((out / "training_log.json").read_text())
    config = json.loads((out / "config.json").read_text())
    card = out / "README.md"
    card.write_text(model_card(name or out.name, log, config, moved or {}))
    return card


def model_card(name: str, log: dict, config: dict, moved: dict[str, str]) -> str:
    """The card's Markdown text."""
    kind = log["kind"]
    made = "draft" if kind == "distill" else "model"
    arguments = _moved_arguments(log, moved)
    earlier = _earlier_runs(log)  # the runs whose model this one started from (--init), oldest first
    firsts = [(run.get("evaluations") or [{}])[0] for run in earlier + [log]]  # each run's first, oldest first
    last = (log.get("evaluations") or [{}])[-1]
    steps, tokens = log["step"], log["tokens_seen"]
    train = log["train_config"]
    stdlib = "corpus" not in (log.get("arguments") or {})  # the default corpus: the standard library
    lines = [
        f"# {name}",
        "",
        f"A {_millions(config)}M-parameter Llama-architecture model{' of Python code' if stdlib else ''}, "
        + (
            (
                f"trained by `specdec train` in {len(earlier) + 1} runs."
                if earlier
                else "trained from scratch by `specdec train`."
            )
            if kind == "train"
            else f"distilled by `specdec distill` to draft for the target `{_shown_path(log['target'])}`: "
            "it shares the target's tokenizer and learned the target's next-token distributions."
        ),
        "It writes plausible-looking standard-library Python, but it is a demonstration model: small, "
        "trained on one library, and often wrong."
        if stdlib
        else "It is small and trained on one corpus (below): check what it writes before relying on it.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {_architecture(config)} |",
        f"| parameters | {_millions(config)}M |",
        f"| weights | {config.get('torch_dtype', '?')} safetensors |",
        f"| corpus | {log.get('corpus') or _corpus_line(arguments.get('corpus'))} |",
        f"| held out | {some_names(log.get('held_out') or _held_out(arguments.get('corpus')))} (never trained on) |",
        f"| training | {steps:,} steps of {train['batch_size'] * train['grad_accum']} windows; {tokens:,} tokens; "
        f"AdamW lr {train['lr']:g} (warm-up {train['warmup']}, cosine to {train['lr'] * train['min_lr_ratio']:g}), "
        f"weight decay {train['weight_decay']:g}, {'bfloat16 autocast' if train['bf16'] else 'float32'}, "
        f"seed {train['seed']} |",
    ]
    if kind == "distill":
        distill = log.get("distill", {})
        lines.append(
            f"| distillation | loss {distill.get('divergence', '?')} on the target's soft labels at "
            f"temperature {distill.get('temperature', '?')}, on-policy fraction "
            f"{distill.get('on_policy_fraction', 0)}{_on_policy_sampling(distill)} |"
        )
        if log.get("target_sha256"):
            lines.append(
                f"| target weights | sha256 `{log['target_sha256']}` (the first 16 hex digits, over its "
                "safetensors files) |"
            )
    for run in earlier:
        lines.append(
            f"| started from | the {made} of an earlier run: {run['step']:,} steps, {run['tokens_seen']:,} "
            f"tokens, lr {run['train_config']['lr']:g}, {run['seconds'] / 60:.1f} min |"
        )
    minutes = [run["seconds"] / 60 for run in earlier + [log]]
    lines += [
        f"| time and hardware | {' + '.join(f'{m:.1f}' for m in minutes)} min on {_hardware(log)} |",
        f"| held-out evaluation | {_evaluation_line(firsts, last)} |",
        "",
        "## Made by",
        "",
    ]
    if earlier:
        lines += [
            f"{len(earlier) + 1} runs, in this order; each after the first starts from the {made} the one "
            "before wrote (`--init`).",
            "",
        ]
        if kind == "distill":
            lines += _target_history(earlier + [log])
    lines += [
        "```",
        *(command_line(run["kind"], _moved_arguments(run, moved)) for run in earlier),
        command_line(kind, arguments),
        "```",
        "",
    ]
    if moved:
        commands = "the commands above name" if earlier else "the command above names"
        lines += [
            f"Copied after the run{'s' if earlier else ''}: "
            + ", ".join(f"`{old}` to `{new}`" for old, new in moved.items())
            + f" ({commands} the new places).",
            "",
        ]
    lines += [
        "Runs are deterministic up to floating-point reduction order: the same command with the same "
        "seed on the same machine and library versions gives the same model.",
        "",
        *(
            ["The corpus is Python's standard library, under the Python Software Foundation License.", ""]
            if stdlib
            else []
        ),
    ]
    return "\n".join(lines)


def _moved_arguments(log: dict, moved: dict[str, str]) -> dict:
    """A run's command-line arguments, with the directories that moved named where they are now."""
    return {key: moved.get(str(value), value) for key, value in (log.get("arguments") or {}).items()}


def _earlier_runs(log: dict) -> list[dict]:
    """The training logs of the runs a distill continued from (its --init draft's, and so
    on), oldest first."""
    runs, run = [], log.get("init_log")
    while run:
        runs.insert(0, run)
        run = run.get("init_log")
    return runs


def _target_history(runs: list[dict]) -> list[str]:
    """A paragraph naming the runs that distilled from other target weights than the last
    run, or that did not record them; none where all recorded the last run's."""
    last = runs[-1].get("target_sha256")
    unrecorded = [i + 1 for i, run in enumerate(runs) if not run.get("target_sha256")]
    other = [i + 1 for i, run in enumerate(runs) if run.get("target_sha256") not in (None, last)]
    sentences = []
    if other:
        sentences.append(f"{_runs(other)} distilled from other weights of the target than the last run's.")
    if len(unrecorded) == len(runs):
        sentences.append("No run records which weights of the target it distilled from (the record came later).")
    elif unrecorded:
        sentences.append(
            f"{_runs(unrecorded)} {'does' if len(unrecorded) == 1 else 'do'} not record which "
            f"weights of the target {'it' if len(unrecorded) == 1 else 'they'} distilled from "
            "(the record came later)."
        )
    return [" ".join(sentences), ""] if sentences else []


def _runs(numbers: list[int]) -> str:
    """'Run 3' or 'Runs 1, 2 and 4'."""
    if len(numbers) == 1:
        return f"Run {numbers[0]}"
    return f"Runs {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def _millions(config: dict) -> str:
    from specdec.models.loader import model_config_from_hf

    return f"{model_config_from_hf(config, Path('config.json')).num_parameters / 1e6:.2f}"


def _architecture(c: dict) -> str:
    tied = "tied" if c.get("tie_word_embeddings") else "untied"
    output = (
        f"; its output layer scores the {c['output_vocab_size']} tokens most frequent in the training text "
        "(the others are never drafted; the target still emits them)"
        if c.get("output_vocab_size")
        else ""
    )
    return (
        f"{c['architectures'][0]}: {c['num_hidden_layers']} layers, hidden size {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} key/value heads), MLP "
        f"{c['intermediate_size']}, vocabulary {c['vocab_size']} (byte-level BPE), context "
        f"{c['max_position_embeddings']}, {tied} embeddings{output}"
    )


def _corpus_line(path: str | None) -> str:
    return load_corpus(path).describe().removeprefix("corpus ")


def _on_policy_sampling(distill: dict) -> str:
    """How on-policy text was sampled, where there was any."""
    if not distill.get("on_policy_fraction"):
        return ""
    temperature = distill.get("sample_temperature")
    temperature = distill.get("temperature", "?") if temperature is None else temperature
    return " (the target's greedy text)" if temperature == 0 else f" (sampled at temperature {temperature})"


def _shown_path(path: str) -> str:
    """A path as the card shows it: under the home directory as ~/..."""
    home = str(Path.home())
    return "~" + path[len(home) :] if path.startswith(home + "/") else path


def some_names(names: list[str], shown: int = 12) -> str:
    """Up to `shown` names, then how many there are in all."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])}, ... ({len(names)} in all)"


def _held_out(path: str | None) -> list[str]:
    return list(HELD_OUT_MODULES) if path is None else [d.name for d in load_corpus(path).held_out]


def _hardware(log: dict) -> str:
    device = log.get("device", "cpu")
    if device != "cpu":
        return device
    return f"{log.get('cpu') or cpu_model()}, {log.get('torch_threads', '?')} threads, no GPU"


def _evaluation_line(firsts: list[dict], last: dict) -> str:
    """Each held-out metric the last run measured, from the first evaluation of the earliest run
    that measured it (a draft first trained by `train`, then distilled, has no α before its
    distillation) to the last run's last. firsts: each run's first evaluation, oldest first."""
    parts = []
    several = len(firsts) > 1
    for key, label in (
        ("held_out_loss", "loss (nats/token)"),
        ("held_out_alpha", "α = 1 − TV"),
        ("held_out_greedy_agreement", "greedy agreement"),
    ):
        if key not in last:
            continue
        run = next((i for i, first in enumerate(firsts) if key in first), len(firsts) - 1)
        first = firsts[run] if key in firsts[run] else last
        where = (
            ""
            if not several
            else (
                " of the first run" if run == 0 else " of the last" if run == len(firsts) - 1 else f" of run {run + 1}"
            )
        )
        parts.append(
            f"{label} {first[key]:.3f} (step {first['step']}{where}) → {last[key]:.3f} "
            f"(step {last['step']}{' of the last' if several else ''})"
        )
    return "; ".join(parts) or "none"


def command_line(kind: str, arguments: dict, positional: tuple[str, ...] = ()) -> str:
    """The command a run was given: `specdec KIND`, the positional arguments named, then the
    flags in name order (switches bare, a list of numbers comma-separated)."""
    words = ["specdec", kind, *(str(arguments[name]) for name in positional if name in arguments)]
    for key, value in sorted(arguments.items()):
        if key == "command" or key in positional:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True or key in SWITCHES:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            words += [flag, ",".join(f"{v:g}" for v in value)]
        else:
            words += [flag, str(value)]
    return " ".join(words)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m specdec.tools.training.model_card",
        description="write README.md for a finished train or distill run",
    )
    parser.add_argument("model_dir")
    parser.add_argument(
        "--moved",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="a directory the run used and where it is now (repeatable)",
    )
    args = parser.parse_args(argv)
    pairs = [m.split("=", 1) for m in args.moved]
    if any(len(pair) != 2 for pair in pairs):
        parser.error("--moved takes OLD=NEW")
    print(write_model_card(args.model_dir, dict(pairs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
