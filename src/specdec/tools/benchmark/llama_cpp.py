"""`specdec bench --llama-cpp`: specdec against llama.cpp on the same GGUF file, prompts and threads.

    specdec bench --llama-cpp [--model GGUF --draft GGUF] [--cross-tokenizer-draft MODEL]
                  [--head DIR] [--systems NAME,NAME,...] [--prompt-sets write,edit] [--prompts N]
                  [--max-tokens N] [--sampled [--seed S]] [--cpu-kinds native|avx2|both]
                  [--adapt N [--adapt-minutes M]] [--out DIR] [--write-docs]

llama.cpp: its own tools (llama-completion, llama-bench, llama-lookup, llama-speculative-simple),
built from the source that the llama-cpp-python sdist vendors: `pip download --no-binary :all:
--no-deps llama-cpp-python==0.3.36` into build/llama-cpp, extracted there, configured with cmake
and built with -j2 (minutes: docs/measuring.md, "Against llama.cpp"), once per CPU kind:
build/llama-cpp/build for this CPU as it is (-DGGML_NATIVE=ON), build/llama-cpp/build-avx2 for
AVX2 without AVX-512. A build is kept while its binaries exist and were built with the same
flags; a failed one is an error naming its cmake log.

What runs, interleaved prompt by prompt (the order rotated each prompt) on one GGUF target:
  llama.cpp  plain (llama-completion), prompt lookup (llama-lookup) and a draft model
             (llama-speculative-simple --spec-type draft-simple -md DRAFT), drafting k tokens
  specdec    plain (speculative_method "none"), the default (auto: LLM(model) with no speculative
             setting, k included; drafters/auto.py), prompt lookup (ngram), the draft model,
             lookup_then_draft, staged drafts (["[ngram]", DRAFT]: prompt lookup drafting for the
             draft model), a draft with another
             tokenizer (cross_tokenizer: SmolLM2-135M-Instruct by default, drafting through text)
             and an EAGLE head (--head), alone and behind prompt lookup (lookup_then_eagle:
             lookup_then_draft with the head), and suffix decoding (suffix: its shared tree fills
             as the prompts are sent, emptied after the warm-up), alone and with the head behind it
             (suffix_then_eagle), as LLM runs them by default (quantization "auto": the
             file's own quantized weights; goodput k <= k); the draft model's rows share its weights
--systems picks the rows by method (plain always runs: both engines' baselines); by default every
system whose models are given or fetched, a note saying which were left out and why.
Every system gets the same text: a chat prompt is rendered with the target's chat template by
specdec and handed to llama.cpp as raw text (-p, --no-escape, no template of its own), so both
tokenize the same text; the prompt token counts each reports are checked against each other. Same
threads (torch's), greedy (--temp 0 --top-k 1) or with --sampled at temperature 0.8 and top-p 0.95
(llama.cpp: --temp 0.8 --top-p 0.95 --top-k 0 --min-p 0, its other samplers off, prompt i seeded
seed + i; specdec's requests unseeded, as most users' are: a seeded sampled request keeps the
fixed k, since its tokens must not depend on the timings goodput reads, so seeding them would
measure fixed k; sampled outputs are not compared), at most max_tokens new tokens, both
stopping at an end-of-sequence token; tokens/s is the tokens each generated over its time, prefill included.
llama.cpp's times are its own: llama-completion's "prompt eval" + "eval" lines, the speculative
tools' "encoded" + "decoded" lines (which hold their drafting too), model loading left out, as
specdec's model is loaded once before the timed calls. Acceptance is llama.cpp's n_accept ÷
n_drafted, and specdec's accepted ÷ proposed draft tokens: the same measure; τ = tokens ÷ (tokens
− accepted), the tokens per target forward. specdec's rows also give α (accepted ÷ judged),
acceptance by draft position, the k goodput chose, and c as paid in the rounds: the drafter's
seconds per draft token asked for (Σ k over the rounds) ÷ specdec plain's seconds per target
forward (Engine.timings); a staged row its draft model's inner rounds' α and τ. The goals of issue
29 (goals.py) are judged from the rows.

Also what a verify forward costs: llama-bench -p 7 -n 32 -d 64 (7 prompt tokens, and 32 generated,
after 64 of context), time of the 7-token forward ÷ time per generated token, beside specdec's
own: a 7-token forward ÷ a 1-token forward of its target (runner, after 64 tokens of context).

--adapt N: the adaptation row (adaptation.py) on one prompt set: its first N requests served
by the default and recorded as `serve --learn` records them, the head adapted on them, and the
--prompts requests after them measured with the head and with the adapted head.

--cpu-kinds both measures twice: as the CPU is, then in a child process with PyTorch, oneDNN and
specdec's GGUF kernel held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
SPECDEC_KERNEL=avx2) and llama.cpp's AVX2 build.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specdec import paths

Say = Callable[[str], None]

SDIST_VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={SDIST_VERSION}"
HOME = paths.BUILD / "llama-cpp"
TOOLS = ("llama-completion", "llama-bench", "llama-lookup", "llama-speculative-simple")
CPU_KINDS = ("native", "avx2")
# PyTorch, oneDNN and specdec's GGUF kernel held to AVX2 (not AVX-VNNI, which llama.cpp's AVX2 build leaves out too)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "SPECDEC_KERNEL": "avx2"}
BUILD_DIRS = {"native": "build", "avx2": "build-avx2"}
COMMON_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF")
CPU_FLAGS = {  # ggml/CMakeLists.txt's instruction-set options
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ),
}
# The vendored llama.cpp's AMX matmul (compiled in where -march=native has AMX: Sapphire Rapids and
# later) dies with SIGILL at its first tile instruction on this project's Xeon machines: its tile
# configuration, built on the stack, is optimised away and the worker threads never ask Linux for
# the tile state (llama.cpp pull request 26954, open). The native build leaves AMX out (GCC's
# explicit -mno-* flags win over -march=native's); its AVX-512 (VNNI) kernels run instead, as on a
# CPU without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86_NATIVE_FLAGS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
STAMP = "specdec-build-flags.txt"  # in a build directory: the flags its binaries were built with
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
VERIFY_TOKENS = 7  # a verify forward of 6 draft tokens and the last one
BENCH_GEN = 32
BENCH_DEPTH = 64  # context before the timed forwards, as machine.step_seconds has
RUN_TIMEOUT = 1800  # seconds for one llama.cpp run


class LlamaCppError(RuntimeError):
    """llama.cpp could not be fetched, built or run, or its output not read; the message says
    what happened and where its log is."""


# -- building --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppBuild:
    """llama.cpp's tools, built for one CPU kind under home."""

    kind: str = "native"
    home: Path = HOME

    def __post_init__(self) -> None:
        if self.kind not in CPU_KINDS:
            raise ValueError(f"a llama.cpp build is for a CPU kind among {CPU_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "home", Path(self.home))

    @property
    def sdist_dir(self) -> Path:
        return self.home / f"llama_cpp_python-{SDIST_VERSION}"

    @property
    def source(self) -> Path:
        return self.sdist_dir / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.home / BUILD_DIRS[self.kind]

    @property
    def flags(self) -> tuple[str, ...]:
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        return COMMON_FLAGS + CPU_FLAGS[self.kind] + (X86_NATIVE_FLAGS if x86 and self.kind == "native" else ())

    def tool(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    def is_built(self) -> bool:
        stamp = self.build_dir / STAMP
        return (
            all(self.tool(name).is_file() for name in TOOLS)
            and stamp.is_file()
            and stamp.read_text().splitlines() == list(self.flags)
        )


def ensure_built(build: LlamaCppBuild, say: Say, jobs: int = 2) -> LlamaCppBuild:
    """The build, made first if absent: the sdist fetched and extracted, cmake configured, the
    tools built (an existing build directory is built incrementally)."""
    if build.is_built():
        return build
    if not (build.source / "CMakeLists.txt").is_file():
        fetch_source(build, say)
    if shutil.which("cmake") is None:
        raise LlamaCppError("building llama.cpp needs cmake and a C++ compiler (e.g. apt-get install cmake g++)")
    build.build_dir.mkdir(parents=True, exist_ok=True)
    say(f"building llama.cpp ({build.kind}) in {build.build_dir}: {' '.join(build.flags)}")
    _run_logged(
        ["cmake", "-S", str(build.source), "-B", str(build.build_dir), *build.flags],
        build.build_dir / "cmake-configure.log",
        say,
        f"configuring llama.cpp ({build.kind})",
    )
    _run_logged(
        ["cmake", "--build", str(build.build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
        build.build_dir / "cmake-build.log",
        say,
        f"building llama.cpp ({build.kind})",
    )
    missing = [name for name in TOOLS if not build.tool(name).is_file()]
    if missing:
        raise LlamaCppError(
            f"the llama.cpp build finished without {', '.join(missing)} in {build.build_dir / 'bin'}; "
            f"see {build.build_dir / 'cmake-build.log'}"
        )
    (build.build_dir / STAMP).write_text("\n".join(build.flags) + "\n")
    return build


def fetch_source(build: LlamaCppBuild, say: Say) -> None:
    """The llama-cpp-python sdist (which vendors llama.cpp), downloaded with pip and extracted."""
    build.home.mkdir(parents=True, exist_ok=True)
    archive = build.home / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not archive.is_file():
        say(f"downloading the {SDIST} sdist into {build.home}")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            SDIST,
            "-d",
            str(build.home),
        ]
        if subprocess.run(command).returncode != 0 or not archive.is_file():
            raise LlamaCppError(
                f"`{' '.join(command)}` did not give {archive}; download it by hand into "
                f"{build.home}, or check the network and pip's settings"
            )
    say(f"extracting {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(build.home, filter="data")
    if not (build.source / "CMakeLists.txt").is_file():
        raise LlamaCppError(f"{archive} holds no vendor/llama.cpp/CMakeLists.txt; delete it to download it again")


def _run_logged(command: list[str], log: Path, say: Say, what: str) -> None:
    """Run command with its output in log, saying its progress (cmake's [ NN%]) every 5%."""
    shown, pattern = -5, re.compile(r"^\[\s*(\d+)%\]")
    with open(log, "w") as out:
        out.write(" ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            out.write(line)
            match = pattern.match(line)
            if match and int(match.group(1)) >= shown + 5:
                shown = int(match.group(1))
                say(f"{what}: {shown}%")
        returncode = process.wait()
    if returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise LlamaCppError(f"{what} failed (exit status {returncode}); the whole log is {log}. Its end:\n{tail}")


# -- command lines ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolOptions:
    """What every llama.cpp tool is given: threads, new tokens, draft tokens per round (k), and
    how it samples (temperature 0: greedy)."""

    threads: int
    max_tokens: int
    k: int
    context: int = 4096
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("threads", "max_tokens", "k", "context"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")


def _sampling_args(options: ToolOptions) -> list[str]:
    """Greedy (--temp 0 --top-k 1), or temperature and top-p alone: llama.cpp's top-k (40) and
    min-p (0.05), on by default, off, as specdec's SamplingParams has them."""
    if options.temperature == 0:
        return ["--temp", "0", "--top-k", "1"]
    return ["--temp", str(options.temperature), "--top-p", str(options.top_p), "--top-k", "0", "--min-p", "0"]


def _generation_args(model: str | Path, prompt: str, options: ToolOptions) -> list[str]:
    """The prompt as raw text (no escapes processed: code holds backslashes), sampled as options say."""
    return [
        "-m",
        str(model),
        "-p",
        prompt,
        "--no-escape",
        "-n",
        str(options.max_tokens),
        "-t",
        str(options.threads),
        *_sampling_args(options),
        "-c",
        str(options.context),
        "-s",
        str(options.seed),
    ]


def completion_command(build: LlamaCppBuild, model, prompt: str, options: ToolOptions) -> list[str]:
    """Plain decoding; -no-cnv: the prompt as given, without a chat template of llama.cpp's."""
    return [
        str(build.tool("llama-completion")),
        *_generation_args(model, prompt, options),
        "-no-cnv",
        "--no-display-prompt",
    ]


def lookup_command(build: LlamaCppBuild, model, prompt: str, options: ToolOptions) -> list[str]:
    """Prompt lookup decoding, drafting up to k tokens a round."""
    return [
        str(build.tool("llama-lookup")),
        *_generation_args(model, prompt, options),
        "--spec-draft-n-max",
        str(options.k),
    ]


def speculative_command(build: LlamaCppBuild, model, draft, prompt: str, options: ToolOptions) -> list[str]:
    """A draft model drafting k tokens a round (draft-simple), on the same threads."""
    return [
        str(build.tool("llama-speculative-simple")),
        *_generation_args(model, prompt, options),
        "-md",
        str(draft),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        str(options.k),
        "--spec-draft-n-min",
        "0",
        "-td",
        str(options.threads),
    ]


def bench_command(build: LlamaCppBuild, model, threads: int, repetitions: int = 5) -> list[str]:
    """llama-bench: a VERIFY_TOKENS-token forward and BENCH_GEN generated tokens after BENCH_DEPTH."""
    return [
        str(build.tool("llama-bench")),
        "-m",
        str(model),
        "-p",
        str(VERIFY_TOKENS),
        "-n",
        str(BENCH_GEN),
        "-d",
        str(BENCH_DEPTH),
        "-t",
        str(threads),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]


# -- reading llama.cpp's output --------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    """One generation, as either engine reports it."""

    prompt_tokens: int
    tokens: int  # generated (an end-of-sequence token included)
    prompt_seconds: float  # the prompt's forward (llama.cpp's speculative tools: all but its last token)
    decode_seconds: float  # the rest
    decode_tokens: int  # the tokens decode_seconds produced
    drafted: int | None = None
    accepted: int | None = None
    text: str | None = None
    # specdec's own counts (SpecStats, Engine.timings); None for llama.cpp
    judged: int | None = None  # draft tokens the verifier reached (α's denominator)
    proposed_by_position: tuple[int, ...] | None = None
    accepted_by_position: tuple[int, ...] | None = None
    rounds_by_k: tuple[int, ...] | None = None  # rounds at each k goodput chose (index k)
    draft_seconds: float | None = None  # the drafter's time in the rounds
    target_seconds: float | None = None  # the target's forwards' time in the rounds
    rounds: int | None = None  # target forwards after the prefill's
    inner: dict | None = None  # a staged drafter's inner rounds: SpecStats counts (INNER_COUNTS)

    @property
    def seconds(self) -> float:
        return self.prompt_seconds + self.decode_seconds


_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
_SYSTEM_INFO = re.compile(r"system_info: (.*)")
END_OF_TEXT = " [end of text]"


def parse_completion(stdout: str, stderr: str) -> Timed:
    """llama-completion's timings (common_perf_print): the prompt's forward, then one "run" per
    token after the first (which the prompt's forward gives). stdout is the generated text
    (with --no-display-prompt)."""
    prompt_ms, prompt_tokens = _last(_PROMPT_EVAL, stderr, "prompt eval time")
    eval_ms, runs = _last(_EVAL, stderr, "eval time")
    text = stdout.rstrip("\n").removesuffix(END_OF_TEXT)
    return Timed(int(prompt_tokens), int(runs) + 1, float(prompt_ms) / 1e3, float(eval_ms) / 1e3, int(runs), text=text)


def parse_speculative(stdout: str, stderr: str, prompt: str) -> Timed:
    """llama-lookup's and llama-speculative-simple's report: the prompt encoded (all but its last
    token, which the first round feeds), the tokens decoded with their drafting, n_drafted and
    n_accept. stdout is the prompt and then the generated text."""
    prompt_tokens, encode_seconds = _last(_ENCODED, stderr, "encoded ... tokens")
    tokens, decode_seconds = _last(_DECODED, stderr, "decoded ... tokens")
    (drafted,), (accepted,) = _last(_DRAFTED, stderr, "n_drafted"), _last(_ACCEPTED, stderr, "n_accept")
    text = stdout.removeprefix("\n\n")  # the tools print two line breaks, the prompt, then the tokens
    text = text[len(prompt) :].rstrip("\n") if text.startswith(prompt) else None
    return Timed(
        int(prompt_tokens),
        int(tokens),
        float(encode_seconds),
        float(decode_seconds),
        int(tokens),
        int(drafted),
        int(accepted),
        text,
    )


def parse_system_info(stderr: str) -> str | None:
    """The instruction sets llama.cpp says its CPU backend uses ("AVX2 = 1 | AVX512 = 1 | ...")."""
    found = _SYSTEM_INFO.findall(stderr)
    return found[-1].strip() if found else None


def parse_llama_bench(output: str) -> dict:
    """llama-bench's JSON: the verify forward (its prompt test) and a step (its generation test,
    per token), each from the median of its repetitions, and their ratio."""
    try:
        tests = json.loads(output)
        prompt = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
        generate = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
        verify_ms = statistics.median(prompt["samples_ns"]) / 1e6
        step_ms = statistics.median(generate["samples_ns"]) / generate["n_gen"] / 1e6
    except (ValueError, KeyError, TypeError, StopIteration) as e:
        raise LlamaCppError(
            f"llama-bench's output is not the JSON expected ({type(e).__name__}: {e}):\n{output[-2000:]}"
        ) from None
    return {
        "verify_tokens": prompt["n_prompt"],
        "depth": prompt.get("n_depth", 0),
        "verify_ms": verify_ms,
        "step_ms": step_ms,
        "verify_cost": verify_ms / step_ms,
        "commit": prompt.get("build_commit"),
    }


def _last(pattern: re.Pattern, text: str, what: str) -> tuple[str, ...]:
    found = pattern.findall(text)
    if not found:
        tail = "\n".join(text.splitlines()[-20:])
        raise LlamaCppError(f"llama.cpp's output has no {what!r} line; its end:\n{tail}")
    last = found[-1]
    return last if isinstance(last, tuple) else (last,)


def run_tool(command: list[str]) -> tuple[str, str]:
    """(stdout, stderr) of a llama.cpp tool; an error with its output's end if it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{Path(command[0]).name} ran longer than {RUN_TIMEOUT} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise LlamaCppError(f"{Path(command[0]).name} failed (exit status {done.returncode}):\n{tail}")
    return done.stdout, done.stderr


# -- what is compared ------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    engine: str  # "llama.cpp" or "specdec"
    method: str  # one of METHODS: "plain", "ngram" (prompt lookup), "draft_model", ...

    def label(self, k: int) -> str:
        if self.engine == "llama.cpp":
            return {
                "plain": "llama.cpp plain (llama-completion)",
                "ngram": f"llama.cpp prompt lookup (llama-lookup, k={k})",
                "draft_model": f"llama.cpp draft model (llama-speculative-simple, k={k})",
            }[self.method]
        return {
            "plain": "specdec plain",
            "auto": "specdec default (no speculative setting: auto)",
            "ngram": f"specdec prompt lookup (goodput k≤{k})",
            "draft_model": f"specdec draft model (goodput k≤{k})",
            "lookup_then_draft": f"specdec lookup, else draft (goodput k≤{k})",
            "staged": f"specdec staged: lookup → draft model (goodput k≤{k})",
            "cross_tokenizer": f"specdec other-tokenizer draft (goodput k≤{k})",
            "eagle": f"specdec EAGLE head (goodput k≤{k})",
            "adapted_eagle": f"specdec EAGLE head adapted to the job (goodput k≤{k})",
            "adapted_auto": "specdec default with the adapted head (suffix, else that head)",
            "lookup_then_eagle": f"specdec lookup, else EAGLE head (goodput k≤{k})",
            "suffix": f"specdec suffix decoding (goodput k≤{k} nodes)",
            "suffix_then_eagle": f"specdec suffix, else EAGLE head (goodput k≤{k})",
        }[self.method]


# the systems by method (--systems), in the order of the rows; llama.cpp runs the first three
METHODS = (
    "plain",
    "auto",
    "ngram",
    "draft_model",
    "lookup_then_draft",
    "staged",
    "cross_tokenizer",
    "eagle",
    "adapted_eagle",
    "adapted_auto",
    "lookup_then_eagle",
    "suffix",
    "suffix_then_eagle",
)
LLAMA_METHODS = ("plain", "ngram", "draft_model")
LLAMA_PLAIN = System("llama.cpp", "plain")
SPECDEC_PLAIN = System("specdec", "plain")
ADAPTED_METHODS = ("adapted_eagle", "adapted_auto")  # the adaptation row's systems: they need --adapt
LLAMA_SYSTEMS = tuple(System("llama.cpp", method) for method in LLAMA_METHODS)
DRAFTING = ("draft_model", "lookup_then_draft", "staged")  # the systems that need --draft
NEEDS = {  # each system that needs a model, the LlamaCppConfig field naming it and the flag
    **{method: ("draft", "--draft") for method in DRAFTING},
    "cross_tokenizer": ("cross_draft", "--cross-tokenizer-draft"),
    "eagle": ("head", "--head"),
    "adapted_eagle": ("head", "--head"),
    "adapted_auto": ("head", "--head"),
    "lookup_then_eagle": ("head", "--head"),
    "suffix_then_eagle": ("head", "--head"),
}
DEFAULT_CROSS_DRAFT = "smollm2"  # the registry's SmolLM2-135M-Instruct (Q4_1 GGUF), another tokenizer
INNER_COUNTS = ("drafted", "judged", "accepted", "emitted", "forwards")
SAMPLING_NAMES = ("greedy", "sampled")  # LlamaCppConfig.sampling: the main bench's GREEDY and SAMPLED


def prompt_sets() -> dict:
    """name -> (title, function(per_module, max_chars)): the bench's sets and "write"."""
    from specdec.tools.benchmark.prompts import held_out_chat_prompts
    from specdec.tools.benchmark.run import PROMPT_SETS

    def write(per_module: int = 2, max_chars: int = 1200):
        return held_out_chat_prompts(per_module, max_chars, kinds=("write",))

    return {"write": ('held-out "write a function" chat prompts', write), **PROMPT_SETS}


@dataclass(frozen=True)
class LlamaCppConfig:
    """What to compare. model / draft: GGUF files (draft None: no draft-model rows); cross_draft:
    a draft model of another tokenizer (a GGUF file or a model directory); head: an EAGLE head's
    directory; systems: the methods compared (METHODS; None: every one whose model is given;
    "plain" is always added); skipped: notes on systems left out, for the report; k: draft
    tokens per round (llama.cpp's --spec-draft-n-max; specdec's most, by goodput); threads:
    None = torch's; sampling: "greedy" or "sampled" (temperature 0.8, top-p 0.95: the main
    bench's GREEDY and SAMPLED settings), prompt i of a set seeded seed + i. adapt_requests > 0:
    the adaptation row (adaptation.py): that many requests of the one prompt set recorded, the
    head adapted on them for adapt_minutes, and the prompts_per_set requests after them measured
    (systems: plain, eagle and adapted_eagle, unless given)."""

    model: str
    draft: str | None = None
    cross_draft: str | None = None
    head: str | None = None
    systems: tuple[str, ...] | None = None
    skipped: tuple[str, ...] = ()
    prompt_sets: tuple[str, ...] = ("write", "edit")
    prompts_per_set: int = 8
    max_tokens: int = 128
    k: int = 5
    threads: int | None = None
    max_prompt_chars: int = 1200
    bench_repetitions: int = 5
    step_repeats: int = 20
    sampling: str = "greedy"
    seed: int = 0
    adapt_requests: int = 0
    adapt_minutes: float = 10.0

    @property
    def setting(self):
        """The SamplingSetting (benchmark/run.py) both engines sample with."""
        from specdec.tools.benchmark.run import GREEDY, SAMPLED

        return {s.name: s for s in (GREEDY, SAMPLED)}[self.sampling]

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_sets", tuple(self.prompt_sets))
        if self.sampling not in SAMPLING_NAMES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_NAMES)}, got {self.sampling!r}")
        if type(self.seed) is not int:
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "skipped", tuple(self.skipped))
        self._check_adaptation()
        if self.systems is None and self.adapt_requests:
            systems = ["plain", "eagle", "adapted_eagle"]
        elif self.systems is None:
            systems = [
                m
                for m in METHODS
                if m not in ADAPTED_METHODS and (m not in NEEDS or getattr(self, NEEDS[m][0]) is not None)
            ]
        else:
            unknown = sorted(set(self.systems) - set(METHODS))
            if unknown:
                raise ValueError(f"systems must be among {', '.join(METHODS)}; got {', '.join(unknown)}")
            adapting = ("eagle", "adapted_eagle") if self.adapt_requests else ()
            systems = [m for m in METHODS if m == "plain" or m in self.systems or m in adapting]
            for method in set(systems) & set(ADAPTED_METHODS):
                if not self.adapt_requests:
                    raise ValueError(f"the system {method} needs --adapt N (the requests to adapt the head on)")
        missing = [m for m in systems if m in NEEDS and getattr(self, NEEDS[m][0]) is None]
        if missing:
            raise ValueError(
                "; ".join(f"the system {m} needs {NEEDS[m][1]}" for m in missing) + " (or leave it out of --systems)"
            )
        object.__setattr__(self, "systems", tuple(systems))
        if self.cross_draft is not None and not Path(self.cross_draft).exists():
            raise ValueError(f"the other-tokenizer draft {self.cross_draft!r} is neither a GGUF file nor a directory")
        if self.head is not None and not (Path(self.head) / "head.json").is_file():
            raise ValueError(f"--head must be an EAGLE head's directory (with head.json), got {self.head!r}")
        for what, path in (("target", self.model), ("draft", self.draft)):
            if path is not None and not (str(path).endswith(".gguf") and Path(path).is_file()):
                raise ValueError(
                    f"the {what} for --llama-cpp must be a GGUF file (llama.cpp reads no other), got {str(path)!r}"
                )
        unknown = set(self.prompt_sets) - set(prompt_sets())
        if not self.prompt_sets or unknown:
            raise ValueError(f"prompt sets must be among {sorted(prompt_sets())}, got {self.prompt_sets!r}")
        for name in ("prompts_per_set", "max_tokens", "k", "max_prompt_chars", "bench_repetitions", "step_repeats"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1 or None, got {self.threads!r}")

    def _check_adaptation(self) -> None:
        if type(self.adapt_requests) is not int or self.adapt_requests < 0:
            raise ValueError(f"--adapt must be an integer >= 0, got {self.adapt_requests!r}")
        if not (isinstance(self.adapt_minutes, int | float) and 0 < self.adapt_minutes < math.inf):
            raise ValueError(f"--adapt-minutes must be above 0, got {self.adapt_minutes!r}")
        if not self.adapt_requests:
            return
        if self.adapt_requests < 2:
            raise ValueError(f"--adapt needs 2 requests or more (adapt holds out a quarter), got {self.adapt_requests}")
        if len(self.prompt_sets) != 1:
            raise ValueError(
                f"--adapt records and measures one job: give one prompt set (--prompt-sets batch), got "
                f"{','.join(self.prompt_sets)}"
            )
        if self.head is None:
            raise ValueError("--adapt adapts an EAGLE-3 head: give the one in use with --head")


# -- measuring -------------------------------------------------------------------------------


def run_comparison(config: LlamaCppConfig, cpu_kinds: tuple[str, ...], say: Say) -> dict:
    """Every CPU kind's measurement (this process's kind here, another in a child process),
    JSON-ready: {"prompt_sets", "config", "cpu_kinds": [one per kind]}."""
    measured = []
    for kind in cpu_kinds:
        measured.append(measure(config, say) if kind == process_cpu_kind() else measure_in_child(config, kind, say))
    return {
        "prompt_sets": {name: measured[0]["prompt_sets"][name] for name in config.prompt_sets},
        "config": asdict(config),
        "cpu_kinds": measured,
    }


def process_cpu_kind() -> str:
    """ "avx2" where this process holds PyTorch to AVX2, else "native"."""
    return "avx2" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "native"


def cpu_kind_env(kind: str) -> dict[str, str]:
    """The environment of a process measuring kind: held to AVX2 or not."""
    env = {name: value for name, value in os.environ.items() if name not in AVX2_ENV}
    return {**env, **AVX2_ENV} if kind == "avx2" else env


def measure_in_child(config: LlamaCppConfig, kind: str, say: Say) -> dict:
    """measure() in a fresh Python for the CPU kind (PyTorch reads ATEN_CPU_CAPABILITY at start)."""
    say(f"measuring again with the CPU kind {kind!r}, in a child process")
    with tempfile.TemporaryDirectory(prefix="specdec-llama-cpp-") as scratch:
        config_file, out_file = Path(scratch) / "config.json", Path(scratch) / "result.json"
        config_file.write_text(json.dumps(asdict(config)))
        command = [
            sys.executable,
            "-m",
            "specdec.tools.benchmark.llama_cpp",
            "measure",
            str(config_file),
            str(out_file),
        ]
        if subprocess.run(command, env=cpu_kind_env(kind)).returncode != 0 or not out_file.is_file():
            raise LlamaCppError(f"the measurement for the CPU kind {kind!r} failed (its messages are above)")
        return json.loads(out_file.read_text())


def measure(config: LlamaCppConfig, say: Say) -> dict:
    """This process's CPU kind: build llama.cpp for it, load specdec's target (and draft), then
    every system on every prompt, interleaved, and the verify costs."""
    import torch

    from specdec.tools.benchmark.goals import evaluate_llama_cpp_goals
    from specdec.tools.benchmark.machine import describe_machine

    build = ensure_built(LlamaCppBuild(process_cpu_kind()), say)
    setting = config.setting
    options = ToolOptions(
        config.threads or torch.get_num_threads(),
        config.max_tokens,
        config.k,
        seed=config.seed,
        temperature=setting.temperature,
        top_p=setting.top_p,
    )
    others = [path for path in (config.draft, config.cross_draft, config.head) if path is not None]
    say(f"loading {config.model}" + "".join(f", {path}" for path in others) + " into specdec")
    target, specdec = load_specdec(config)
    jobs = {name: job_prompts(target, config, name) for name in config.prompt_sets}
    prompts = {name: measured for name, (_, measured) in jobs.items()}
    adaptation = None
    if config.adapt_requests:
        ((recorded, _),) = jobs.values()
        adapted, adaptation = adapted_runners(target, config, recorded, say)
        specdec.update(adapted)
    runners = {**llama_cpp_runners(build, config, options), **specdec}
    say("warming up specdec")
    warm_up(specdec, max((ids for pairs in prompts.values() for _, ids, _ in pairs), key=len), config)
    load_before = os.getloadavg()[0]
    records = interleave(runners, prompts, say, config.seed)
    load_after = os.getloadavg()[0]
    rows = summarize(records, list(runners), config.k, config.prompt_sets, compare_texts=setting.temperature == 0)
    say("measuring what a verify forward costs (llama-bench, and specdec's runner)")
    llama_bench = parse_llama_bench(
        run_tool(bench_command(build, config.model, options.threads, config.bench_repetitions))[0]
    )
    return {
        "cpu_kind": process_cpu_kind(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "sampling": asdict(setting),
        "machine": describe_machine("cpu"),
        "threads": options.threads,
        "load_average": {"before": load_before, "after": load_after},  # other work on the machine
        "llama_cpp": {
            "commit": llama_bench["commit"],
            "sdist": SDIST,
            "flags": list(build.flags),
            "system_info": parse_system_info(runners[LLAMA_PLAIN].last_stderr),
        },
        "prompt_sets": {
            name: {"title": prompt_sets()[name][0], "prompts": [p.name for p, _, _ in pairs]}
            for name, pairs in prompts.items()
        },
        "verify_cost": {"llama.cpp": llama_bench, "specdec": specdec_verify_cost(target, config)},
        "rows": rows,
        "goals": evaluate_llama_cpp_goals(rows, setting.name),
        "adaptation": adaptation,
        "notes": list(config.skipped) + prompt_token_notes(records, prompts),
        "runs": runs_json(records, prompts),
    }


def load_specdec(config: LlamaCppConfig):
    """specdec's target, and a runner per specdec system of config.systems, each drafter built as
    LLM builds it by default (speculative_config, the drafters' registry), over one target loaded
    once; lookup_then_draft and the staged drafter share the draft model's weights (and runner:
    the systems run one generate at a time, each preparing its own)."""
    from specdec.config import NGRAM_STAGE, NO_SPECULATION
    from specdec.drafters import CrossTokenizerDrafter, DraftModelDrafter, LookupThenDraftDrafter
    from specdec.llm import LLM
    from specdec.spec.staged import StagedDrafter

    target = LLM(config.model, speculative_method=NO_SPECULATION)
    runners = {SPECDEC_PLAIN: SpecdecRunner(target, config.max_tokens, config.setting)}
    wanted = set(config.systems or ())
    if "auto" in wanted:
        runners[System("specdec", "auto")] = auto_runner(target, config)

    def drafter_for(model, method: str | None):
        return speculative_drafter(target, config, model, method)

    def add(method: str, drafter, k_policy: str) -> None:
        runners[System("specdec", method)] = SpecdecRunner(
            target.with_drafter(drafter, config.k, k_policy), config.max_tokens, config.setting
        )

    if "ngram" in wanted:
        spec, ngram = drafter_for(None, "ngram")
        add("ngram", ngram, spec.k_policy)
    if wanted & set(DRAFTING):
        spec, drafter = drafter_for(config.draft, "draft_model")
        if not isinstance(drafter, DraftModelDrafter):
            raise ValueError(
                f"--draft {config.draft} has another tokenizer than the target's; the draft model's rows need "
                "one that shares it (a draft of another tokenizer goes in --cross-tokenizer-draft)"
            )
        if "draft_model" in wanted:
            add("draft_model", drafter, spec.k_policy)
        if "lookup_then_draft" in wanted:
            add("lookup_then_draft", LookupThenDraftDrafter.sharing_weights(drafter), spec.k_policy)
        if "staged" in wanted:  # as speculative_model=["[ngram]", draft]: prompt lookup drafting for the draft
            _, inner = drafter_for(None, "ngram")
            stages = (NGRAM_STAGE, str(config.draft))
            add("staged", StagedDrafter(drafter, inner, config.k, spec.k_policy, stages), spec.k_policy)
    if "cross_tokenizer" in wanted:
        spec, drafter = drafter_for(config.cross_draft, None)
        if not isinstance(drafter, CrossTokenizerDrafter):
            raise ValueError(
                f"the other-tokenizer draft {config.cross_draft} shares the target's tokenizer: give one of another "
                "tokenizer (--cross-tokenizer-draft), or leave cross_tokenizer out of --systems"
            )
        add("cross_tokenizer", drafter, spec.k_policy)
    if "eagle" in wanted:
        spec, drafter = drafter_for(config.head, None)
        assert spec.method == "eagle"  # LlamaCppConfig checked that it is a head's directory
        add("eagle", drafter, spec.k_policy)
    # adapted_eagle, adapted_auto: added by measure once the head is adapted (adapted_runners)
    if "lookup_then_eagle" in wanted:  # a head of its own: its cache and waiting features are per drafter
        spec, drafter = drafter_for(config.head, "lookup_then_draft")
        add("lookup_then_eagle", drafter, spec.k_policy)
    if "suffix" in wanted:  # its shared tree fills as the prompts are sent, one after another
        spec, drafter = drafter_for(None, "suffix")
        add("suffix", drafter, spec.k_policy)
    if "suffix_then_eagle" in wanted:
        spec, drafter = drafter_for(config.head, "suffix_then_draft")
        add("suffix_then_eagle", drafter, spec.k_policy)
    return target, runners


def speculative_drafter(target, config: LlamaCppConfig, model, method: str | None):
    """(SpeculativeConfig, drafter) as LLM builds them for model and method, at config.k, over
    target's loaded model."""
    from specdec.llm import ALL_DRAFTERS, speculative_config

    spec = speculative_config(model, method, num_speculative_tokens=config.k)
    assert spec is not None  # a method or a model given: a config
    return spec, ALL_DRAFTERS[spec.method](spec, target.target, target.runner)


def auto_runner(target, config: LlamaCppConfig, head: Path | None = None) -> SpecdecRunner:
    """What LLM(model) runs: every setting at its default, --k included (drafters/auto.py); head:
    the same with this EAGLE head in place of the shipped one (the adaptation row's adapted_auto)."""
    from specdec.config import SpeculativeConfig
    from specdec.drafters import auto
    from specdec.llm import ALL_DRAFTERS
    from specdec.models.eagle import is_head_directory

    if head is None:
        choice, drafter = auto.build(SpeculativeConfig(), target.target, target.runner, ALL_DRAFTERS)
        spec = choice.config
        print(f"specdec default: {choice.drafters}; {choice.reason}", file=sys.stderr)
    else:
        spec = auto.choose_drafters(SpeculativeConfig(), target.target.path).config
        if not is_head_directory(spec.model):
            raise ValueError(
                f"the default for {config.model} drafts with no EAGLE head: adapted_auto has none to replace"
            )
        spec = replace(spec, model=str(head))
        drafter = ALL_DRAFTERS[spec.method](spec, target.target, target.runner)
    return SpecdecRunner(
        target.with_drafter(drafter, spec.num_speculative_tokens, spec.k_policy, spec.tree),
        config.max_tokens,
        config.setting,
    )


def adapted_runners(
    target, config: LlamaCppConfig, recorded: list[tuple], say: Say
) -> tuple[dict[System, SpecdecRunner], dict]:
    """The adaptation row's runners (adaptation.py): recorded served by the default and recorded,
    config.head adapted on them; then the adapted head drafting alone as the eagle row's does
    (adapted_eagle), and, where asked, the default with it in place of the shipped head
    (adapted_auto); and what the adaptation recorded and measured."""
    from specdec.tools.benchmark.adaptation import record_and_adapt

    assert config.head is not None  # LlamaCppConfig checks it with adapt_requests
    with tempfile.TemporaryDirectory(prefix="specdec-adapt-") as scratch:
        recording = auto_runner(target, config)
        head, adaptation = record_and_adapt(
            config.model, config.head, recording, recorded, config.adapt_minutes, Path(scratch), say, config.seed
        )
        if head is None:
            raise LlamaCppError(f"specdec adapt wrote no head in {config.adapt_minutes:g} minutes")
        spec, drafter = speculative_drafter(target, config, str(head), None)
        assert spec.method == "eagle"
        llm = target.with_drafter(drafter, config.k, spec.k_policy)
        runners = {System("specdec", "adapted_eagle"): SpecdecRunner(llm, config.max_tokens, config.setting)}
        if "adapted_auto" in (config.systems or ()):
            runners[System("specdec", "adapted_auto")] = auto_runner(target, config, head)
    return runners, adaptation


class SpecdecRunner:
    """One generate of prompt token ids as setting samples (a SamplingSetting), timed, with its
    prefill's share, its rounds' counts (SpecStats) and where their time went (Engine.timings)."""

    def __init__(self, llm, max_tokens: int, setting):
        self.llm, self.max_tokens, self.setting = llm, max_tokens, setting

    def params(self, seed: int, max_tokens: int | None = None):
        """Greedy, or sampled with seed (the setting's params; nothing changes until a call)."""
        return self.setting.params(max_tokens or self.max_tokens, seed)

    def warm_up(self, ids: list[int], seed: int) -> None:
        """LLM.warm_up on ids, sent as a timed call sends them."""
        self.llm.warm_up(ids, self._as_sent(self.params(seed)))

    def __call__(self, ids: list[int], text: str, seed: int = 0) -> Timed:
        return self._timed(ids, self.params(seed))

    def _as_sent(self, params):
        """params as users send them: a sampled request unseeded, its seed seeding the shared
        stream now (run.on_the_shared_stream: goodput chooses k, as without a seed of their own)."""
        from specdec.tools.benchmark.run import on_the_shared_stream

        return on_the_shared_stream(self.llm, params)

    def _timed(self, ids: list[int], params) -> Timed:
        params = self._as_sent(params)
        start = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": ids}, params)[0]
        seconds = time.perf_counter() - start
        timings, stats = self.llm.engine.timings, output.metrics
        prefill, tokens = timings["prefill"], len(output.outputs[0].token_ids)
        return Timed(
            len(ids),
            tokens,
            prefill,
            seconds - prefill,
            tokens - 1,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            output.outputs[0].text,
            judged=stats.num_judged_tokens,
            proposed_by_position=tuple(stats.proposed_by_position),
            accepted_by_position=tuple(stats.accepted_by_position),
            rounds_by_k=tuple(stats.rounds_by_k),
            draft_seconds=timings["draft"],
            target_seconds=timings["target"],
            rounds=stats.num_target_forwards - 1,  # the prefill's forward is not a round
            inner=inner_counts(self.llm.engine.drafter),
        )


def inner_counts(drafter) -> dict | None:
    """A staged drafter's inner rounds since its last reserve (one generate): INNER_COUNTS."""
    from specdec.spec.staged import StagedDrafter

    if not isinstance(drafter, StagedDrafter):
        return None
    s = drafter.stats
    counts = (s.num_draft_tokens, s.num_judged_tokens, s.num_accepted_tokens, s.num_emitted_tokens)
    return dict(zip(INNER_COUNTS, (*counts, s.num_target_forwards)))


class ToolRunner:
    """A llama.cpp tool on the prompt's text (the tokens come from its own tokenizer)."""

    def __init__(self, build: LlamaCppBuild, system: System, config: LlamaCppConfig, options: ToolOptions):
        self.build, self.system, self.config, self.options = build, system, config, options
        self.last_stderr = ""

    def command(self, text: str, seed: int = 0) -> list[str]:
        options = replace(self.options, seed=seed)
        if self.system.method == "plain":
            return completion_command(self.build, self.config.model, text, options)
        if self.system.method == "ngram":
            return lookup_command(self.build, self.config.model, text, options)
        return speculative_command(self.build, self.config.model, self.config.draft, text, options)

    def __call__(self, ids: list[int], text: str, seed: int = 0) -> Timed:
        stdout, self.last_stderr = run_tool(self.command(text, seed))
        if self.system.method == "plain":
            return parse_completion(stdout, self.last_stderr)
        return parse_speculative(stdout, self.last_stderr, text)


def llama_cpp_runners(build: LlamaCppBuild, config: LlamaCppConfig, options: ToolOptions) -> dict:
    return {
        system: ToolRunner(build, system, config, options)
        for system in LLAMA_SYSTEMS
        if system.method in (config.systems or ())
    }


def job_prompts(target, config: LlamaCppConfig, set_name: str) -> tuple[list[tuple], list[tuple]]:
    """(recorded, measured): (prompt, token ids, text) for adapt_requests + prompts_per_set prompts
    of the set spread through it, in its order: the first adapt_requests recorded for adapting,
    the rest measured."""
    from specdec.tools.benchmark.run import spread

    everything = prompt_sets()[set_name][1](per_module=2, max_chars=config.max_prompt_chars)
    chosen = encode_prompts(target, spread(everything, config.adapt_requests + config.prompts_per_set), set_name)
    if config.adapt_requests and len(chosen) <= config.adapt_requests:
        raise ValueError(
            f"the {set_name} prompts number {len(chosen)}: too few for {config.adapt_requests} recorded and "
            "some measured after them; lower --adapt"
        )
    return chosen[: config.adapt_requests], chosen[config.adapt_requests :]


def encode_prompts(target, prompts: list, set_name: str) -> list[tuple]:
    """(prompt, token ids, text) for each prompt of the set; a chat prompt's text is rendered with
    the target's chat template, the text llama.cpp gets."""
    if not prompts:
        raise ValueError(f"prompt set {set_name!r} is empty: the held-out standard-library modules are missing")
    encoded = []
    for prompt in prompts:
        if prompt.chat:
            text = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], True)
            encoded.append((prompt, target.tokenizer.encode(text, add_special_tokens=False), text))
        else:
            encoded.append((prompt, target.tokenizer.encode(prompt.text), prompt.text))
    return encoded


def warm_up(runners: dict, ids: list[int], config: LlamaCppConfig) -> None:
    """Each specdec system pays its first calls' costs (allocating for the longest prompt, ids;
    goodput's calibration) untimed, with LLM.warm_up. (Each llama.cpp tool warms up by itself.)"""
    for runner in runners.values():
        runner.warm_up(ids, config.seed)
        forget = getattr(runner.llm.engine.drafter, "forget", None)
        if forget is not None:  # suffix decoding: the warm-up's answer would draft a measured prompt
            forget()


@dataclass(frozen=True)
class Record:
    prompt_set: str
    index: int  # the prompt's place in its set
    system: System
    timed: Timed


def interleave(runners: dict, prompts: dict, say: Say, seed: int = 0) -> list[Record]:
    """Every system on every prompt, the order rotated from prompt to prompt; prompt i of a set
    seeded seed + i (a sampled run's)."""
    systems, records = list(runners), []
    for set_name, pairs in prompts.items():
        for index, (prompt, ids, text) in enumerate(pairs):
            say(f"[{set_name} {index + 1}/{len(pairs)}] {prompt.name} ({len(ids)} prompt tokens)")
            shift = index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                records.append(Record(set_name, index, system, runners[system](ids, text, seed + index)))
    return records


def specdec_verify_cost(target, config: LlamaCppConfig) -> dict:
    """specdec's VERIFY_TOKENS-token forward ÷ its 1-token forward, after BENCH_DEPTH tokens of
    context (the median of three alternations)."""
    from specdec.tools.benchmark.machine import step_seconds

    steps, verifies = [], []
    for _ in range(3):
        steps.append(step_seconds(target.runner, config.step_repeats, BENCH_DEPTH, 1, config.max_tokens))
        verifies.append(step_seconds(target.runner, config.step_repeats, BENCH_DEPTH, VERIFY_TOKENS, config.max_tokens))
    step, verify = statistics.median(steps), statistics.median(verifies)
    return {
        "verify_tokens": VERIFY_TOKENS,
        "depth": BENCH_DEPTH,
        "verify_ms": verify * 1e3,
        "step_ms": step * 1e3,
        "verify_cost": verify / step,
    }


# -- summarizing -----------------------------------------------------------------------------


def summarize(
    records: list[Record], systems: list[System], k: int, set_names, compare_texts: bool = True
) -> list[dict]:
    """A row per (prompt set, system): tokens/s with the prefill, its ratio to llama.cpp plain
    and to specdec plain, the prompt and decode rates, acceptance, τ, how many outputs agree with
    specdec plain's (compare_texts: greedy runs; None otherwise); for specdec's rows α,
    acceptance by position and c as paid in the rounds."""
    rows = []
    for set_name in set_names:
        group = []
        plain_texts = {r.index: r.timed.text for r in records if (r.prompt_set, r.system) == (set_name, SPECDEC_PLAIN)}
        for system in systems:
            runs = [(r.index, r.timed) for r in records if (r.prompt_set, r.system) == (set_name, system)]
            row = {
                "prompt_set": set_name,
                "engine": system.engine,
                "method": system.method,
                "label": system.label(k),
                **pooled([t for _, t in runs]),
            }
            row["same_text_as_specdec_plain"] = (
                sum(_agree(t.text, plain_texts.get(i)) for i, t in runs) if compare_texts else None
            )
            group.append(row)
        baseline = next(row for row in group if row["engine"] == "llama.cpp" and row["method"] == "plain")
        ours = next((row for row in group if (row["engine"], row["method"]) == ("specdec", "plain")), None)
        plain_step = _per(ours["target_seconds"], ours["rounds"]) if ours else None  # seconds per target forward
        for row in group:
            row["ratio_to_llama_cpp_plain"] = row["tokens_per_s"] / baseline["tokens_per_s"]
            row["ratio_to_specdec_plain"] = row["tokens_per_s"] / ours["tokens_per_s"] if ours else None
            draft_step = _per(row["draft_seconds"], row["draft_steps"])  # seconds per draft token asked for
            row["cost_ratio_in_rounds"] = None
            if row["method"] != "plain" and draft_step is not None and plain_step:
                row["cost_ratio_in_rounds"] = draft_step / plain_step
        rows += group
    return rows


def _per(total: float | None, count: int | None) -> float | None:
    return total / count if total is not None and count else None


def pooled(runs: list[Timed]) -> dict:
    """Totals over runs: rates are total tokens ÷ total seconds; specdec's counts summed where
    every run has them (None otherwise: llama.cpp's runs)."""
    tokens, seconds = sum(t.tokens for t in runs), sum(t.seconds for t in runs)
    prompt_seconds, decode_seconds = sum(t.prompt_seconds for t in runs), sum(t.decode_seconds for t in runs)
    drafted, accepted = _total(runs, "drafted"), _total(runs, "accepted")
    judged, rounds_by_k = _total(runs, "judged"), _sum_lists(runs, "rounds_by_k")
    proposed_at, accepted_at = _sum_lists(runs, "proposed_by_position"), _sum_lists(runs, "accepted_by_position")
    inner = None
    if runs and all(t.inner is not None for t in runs):
        inner = {name: sum(t.inner[name] for t in runs) for name in INNER_COUNTS}  # pyright: ignore[reportOptionalSubscript]
    return {
        "prompts": len(runs),
        "tokens": tokens,
        "seconds": seconds,
        "prompt_tokens": sum(t.prompt_tokens for t in runs),
        "tokens_per_s": tokens / seconds if seconds else math.nan,
        "prompt_tokens_per_s": sum(t.prompt_tokens for t in runs) / prompt_seconds if prompt_seconds else None,
        "decode_tokens_per_s": sum(t.decode_tokens for t in runs) / decode_seconds if decode_seconds else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted and accepted is not None else None,
        "tau": tokens / (tokens - accepted) if accepted is not None and tokens > accepted else None,
        "judged": judged,
        "alpha": accepted / judged if judged and accepted is not None else None,
        "acceptance_by_position": (
            [a / p if p else None for a, p in zip(accepted_at + [0] * len(proposed_at), proposed_at)]
            if proposed_at is not None and accepted_at is not None
            else None
        ),
        "rounds_by_k": rounds_by_k,
        "rounds": _total(runs, "rounds"),
        "draft_steps": sum(k * n for k, n in enumerate(rounds_by_k)) if rounds_by_k is not None else None,
        "draft_seconds": _total(runs, "draft_seconds"),
        "target_seconds": _total(runs, "target_seconds"),
        "inner": inner,
        "inner_alpha": inner["accepted"] / inner["judged"] if inner and inner["judged"] else None,
        "inner_tau": inner["emitted"] / inner["forwards"] if inner and inner["forwards"] else None,
    }


def _total(runs: list[Timed], name: str):
    """The sum of a count over runs, None where a run lacks it (or there are none)."""
    values = [getattr(t, name) for t in runs]
    return sum(values) if values and all(v is not None for v in values) else None


def _sum_lists(runs: list[Timed], name: str) -> list[int] | None:
    """Per-index sums of a count by position (or by k) over runs, as long as the longest."""
    lists = [getattr(t, name) for t in runs]
    if not lists or any(values is None for values in lists):
        return None
    total = [0] * max(map(len, lists))
    for values in lists:
        for i, n in enumerate(values):
            total[i] += n
    return total


def _agree(text: str | None, reference: str | None) -> bool:
    """Whether two greedy outputs agree as far as the shorter goes (a speculative tool may run a
    few tokens past the limit)."""
    if text is None or reference is None:
        return False
    text, reference = text.rstrip(), reference.rstrip()
    return text.startswith(reference) or reference.startswith(text)


def runs_json(records: list[Record], prompts: dict) -> list[dict]:
    """Every run's own numbers (the rows pool them), to look into one that stands out."""
    return [
        {
            "prompt_set": r.prompt_set,
            "prompt": prompts[r.prompt_set][r.index][0].name,
            "engine": r.system.engine,
            "method": r.system.method,
            **{k: v for k, v in asdict(r.timed).items() if k != "text"},
        }
        for r in records
    ]


def prompt_token_notes(records: list[Record], prompts: dict) -> list[str]:
    """A note for every llama.cpp run whose prompt token count differs from specdec's."""
    notes = []
    for r in records:
        prompt, ids, _ = prompts[r.prompt_set][r.index]
        if r.system.engine == "llama.cpp" and r.timed.prompt_tokens != len(ids):
            notes.append(
                f"llama.cpp {r.system.method} read {r.timed.prompt_tokens} prompt tokens for "
                f"{prompt.name} ({r.prompt_set}), specdec {len(ids)}."
            )
    return notes


# -- the command -----------------------------------------------------------------------------

QUICK_PROMPTS = 2  # --quick: prompts per set (new tokens stay at the goal's 128)
FULL_PROMPTS = 8
UNUSED_FLAGS = {  # `specdec bench` flags of the specdec-only bench: refused with --llama-cpp, not ignored
    "tree": None,
    "early_exit": None,
    "device": "cpu",
    "dtype": "auto",
    "draft_dtype": "auto",
    "compile": "auto",
    "quantization": "none",
    "draft_quantization": "none",
    "no_transformers": False,
}


def llama_cpp_config(args) -> LlamaCppConfig:
    """LlamaCppConfig from `specdec bench --llama-cpp`'s flags; the registry's Qwen pair by default."""
    from specdec.models.registry import resolve_model
    from specdec.tools.training.adapt import default_head

    given = [name for name, default in UNUSED_FLAGS.items() if getattr(args, name) != default]
    if given:
        raise ValueError(
            f"--llama-cpp runs every system as LLM does by default on a GGUF file; "
            f"{', '.join('--' + n.replace('_', '-') for n in given)} do not apply to it"
        )
    model = str(resolve_model(args.model or DEFAULT_TARGET, "the target"))
    drafts = [args.draft] if isinstance(args.draft, str) else list(args.draft or [])  # --draft appends
    if len(drafts) > 1:
        raise ValueError(
            "--llama-cpp takes one --draft: its staged row is prompt lookup drafting for it "
            "(speculative_model=['[ngram]', DRAFT])"
        )
    draft = drafts[0] if drafts else None if args.model is not None else DEFAULT_DRAFT
    cross_draft, skipped = args.cross_tokenizer_draft, []
    if cross_draft is None and (args.systems is None or "cross_tokenizer" in args.systems):
        cross_draft = default_cross_draft()
        if cross_draft is None and args.systems is None:
            skipped.append(
                f"No other-tokenizer draft row: {DEFAULT_CROSS_DRAFT} (SmolLM2-135M-Instruct) is not fetched "
                f"(`specdec fetch {DEFAULT_CROSS_DRAFT}`), and no --cross-tokenizer-draft was given."
            )
    if args.systems is None and draft is None:
        skipped.append(f"No --draft: no {', '.join(DRAFTING)} rows.")
    return LlamaCppConfig(
        model=model,
        draft=None if draft is None else str(resolve_model(draft, "the draft")),
        cross_draft=None if cross_draft is None else str(resolve_model(cross_draft, "the other-tokenizer draft")),
        head=str(default_head(args.model or DEFAULT_TARGET)) if args.adapt and args.head is None else args.head,
        systems=args.systems,
        skipped=tuple(skipped),
        prompt_sets=args.prompt_sets or (("batch",) if args.adapt else ("write", "edit")),
        prompts_per_set=_given_or(args.prompts, QUICK_PROMPTS if args.quick else FULL_PROMPTS),
        max_tokens=_given_or(args.max_tokens, 128),
        k=max(args.ks) if args.ks else 5,
        sampling="sampled" if args.sampled else "greedy",
        seed=args.seed,
        adapt_requests=args.adapt or 0,
        adapt_minutes=_given_or(args.adapt_minutes, 10.0),
    )


def default_cross_draft() -> str | None:
    """The registry's SmolLM2-135M-Instruct GGUF file (as fetched, quantized Q4_1), None where it
    is not fetched."""
    from specdec.models.registry import REGISTRY, model_file

    entry = REGISTRY[DEFAULT_CROSS_DRAFT]
    file = model_file(entry)
    return str(file) if file.is_file() and file.stat().st_size == entry.size else None


def _given_or(value, default):
    return default if value is None else value


def command_line(args) -> str:
    """The `specdec bench --llama-cpp` command that reproduces this run."""
    words = ["specdec", "bench", "--llama-cpp"]
    for flag in ("model", "draft", "cross_tokenizer_draft", "head", "prompts", "max_tokens", "out"):
        if getattr(args, flag) is not None:
            words += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    for flag in ("systems", "prompt_sets"):
        if getattr(args, flag):
            words += ["--" + flag.replace("_", "-"), ",".join(getattr(args, flag))]
    if args.ks:
        words += ["--ks", ",".join(map(str, args.ks))]
    for flag in ("adapt", "adapt_minutes"):
        if getattr(args, flag) is not None:
            words += ["--" + flag.replace("_", "-"), f"{getattr(args, flag):g}"]
    if args.quick:
        words.append("--quick")
    if args.sampled:
        words += ["--sampled"] + (["--seed", str(args.seed)] if args.seed else [])
    return " ".join(words + ["--cpu-kinds", cpu_kinds_arg(args)] + (["--write-docs"] if args.write_docs else []))


def cpu_kinds_arg(args) -> str:
    """--cpu-kinds as given, or the kind this process runs as (held to AVX2 by the environment or not)."""
    return args.cpu_kinds or process_cpu_kind()


def run_llama_cpp_bench(args) -> int:
    """specdec bench --llama-cpp: measure, write results.json and results.md under --out (and
    with --write-docs the docs' section), print the tables."""
    from specdec.output_dir import open_output_dir
    from specdec.tools.benchmark.report import (
        is_bench_output,
        llama_cpp_markdown,
        write_llama_cpp_docs,
        write_llama_cpp_report,
    )

    config = llama_cpp_config(args)
    kinds = CPU_KINDS if cpu_kinds_arg(args) == "both" else (cpu_kinds_arg(args),)
    inputs = {
        "--model": config.model,
        "--draft": config.draft,
        "--cross-tokenizer-draft": config.cross_draft,
        "--head": config.head,
    }
    with open_output_dir(
        args.out,
        "bench",
        inputs,
        args.force,
        is_bench_output,
        own_entries=("results.json", "results.md"),
        resumable=False,
    ) as output:
        output.clear_staging()
        results = run_comparison(config, kinds, lambda message: print(message, file=sys.stderr, flush=True))
        results["command"] = command_line(args)
        written = [output.final / path.name for path in write_llama_cpp_report(results, output.staging)]
        if args.write_docs:
            written.append(write_llama_cpp_docs(results, paths.DOCS))
        output.commit()
    print(llama_cpp_markdown(results))
    print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """python -m specdec.tools.benchmark.llama_cpp build [native|avx2|both]: build llama.cpp's tools;
    ... measure CONFIG.json OUT.json: a child process's measurement (run_comparison starts it)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specdec.tools.benchmark.llama_cpp")
    steps = parser.add_subparsers(dest="step", required=True)
    steps.add_parser("build").add_argument("kind", nargs="?", choices=(*CPU_KINDS, "both"), default="native")
    measuring = steps.add_parser("measure")
    measuring.add_argument("config")
    measuring.add_argument("out")
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.step == "build":
        for kind in CPU_KINDS if args.kind == "both" else (args.kind,):
            print(ensure_built(LlamaCppBuild(kind), say).build_dir / "bin")
        return 0
    config = LlamaCppConfig(**json.loads(Path(args.config).read_text()))
    Path(args.out).write_text(json.dumps(measure(config, say)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
