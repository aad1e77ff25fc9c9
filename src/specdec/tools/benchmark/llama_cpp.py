"""`specdec bench --llama-cpp`: specdec against llama.cpp on the same GGUF file, prompts and threads.

    specdec bench --llama-cpp [--model GGUF --draft GGUF] [--prompt-sets write,edit] [--prompts N]
                  [--max-tokens N] [--cpu-kinds native|avx2|both] [--out DIR] [--write-docs]

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
  specdec    plain, prompt lookup (ngram), the draft model and lookup_then_draft, as LLM runs them
             by default (quantization "auto": the file's own quantized weights; goodput k <= k)
Every system gets the same text: a chat prompt is rendered with the target's chat template by
specdec and handed to llama.cpp as raw text (-p, --no-escape, no template of its own), so both
tokenize the same text; the prompt token counts each reports are checked against each other. Same
threads (torch's), greedy (--temp 0 --top-k 1), at most max_tokens new tokens, both stopping at an
end-of-sequence token; tokens/s is the tokens each generated over its time, prefill included.
llama.cpp's times are its own: llama-completion's "prompt eval" + "eval" lines, the speculative
tools' "encoded" + "decoded" lines (which hold their drafting too), model loading left out, as
specdec's model is loaded once before the timed calls. Acceptance is llama.cpp's n_accept ÷
n_drafted, and specdec's accepted ÷ proposed draft tokens: the same measure; τ = tokens ÷ (tokens
− accepted), the tokens per target forward.

Also what a verify forward costs: llama-bench -p 7 -n 32 -d 64 (7 prompt tokens, and 32 generated,
after 64 of context), time of the 7-token forward ÷ time per generated token, beside specdec's
own: a 7-token forward ÷ a 1-token forward of its target (runner, after 64 tokens of context).

--cpu-kinds both measures twice: as the CPU is, then in a child process with PyTorch and oneDNN
held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) and llama.cpp's AVX2 build.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec import paths

Say = Callable[[str], None]

SDIST_VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={SDIST_VERSION}"
HOME = paths.BUILD / "llama-cpp"
TOOLS = ("llama-completion", "llama-bench", "llama-lookup", "llama-speculative-simple")
CPU_KINDS = ("native", "avx2")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
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
        return COMMON_FLAGS + CPU_FLAGS[self.kind]

    def tool(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    def is_built(self) -> bool:
        stamp = self.build_dir / STAMP
        return (
            all(self.tool(name).is_file() for name in TOOLS)
            and stamp.is_file()
            and stamp.read_text().split() == list(self.flags)
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
    """What every llama.cpp tool is given: threads, new tokens, draft tokens per round (k)."""

    threads: int
    max_tokens: int
    k: int
    context: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("threads", "max_tokens", "k", "context"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _generation_args(model: str | Path, prompt: str, options: ToolOptions) -> list[str]:
    """The prompt as raw text (no escapes processed: code holds backslashes), greedy."""
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
        "--temp",
        "0",
        "--top-k",
        "1",
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
    method: str  # "plain", "ngram" (prompt lookup), "draft_model" or "lookup_then_draft"

    def label(self, k: int) -> str:
        if self.engine == "llama.cpp":
            return {
                "plain": "llama.cpp plain (llama-completion)",
                "ngram": f"llama.cpp prompt lookup (llama-lookup, k={k})",
                "draft_model": f"llama.cpp draft model (llama-speculative-simple, k={k})",
            }[self.method]
        return {
            "plain": "specdec plain",
            "ngram": f"specdec prompt lookup (goodput k≤{k})",
            "draft_model": f"specdec draft model (goodput k≤{k})",
            "lookup_then_draft": f"specdec lookup, else draft (goodput k≤{k})",
        }[self.method]


LLAMA_PLAIN = System("llama.cpp", "plain")
SPECDEC_PLAIN = System("specdec", "plain")
LLAMA_SYSTEMS = (LLAMA_PLAIN, System("llama.cpp", "ngram"), System("llama.cpp", "draft_model"))
DRAFTING = ("draft_model", "lookup_then_draft")  # the systems that need a draft model


def prompt_sets() -> dict:
    """name -> (title, function(per_module, max_chars)): the bench's sets and "write"."""
    from specdec.tools.benchmark.prompts import held_out_chat_prompts
    from specdec.tools.benchmark.run import PROMPT_SETS

    def write(per_module: int = 2, max_chars: int = 1200):
        return held_out_chat_prompts(per_module, max_chars, kinds=("write",))

    return {"write": ('held-out "write a function" chat prompts', write), **PROMPT_SETS}


@dataclass(frozen=True)
class LlamaCppConfig:
    """What to compare. model / draft: GGUF files (draft None: no draft-model rows); k: draft
    tokens per round (llama.cpp's --spec-draft-n-max; specdec's most, by goodput); threads:
    None = torch's."""

    model: str
    draft: str | None = None
    prompt_sets: tuple[str, ...] = ("write", "edit")
    prompts_per_set: int = 8
    max_tokens: int = 128
    k: int = 5
    threads: int | None = None
    max_prompt_chars: int = 1200
    bench_repetitions: int = 5
    step_repeats: int = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_sets", tuple(self.prompt_sets))
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

    from specdec.tools.benchmark.machine import describe_machine

    build = ensure_built(LlamaCppBuild(process_cpu_kind()), say)
    options = ToolOptions(config.threads or torch.get_num_threads(), config.max_tokens, config.k)
    say(f"loading {config.model}" + (f" and {config.draft}" if config.draft else "") + " into specdec")
    target, specdec = load_specdec(config)
    prompts = {name: encode_prompts(target, config, name) for name in config.prompt_sets}
    runners = {**llama_cpp_runners(build, config, options), **specdec}
    say("warming up specdec")
    warm_up(specdec, max((ids for pairs in prompts.values() for _, ids, _ in pairs), key=len), config)
    load_before = os.getloadavg()[0]
    records = interleave(runners, prompts, say)
    load_after = os.getloadavg()[0]
    say("measuring what a verify forward costs (llama-bench, and specdec's runner)")
    llama_bench = parse_llama_bench(
        run_tool(bench_command(build, config.model, options.threads, config.bench_repetitions))[0]
    )
    return {
        "cpu_kind": process_cpu_kind(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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
        "rows": summarize(records, list(runners), config.k, config.prompt_sets),
        "notes": prompt_token_notes(records, prompts),
        "runs": runs_json(records, prompts),
    }


def load_specdec(config: LlamaCppConfig):
    """specdec's target, and a runner per specdec system, as LLM builds them by default (one
    target loaded once; lookup_then_draft shares the draft model's weights)."""
    from specdec.drafters import DRAFTERS, LookupThenDraftDrafter
    from specdec.llm import LLM, speculative_config

    target = LLM(config.model)
    runners = {SPECDEC_PLAIN: SpecdecRunner(target, config.max_tokens)}
    ngram_spec = speculative_config(None, "ngram", num_speculative_tokens=config.k)
    assert ngram_spec is not None  # a method given: a config
    ngram = DRAFTERS["ngram"](ngram_spec, target.target, target.runner)
    runners[System("specdec", "ngram")] = SpecdecRunner(
        target.with_drafter(ngram, config.k, ngram_spec.k_policy), config.max_tokens
    )
    if config.draft is not None:
        spec = speculative_config(config.draft, "draft_model", num_speculative_tokens=config.k)
        assert spec is not None  # a method given: a config
        drafter = DRAFTERS["draft_model"](spec, target.target, target.runner)
        runners[System("specdec", "draft_model")] = SpecdecRunner(
            target.with_drafter(drafter, config.k, spec.k_policy), config.max_tokens
        )
        hybrid = LookupThenDraftDrafter.sharing_weights(drafter)
        runners[System("specdec", "lookup_then_draft")] = SpecdecRunner(
            target.with_drafter(hybrid, config.k, spec.k_policy), config.max_tokens
        )
    return target, runners


class SpecdecRunner:
    """One greedy generate of prompt token ids, timed, with its prefill's share."""

    def __init__(self, llm, max_tokens: int):
        self.llm, self.max_tokens = llm, max_tokens

    def __call__(self, ids: list[int], text: str, max_tokens: int | None = None) -> Timed:
        from specdec.config import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens or self.max_tokens)
        start = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": ids}, params)[0]
        seconds = time.perf_counter() - start
        prefill, stats, tokens = self.llm.engine.timings["prefill"], output.metrics, len(output.outputs[0].token_ids)
        return Timed(
            len(ids),
            tokens,
            prefill,
            seconds - prefill,
            tokens - 1,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            output.outputs[0].text,
        )


class ToolRunner:
    """A llama.cpp tool on the prompt's text (the tokens come from its own tokenizer)."""

    def __init__(self, build: LlamaCppBuild, system: System, config: LlamaCppConfig, options: ToolOptions):
        self.build, self.system, self.config, self.options = build, system, config, options
        self.last_stderr = ""

    def command(self, text: str) -> list[str]:
        if self.system.method == "plain":
            return completion_command(self.build, self.config.model, text, self.options)
        if self.system.method == "ngram":
            return lookup_command(self.build, self.config.model, text, self.options)
        return speculative_command(self.build, self.config.model, self.config.draft, text, self.options)

    def __call__(self, ids: list[int], text: str) -> Timed:
        stdout, self.last_stderr = run_tool(self.command(text))
        if self.system.method == "plain":
            return parse_completion(stdout, self.last_stderr)
        return parse_speculative(stdout, self.last_stderr, text)


def llama_cpp_runners(build: LlamaCppBuild, config: LlamaCppConfig, options: ToolOptions) -> dict:
    return {
        system: ToolRunner(build, system, config, options)
        for system in LLAMA_SYSTEMS
        if config.draft is not None or system.method not in DRAFTING
    }


def encode_prompts(target, config: LlamaCppConfig, set_name: str) -> list[tuple]:
    """(prompt, token ids, text) for prompts_per_set prompts of the set; a chat prompt's text is
    rendered with the target's chat template, the text llama.cpp gets."""
    from specdec.tools.benchmark.run import spread

    prompts = spread(
        prompt_sets()[set_name][1](per_module=2, max_chars=config.max_prompt_chars), config.prompts_per_set
    )
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
    from specdec.config import SamplingParams

    for runner in runners.values():
        runner.llm.warm_up(ids, SamplingParams(temperature=0, max_tokens=config.max_tokens))


@dataclass(frozen=True)
class Record:
    prompt_set: str
    index: int  # the prompt's place in its set
    system: System
    timed: Timed


def interleave(runners: dict, prompts: dict, say: Say) -> list[Record]:
    """Every system on every prompt, the order rotated from prompt to prompt."""
    systems, records = list(runners), []
    for set_name, pairs in prompts.items():
        for index, (prompt, ids, text) in enumerate(pairs):
            say(f"[{set_name} {index + 1}/{len(pairs)}] {prompt.name} ({len(ids)} prompt tokens)")
            shift = index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                records.append(Record(set_name, index, system, runners[system](ids, text)))
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


def summarize(records: list[Record], systems: list[System], k: int, set_names) -> list[dict]:
    """A row per (prompt set, system): tokens/s with the prefill, its ratio to llama.cpp plain,
    the prompt and decode rates, acceptance, τ, and how many outputs agree with specdec plain's."""
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
            row["same_text_as_specdec_plain"] = sum(_agree(t.text, plain_texts.get(i)) for i, t in runs)
            group.append(row)
        baseline = next(row for row in group if row["engine"] == "llama.cpp" and row["method"] == "plain")
        for row in group:
            row["ratio_to_llama_cpp_plain"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        rows += group
    return rows


def pooled(runs: list[Timed]) -> dict:
    """Totals over runs: rates are total tokens ÷ total seconds."""
    tokens, seconds = sum(t.tokens for t in runs), sum(t.seconds for t in runs)
    prompt_seconds, decode_seconds = sum(t.prompt_seconds for t in runs), sum(t.decode_seconds for t in runs)
    # summed where every run counted them (pyright does not follow the all() check)
    drafted = sum(t.drafted for t in runs) if all(t.drafted is not None for t in runs) else None  # pyright: ignore[reportCallIssue, reportArgumentType]
    accepted = sum(t.accepted for t in runs) if drafted is not None else None  # pyright: ignore[reportCallIssue, reportArgumentType]
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
        "acceptance": accepted / drafted if drafted else None,
        "tau": tokens / (tokens - accepted) if accepted is not None and tokens > accepted else None,
    }


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
    "head": None,
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

    given = [name for name, default in UNUSED_FLAGS.items() if getattr(args, name) != default]
    if given:
        raise ValueError(
            f"--llama-cpp runs every system as LLM does by default on a GGUF file; "
            f"{', '.join('--' + n.replace('_', '-') for n in given)} do not apply to it"
        )
    model = str(resolve_model(args.model or DEFAULT_TARGET, "the target"))
    draft = args.draft if args.draft is not None or args.model is not None else DEFAULT_DRAFT
    return LlamaCppConfig(
        model=model,
        draft=None if draft is None else str(resolve_model(draft, "the draft")),
        prompt_sets=args.prompt_sets or ("write", "edit"),
        prompts_per_set=_given_or(args.prompts, QUICK_PROMPTS if args.quick else FULL_PROMPTS),
        max_tokens=_given_or(args.max_tokens, 128),
        k=max(args.ks) if args.ks else 5,
    )


def _given_or(value, default):
    return default if value is None else value


def command_line(args) -> str:
    """The `specdec bench --llama-cpp` command that reproduces this run."""
    words = ["specdec", "bench", "--llama-cpp"]
    for flag in ("model", "draft", "prompts", "max_tokens", "out"):
        if getattr(args, flag) is not None:
            words += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.prompt_sets:
        words += ["--prompt-sets", ",".join(args.prompt_sets)]
    if args.ks:
        words += ["--ks", ",".join(map(str, args.ks))]
    if args.quick:
        words.append("--quick")
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
    inputs = {"--model": config.model, "--draft": config.draft}
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
