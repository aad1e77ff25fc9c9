"""`specdec bench --llama-cpp` (benchmark/llama_cpp.py): reading llama.cpp's own output (captured
from the real tools of the vendored llama.cpp), the command lines given to them, the build's
cache and errors, the summary, the report section, and, where the build and the Qwen GGUF files
are present, one real prompt end to end. Speed is printed by the bench, never asserted here."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from specdec.models import registry
from specdec.tools.benchmark import commands, llama_cpp
from specdec.tools.benchmark.llama_cpp import (
    AVX2_ENV,
    LLAMA_PLAIN,
    SPECDEC_PLAIN,
    LlamaCppBuild,
    LlamaCppConfig,
    LlamaCppError,
    Record,
    System,
    Timed,
    ToolOptions,
)
from specdec.tools.benchmark.report import (
    KEPT_MARKER,
    LLAMA_CPP_END,
    LLAMA_CPP_START,
    llama_cpp_markdown,
    write_llama_cpp_docs,
)

# -- real output, captured from the tools built from llama-cpp-python 0.3.36's vendored llama.cpp
# (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 2 threads, a busy machine: the times are slow), trimmed to
# the lines the bench reads and their neighbours.

PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nAdd a docstring to this function:\n\ndef add(a, b):\n    return a + b\n<|im_end|>\n"
    "<|im_start|>assistant\n"
)

COMPLETION_STDOUT = "```python\ndef add_numbers(a,\n\n"  # llama-completion -no-cnv --no-display-prompt -n 8
COMPLETION_STDERR = """\
0.04.975.209 I cmn          init: llama threadpool init, n_threads = 2
0.09.816.306 I 
0.09.824.756 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | 
0.09.824.777 I 
0.09.825.243 I sampler seed: 0
0.09.825.362 I generate: n_ctx = 2048, n_batch = 2048, n_predict = 8, n_keep = 0
0.09.825.379 I 
0.36.829.519 I common_perf_print:    sampling time =       1.86 ms
0.36.829.522 I common_perf_print:    samplers time =       0.69 ms /    46 tokens
0.36.829.529 I common_perf_print:        load time =    8930.01 ms
0.36.829.531 I common_perf_print: prompt eval time =    5471.47 ms /    38 tokens (  143.99 ms per token,     6.95 tokens per second)
0.36.829.532 I common_perf_print:        eval time =   21520.48 ms /     7 runs   ( 3074.35 ms per token,     0.33 tokens per second)
0.36.829.533 I common_perf_print:       total time =   27013.23 ms /    45 tokens
0.36.829.534 I common_perf_print: unaccounted time =      19.43 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
0.36.829.535 I common_perf_print:    graphs reused =          6
"""  # noqa: W291 (llama.cpp's own trailing spaces)

LOOKUP_STDOUT = "\n\n" + EDIT_PROMPT + '```python\ndef add(a, b):\n    """\n    Add two numbers a and\n\n\n\n'
LOOKUP_STDERR = """\
0.01.499.891 I cmn          init: llama threadpool init, n_threads = 2
0.12.131.739 I encoded   49 tokens in    3.478 seconds, speed:   18.974 t/s
0.12.131.740 I decoded   17 tokens in    3.925 seconds, speed:    4.331 t/s
0.12.131.740 I 
0.12.131.741 I n_draft      = 5
0.12.131.741 I n_predict    = 17
0.12.131.741 I n_drafted    = 5
0.12.131.741 I t_draft_flat = 0.05 ms
0.12.131.742 I t_draft      = 0.17 ms, 33.80 us per token, 29585.80 tokens per second
0.12.131.743 I n_accept     = 4
0.12.131.743 I accept       = 80.000%
0.12.131.743 I 
target:

0.12.131.748 I common_perf_print:    sampling time =       3.17 ms
0.12.131.754 I common_perf_print: prompt eval time =    3478.45 ms /    55 tokens (   63.24 ms per token,    15.81 tokens per second)
0.12.131.755 I common_perf_print:        eval time =    2638.45 ms /    11 runs   (  239.86 ms per token,     4.17 tokens per second)
"""  # noqa: W291

SPECULATIVE_STDOUT = "\n\n" + PROMPT + '```python\ndef add_numbers(a, b):\n    """\n   \n\n\n\n'
SPECULATIVE_STDERR = """\
0.04.495.624 I common_speculative_init_result: loading draft model '/root/.cache/specdec/models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf'
0.29.328.704 I encoded   38 tokens in    9.640 seconds, speed:    3.942 t/s
0.29.328.722 I decoded   13 tokens in    5.812 seconds, speed:    2.237 t/s
0.29.328.736 I 
0.29.328.749 I n_draft   = 5
0.29.328.763 I n_predict = 13
0.29.328.776 I n_drafted = 15
0.29.328.789 I n_accept  = 10
0.29.328.803 I accept    = 66.667%
0.29.328.816 I 
0.29.328.829 I draft:

0.29.328.883 I 
0.29.328.897 I target:

0.29.328.962 I common_perf_print: prompt eval time =   17952.66 ms /    57 tokens (  314.96 ms per token,     3.18 tokens per second)
0.29.328.976 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""  # noqa: W291

# llama-bench -p 7 -n 32 -d 64 -t 2 -r 2 -o json, its fields of note
LLAMA_BENCH_JSON = json.dumps(
    [
        {
            "build_commit": "0c1e570",
            "cpu_info": "AMD EPYC",
            "model_type": "qwen2 1.5B Q4_K - Medium",
            "n_threads": 2,
            "n_prompt": 7,
            "n_gen": 0,
            "n_depth": 64,
            "avg_ns": 2435457156,
            "stddev_ns": 2528515195,
            "avg_ts": 6.233899,
            "samples_ns": [4223387397, 647526916],
            "samples_ts": [1.65744, 10.8104],
        },
        {
            "build_commit": "0c1e570",
            "cpu_info": "AMD EPYC",
            "model_type": "qwen2 1.5B Q4_K - Medium",
            "n_threads": 2,
            "n_prompt": 0,
            "n_gen": 32,
            "n_depth": 64,
            "avg_ns": 6939245146,
            "stddev_ns": 2201219950,
            "avg_ts": 4.855756,
            "samples_ns": [5382747592, 8495742700],
            "samples_ts": [5.94492, 3.76659],
        },
    ],
    indent=2,
)


# -- reading llama.cpp's output ----------------------------------------------------------------


def test_completion_timings_tokens_and_text():
    timed = llama_cpp.parse_completion(COMPLETION_STDOUT, COMPLETION_STDERR)
    assert (timed.prompt_tokens, timed.tokens, timed.decode_tokens) == (38, 8, 7)  # the prefill gives the first
    assert timed.prompt_seconds == pytest.approx(5.47147) and timed.decode_seconds == pytest.approx(21.52048)
    assert timed.seconds == pytest.approx(5.47147 + 21.52048)
    assert (timed.drafted, timed.accepted) == (None, None)
    assert timed.text == "```python\ndef add_numbers(a,"


def test_completion_stopped_at_the_end_of_text_keeps_only_the_text():
    timed = llama_cpp.parse_completion("Done. [end of text]\n\n", COMPLETION_STDERR)
    assert timed.text == "Done."


def test_lookup_counts_drafts_and_acceptance():
    timed = llama_cpp.parse_speculative(LOOKUP_STDOUT, LOOKUP_STDERR, EDIT_PROMPT)
    assert (timed.prompt_tokens, timed.tokens, timed.decode_tokens) == (49, 17, 17)
    assert (timed.drafted, timed.accepted) == (5, 4)
    assert (timed.prompt_seconds, timed.decode_seconds) == (pytest.approx(3.478), pytest.approx(3.925))
    assert timed.text == '```python\ndef add(a, b):\n    """\n    Add two numbers a and'


def test_speculative_simple_counts_drafts_and_acceptance():
    timed = llama_cpp.parse_speculative(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, PROMPT)
    assert (timed.prompt_tokens, timed.tokens, timed.drafted, timed.accepted) == (38, 13, 15, 10)
    assert timed.seconds == pytest.approx(9.640 + 5.812)
    assert timed.text is not None and timed.text.startswith("```python\ndef add_numbers(a, b):")


def test_a_prompt_echoed_differently_gives_no_text_but_the_timings():
    timed = llama_cpp.parse_speculative(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, "another prompt")
    assert timed.text is None and timed.tokens == 13


def test_system_info_names_the_instruction_sets():
    info = llama_cpp.parse_system_info(COMPLETION_STDERR)
    assert info is not None and "AVX512 = 1" in info and info.startswith("n_threads = 2")
    assert llama_cpp.parse_system_info("nothing") is None


def test_llama_bench_verify_and_step_from_the_medians():
    cost = llama_cpp.parse_llama_bench(LLAMA_BENCH_JSON)
    verify_ms = (4223387397 + 647526916) / 2 / 1e6
    step_ms = (5382747592 + 8495742700) / 2 / 32 / 1e6
    assert cost["verify_ms"] == pytest.approx(verify_ms) and cost["step_ms"] == pytest.approx(step_ms)
    assert cost["verify_cost"] == pytest.approx(verify_ms / step_ms)
    assert (cost["verify_tokens"], cost["depth"], cost["commit"]) == (7, 64, "0c1e570")


@pytest.mark.parametrize(
    "parse, stderr, missing",
    [
        (
            lambda err: llama_cpp.parse_completion("", err),
            COMPLETION_STDERR.replace("prompt eval", "prompt"),
            "prompt eval time",
        ),
        (lambda err: llama_cpp.parse_completion("", err), "crashed\n", "prompt eval time"),
        (lambda err: llama_cpp.parse_speculative("", err, ""), LOOKUP_STDERR.replace("n_accept", "n_acc"), "n_accept"),
        (
            lambda err: llama_cpp.parse_speculative("", err, ""),
            SPECULATIVE_STDERR.replace("decoded", "done"),
            "decoded ... tokens",
        ),
    ],
)
def test_output_without_a_line_is_a_clear_error(parse, stderr, missing):
    with pytest.raises(LlamaCppError, match=f"no {missing!r} line"):
        parse(stderr)


def test_llama_bench_output_that_is_not_its_json_is_a_clear_error():
    with pytest.raises(LlamaCppError, match="llama-bench's output is not the JSON expected"):
        llama_cpp.parse_llama_bench("| model | size |")
    with pytest.raises(LlamaCppError, match="StopIteration"):
        llama_cpp.parse_llama_bench(json.dumps(json.loads(LLAMA_BENCH_JSON)[:1]))


def test_a_failing_tool_is_an_error_with_its_output(tmp_path):
    tool = tmp_path / "llama-completion"
    tool.write_text("#!/bin/sh\necho 'error: unknown argument: --bogus' >&2\nexit 1\n")
    tool.chmod(0o755)
    with pytest.raises(LlamaCppError, match="llama-completion failed .exit status 1.:\nerror: unknown argument"):
        llama_cpp.run_tool([str(tool), "--bogus"])


# -- command lines -------------------------------------------------------------------------------

OPTIONS = ToolOptions(threads=2, max_tokens=128, k=5)
SAMPLED_OPTIONS = ToolOptions(threads=2, max_tokens=128, k=5, temperature=0.8, top_p=0.95)
BUILD = LlamaCppBuild("native", Path("/llama"))


def _value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_every_tool_gets_the_text_verbatim_greedy_with_the_same_threads_and_tokens():
    text = 'print("a\\nb")\n'  # a backslash escape llama.cpp must not process
    commands_ = [
        llama_cpp.completion_command(BUILD, "t.gguf", text, OPTIONS),
        llama_cpp.lookup_command(BUILD, "t.gguf", text, OPTIONS),
        llama_cpp.speculative_command(BUILD, "t.gguf", "d.gguf", text, OPTIONS),
    ]
    for command in commands_:
        assert _value(command, "-p") == text and "--no-escape" in command
        assert (_value(command, "-m"), _value(command, "-n"), _value(command, "-t")) == ("t.gguf", "128", "2")
        assert (_value(command, "--temp"), _value(command, "--top-k")) == ("0", "1")
        assert "--ignore-eos" not in command  # both engines stop at an end-of-sequence token
    assert [Path(c[0]).name for c in commands_] == ["llama-completion", "llama-lookup", "llama-speculative-simple"]
    assert {"-no-cnv", "--no-display-prompt"} <= set(commands_[0])  # no chat template of llama.cpp's
    assert _value(commands_[1], "--spec-draft-n-max") == "5"
    speculative = commands_[2]
    assert (_value(speculative, "-md"), _value(speculative, "--spec-type")) == ("d.gguf", "draft-simple")
    assert (_value(speculative, "--spec-draft-n-max"), _value(speculative, "-td")) == ("5", "2")


def test_sampled_tools_get_the_temperature_and_top_p_with_llama_cpps_other_samplers_off(gguf_pair):
    """specdec's SamplingParams(temperature, top_p) has no top-k or min-p; llama.cpp's are on by
    default (40, 0.05), so a sampled comparison turns them off; each prompt gets its own seed."""
    for make in (
        lambda o: llama_cpp.completion_command(BUILD, "t.gguf", "p", o),
        lambda o: llama_cpp.lookup_command(BUILD, "t.gguf", "p", o),
        lambda o: llama_cpp.speculative_command(BUILD, "t.gguf", "d.gguf", "p", o),
    ):
        command = make(SAMPLED_OPTIONS)
        assert [_value(command, f) for f in ("--temp", "--top-p", "--top-k", "--min-p")] == ["0.8", "0.95", "0", "0"]
        assert "--top-p" not in make(OPTIONS) and "--min-p" not in make(OPTIONS)
    config = LlamaCppConfig(gguf_pair[0], sampling="sampled")
    runner = llama_cpp.ToolRunner(BUILD, System("llama.cpp", "plain"), config, SAMPLED_OPTIONS)
    assert [_value(runner.command("p", seed), "-s") for seed in (0, 7)] == ["0", "7"]
    with pytest.raises(ValueError, match="temperature must be >= 0 and top_p in"):
        ToolOptions(threads=2, max_tokens=8, k=5, top_p=0.0)


def test_llama_bench_times_a_verify_of_7_and_steps_after_64_tokens():
    command = llama_cpp.bench_command(BUILD, "t.gguf", threads=2, repetitions=3)
    assert command[0] == "/llama/build/bin/llama-bench"
    assert [_value(command, flag) for flag in ("-p", "-n", "-d", "-t", "-r", "-o")] == [
        "7",
        "32",
        "64",
        "2",
        "3",
        "json",
    ]


def test_the_flags_given_are_in_the_vendored_llama_cpp():
    arg_cpp = LlamaCppBuild().source / "common" / "arg.cpp"
    if not arg_cpp.is_file():
        pytest.skip(f"{arg_cpp} is absent: `specdec bench --llama-cpp` (or `make llama-cpp`) downloads it")
    source = arg_cpp.read_text()
    given = set()
    for command in (
        llama_cpp.completion_command(BUILD, "t", "p", OPTIONS),
        llama_cpp.speculative_command(BUILD, "t", "d", "p", OPTIONS),
        llama_cpp.completion_command(BUILD, "t", "p", SAMPLED_OPTIONS),
    ):
        given |= {word for word in command[1:] if word.startswith("-") and not word.lstrip("-").isdigit()}
    assert {f for f in given if f'"{f}"' not in source} == set()
    assert '{"draft-simple",' in (arg_cpp.parent / "speculative.cpp").read_text()


@pytest.mark.parametrize("changes", [dict(threads=0), dict(k=-1), dict(max_tokens=1.5)])
def test_bad_tool_options(changes):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ToolOptions(**{**dict(threads=2, max_tokens=8, k=5), **changes})


# -- building --------------------------------------------------------------------------------------


def test_the_avx2_build_has_no_avx512_and_its_own_directory(tmp_path):
    native, avx2 = LlamaCppBuild("native", tmp_path), LlamaCppBuild("avx2", tmp_path)
    assert "-DGGML_NATIVE=ON" in native.flags and "-DLLAMA_CURL=OFF" in native.flags
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF"} <= set(avx2.flags)
    assert native.build_dir != avx2.build_dir and native.source == avx2.source
    with pytest.raises(ValueError, match="CPU kind"):
        LlamaCppBuild("avx512", tmp_path)


def test_the_native_x86_build_leaves_amx_out_and_its_stamp_keeps_flags_with_spaces(tmp_path, monkeypatch):
    """The vendored AMX matmul dies with SIGILL (see NO_AMX); GCC's explicit -mno-amx-* flags
    take it out of -march=native. A flag holding spaces is one line of the stamp."""
    monkeypatch.setattr(llama_cpp.platform, "machine", lambda: "x86_64")
    native, avx2 = LlamaCppBuild("native", tmp_path), LlamaCppBuild("avx2", tmp_path)
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in native.flags
    assert not any("mno-amx" in flag for flag in avx2.flags)  # the AVX2 build has no AMX anyway
    (native.build_dir / "bin").mkdir(parents=True)
    for name in llama_cpp.TOOLS:
        native.tool(name).write_text("")
    (native.build_dir / llama_cpp.STAMP).write_text("\n".join(native.flags) + "\n")
    assert native.is_built()
    monkeypatch.setattr(llama_cpp.platform, "machine", lambda: "aarch64")
    assert not any("mno-amx" in flag for flag in LlamaCppBuild("native", tmp_path).flags)


def test_a_build_is_kept_while_its_tools_exist_with_the_same_flags(tmp_path):
    build = LlamaCppBuild("avx2", tmp_path)
    assert not build.is_built()
    (build.build_dir / "bin").mkdir(parents=True)
    for name in llama_cpp.TOOLS:
        build.tool(name).write_text("")
    assert not build.is_built()  # built by someone else's flags, or not by specdec: build again (incrementally)
    (build.build_dir / llama_cpp.STAMP).write_text("\n".join(build.flags) + "\n")
    assert build.is_built()
    assert not LlamaCppBuild("native", tmp_path).is_built()
    build.tool("llama-lookup").unlink()
    assert not build.is_built()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_failed_build_is_an_error_naming_its_cmake_log(tmp_path):
    build = LlamaCppBuild("native", tmp_path)
    build.source.mkdir(parents=True)
    (build.source / "CMakeLists.txt").write_text(
        'cmake_minimum_required(VERSION 3.14)\nproject(x NONE)\nmessage(FATAL_ERROR "no compiler here")\n'
    )
    messages = []
    with pytest.raises(LlamaCppError, match="configuring llama.cpp .native. failed") as error:
        llama_cpp.ensure_built(build, messages.append)
    log = build.build_dir / "cmake-configure.log"
    assert str(log) in str(error.value) and "no compiler here" in str(error.value)
    assert "no compiler here" in log.read_text()
    assert messages[0].startswith("building llama.cpp (native)")


def test_a_source_archive_without_llama_cpp_is_a_clear_error(tmp_path):
    import tarfile

    build = LlamaCppBuild("native", tmp_path)
    (tmp_path / "README").write_text("not llama.cpp")
    with tarfile.open(tmp_path / f"llama_cpp_python-{llama_cpp.SDIST_VERSION}.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "README", arcname=f"llama_cpp_python-{llama_cpp.SDIST_VERSION}/README")
    with pytest.raises(LlamaCppError, match="holds no vendor/llama.cpp/CMakeLists.txt; delete it"):
        llama_cpp.ensure_built(build, lambda message: None)


# -- CPU kinds ---------------------------------------------------------------------------------------


def test_a_child_for_avx2_is_held_to_avx2_and_one_for_native_is_not(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert llama_cpp.process_cpu_kind() == "avx2"
    native = llama_cpp.cpu_kind_env("native")
    assert not set(AVX2_ENV) & set(native) and native["PATH"]
    assert {name: llama_cpp.cpu_kind_env("avx2")[name] for name in AVX2_ENV} == AVX2_ENV
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert llama_cpp.process_cpu_kind() == "native"


# -- summarizing -------------------------------------------------------------------------------------


def _timed(tokens, seconds, drafted=None, accepted=None, text: str | None = "same", prompt_tokens=10):
    return Timed(prompt_tokens, tokens, seconds / 4, seconds * 3 / 4, tokens - 1, drafted, accepted, text)


def test_rows_pool_the_prompts_and_compare_with_llama_cpp_plain():
    draft = System("llama.cpp", "draft_model")
    records = [
        Record("edit", 0, LLAMA_PLAIN, _timed(100, 10.0)),
        Record("edit", 1, LLAMA_PLAIN, _timed(50, 10.0)),
        Record("edit", 0, SPECDEC_PLAIN, _timed(100, 5.0, 0, 0)),
        Record("edit", 1, SPECDEC_PLAIN, _timed(50, 5.0, 0, 0)),
        Record("edit", 0, draft, _timed(105, 5.0, 50, 40, text="same, and more")),
        Record("edit", 1, draft, _timed(50, 5.0, 20, 10, text="other")),
    ]
    rows = {
        r["method"] + " " + r["engine"]: r
        for r in llama_cpp.summarize(records, [LLAMA_PLAIN, draft, SPECDEC_PLAIN], 5, ("edit",))
    }
    plain, spec, ours = rows["plain llama.cpp"], rows["draft_model llama.cpp"], rows["plain specdec"]
    assert (plain["tokens"], plain["seconds"], plain["tokens_per_s"]) == (150, 20.0, 7.5)
    assert plain["ratio_to_llama_cpp_plain"] == 1.0 and ours["ratio_to_llama_cpp_plain"] == 2.0
    assert spec["tokens_per_s"] == pytest.approx(15.5) and spec["ratio_to_llama_cpp_plain"] == pytest.approx(15.5 / 7.5)
    assert spec["acceptance"] == pytest.approx(50 / 70) and spec["tau"] == pytest.approx(155 / (155 - 50))
    assert plain["acceptance"] is None and plain["tau"] is None and ours["tau"] == 1.0
    assert spec["prompt_tokens_per_s"] == pytest.approx(20 / 2.5) and spec["decode_tokens_per_s"] == pytest.approx(
        153 / 7.5
    )
    assert (spec["same_text_as_specdec_plain"], plain["same_text_as_specdec_plain"]) == (1, 2)
    assert spec["label"] == "llama.cpp draft model (llama-speculative-simple, k=5)"
    sampled = llama_cpp.summarize(records, [LLAMA_PLAIN, draft, SPECDEC_PLAIN], 5, ("edit",), compare_texts=False)
    assert all(r["same_text_as_specdec_plain"] is None for r in sampled)  # sampled texts are not compared


def test_a_prompt_token_count_that_differs_is_noted():
    from specdec.tools.benchmark.prompts import Prompt

    prompts = {"write": [(Prompt("m.py:f (write)", "x", chat=True), [1, 2, 3], "text")]}
    records = [
        Record("write", 0, LLAMA_PLAIN, _timed(8, 1.0, prompt_tokens=4)),
        Record("write", 0, SPECDEC_PLAIN, _timed(8, 1.0, prompt_tokens=3)),
        Record("write", 0, System("llama.cpp", "ngram"), _timed(8, 1.0, prompt_tokens=3)),
    ]
    assert llama_cpp.prompt_token_notes(records, prompts) == [
        "llama.cpp plain read 4 prompt tokens for m.py:f (write) (write), specdec 3."
    ]


def _specdec(tokens, seconds, drafted, accepted, judged, by_position, rounds_by_k, draft_s, target_s, inner=None):
    """A specdec run's Timed with its SpecStats counts (by_position: (proposed, accepted) lists)."""
    proposed_at, accepted_at = by_position
    rounds = sum(rounds_by_k)
    return Timed(
        10,
        tokens,
        seconds / 4,
        seconds * 3 / 4,
        tokens - 1,
        drafted,
        accepted,
        "same",
        judged=judged,
        proposed_by_position=tuple(proposed_at),
        accepted_by_position=tuple(accepted_at),
        rounds_by_k=tuple(rounds_by_k),
        draft_seconds=draft_s,
        target_seconds=target_s,
        rounds=rounds,
        inner=inner,
    )


def test_specdec_rows_give_alpha_acceptance_by_position_and_c_in_the_rounds():
    staged = System("specdec", "staged")
    inner = {"drafted": 9, "judged": 8, "accepted": 6, "emitted": 10, "forwards": 4}
    records = [
        Record("edit", 0, LLAMA_PLAIN, _timed(50, 10.0)),
        # specdec plain: 49 rounds (k = 0), 4.9 s of target forwards: 0.1 s a forward
        Record("edit", 0, SPECDEC_PLAIN, _specdec(50, 5.0, 0, 0, 0, ([], []), [49], 0.0, 4.9)),
        # two prompts: rounds at k 0 and 3 (Σ k = 3 * 8 + 3 * 2 = 30 draft tokens asked for, 0.6 s)
        Record("edit", 0, staged, _specdec(30, 2.0, 20, 15, 18, ([8, 6, 6], [7, 5, 3]), [2, 0, 0, 8], 0.4, 0.9, inner)),
        Record("edit", 1, staged, _specdec(20, 2.0, 6, 4, 5, ([2, 2, 2], [2, 1, 1]), [1, 0, 0, 2], 0.2, 0.3, inner)),
    ]
    rows = {
        r["engine"] + " " + r["method"]: r
        for r in llama_cpp.summarize(records, list(dict.fromkeys(r.system for r in records)), 3, ("edit",))
    }
    ours, plain = rows["specdec staged"], rows["specdec plain"]
    assert ours["tokens_per_s"] == 12.5 and ours["ratio_to_specdec_plain"] == pytest.approx(12.5 / 10)
    assert ours["ratio_to_llama_cpp_plain"] == pytest.approx(12.5 / 5) and plain["ratio_to_specdec_plain"] == 1.0
    assert ours["alpha"] == pytest.approx(19 / 23) and ours["acceptance"] == pytest.approx(19 / 26)
    assert ours["acceptance_by_position"] == pytest.approx([9 / 10, 6 / 8, 4 / 8])
    assert ours["rounds_by_k"] == [3, 0, 0, 10] and ours["draft_steps"] == 30
    assert ours["cost_ratio_in_rounds"] == pytest.approx((0.6 / 30) / (4.9 / 49))
    assert ours["inner_alpha"] == pytest.approx(12 / 16) and ours["inner_tau"] == pytest.approx(20 / 8)
    assert plain["cost_ratio_in_rounds"] is None and plain["alpha"] is None and plain["inner"] is None
    assert rows["llama.cpp plain"]["alpha"] is None and rows["llama.cpp plain"]["ratio_to_specdec_plain"] == 0.5


# -- the command and its report ------------------------------------------------------------------------


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="specdec")
    commands.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "--llama-cpp"] + argv)


@pytest.fixture
def gguf_pair(tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    return str(target), str(draft)


def test_without_cpu_kinds_the_bench_measures_the_kind_this_process_runs_as(monkeypatch, gguf_pair):
    """So that a run held to AVX2 by the environment (tools/both-cpus) measures AVX2, llama.cpp's
    AVX2 build included, and not the native kind in a child."""
    target, _ = gguf_pair
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert llama_cpp.cpu_kinds_arg(parse(["--model", target])) == "avx2"
    assert llama_cpp.command_line(parse(["--model", target])).endswith("--cpu-kinds avx2")
    assert llama_cpp.cpu_kinds_arg(parse(["--model", target, "--cpu-kinds", "both"])) == "both"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert llama_cpp.cpu_kinds_arg(parse(["--model", target])) == "native"


def test_flags_make_the_config(gguf_pair):
    target, draft = gguf_pair
    config = llama_cpp.llama_cpp_config(parse(["--model", target, "--draft", draft, "--quick", "--ks", "3,4"]))
    assert (config.model, config.draft, config.prompt_sets) == (target, draft, ("write", "edit"))
    assert (config.prompts_per_set, config.max_tokens, config.k) == (llama_cpp.QUICK_PROMPTS, 128, 4)
    config = llama_cpp.llama_cpp_config(
        parse(["--model", target, "--prompt-sets", "edit", "--prompts", "3", "--max-tokens", "16"])
    )
    assert (config.draft, config.prompt_sets, config.prompts_per_set, config.max_tokens) == (None, ("edit",), 3, 16)
    assert (
        llama_cpp.command_line(parse(["--model", target, "--prompts", "3", "--cpu-kinds", "both"]))
        == f"specdec bench --llama-cpp --model {target} --prompts 3 --out bench_out --cpu-kinds both"
    )
    assert (config.sampling, config.seed, config.setting.temperature) == ("greedy", 0, 0.0)
    sampled = parse(["--model", target, "--sampled", "--seed", "3", "--cpu-kinds", "native"])
    config = llama_cpp.llama_cpp_config(sampled)
    assert (config.sampling, config.seed, config.setting.temperature, config.setting.top_p) == ("sampled", 3, 0.8, 0.95)
    assert llama_cpp.command_line(sampled).endswith("--sampled --seed 3 --cpu-kinds native")
    with pytest.raises(ValueError, match="sampling must be one of greedy, sampled, got 'nucleus'"):
        LlamaCppConfig(target, sampling="nucleus")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tree", "2x2"], "--tree do not apply"),
        (["--head", "h"], "--head must be an EAGLE head's directory"),
        (["--quantization", "int8", "--dtype", "float32"], "--dtype, --quantization do not apply"),
        (["--prompt-sets", "poetry"], "prompt sets must be among"),
        (["--prompts", "0"], "prompts_per_set must be an integer >= 1"),
    ],
)
def test_flags_that_do_not_apply_or_bad_values_are_refused(gguf_pair, argv, message):
    with pytest.raises(ValueError, match=message):
        llama_cpp.llama_cpp_config(parse(["--model", gguf_pair[0]] + argv))


def test_a_target_that_is_not_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a GGUF file .llama.cpp reads no other"):
        llama_cpp.llama_cpp_config(parse(["--model", str(tmp_path)]))


def test_the_default_pair_not_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(registry.paths, "CACHE", tmp_path)
    with pytest.raises(registry.ModelNameError, match="specdec fetch qwen2.5-coder-1.5b-instruct"):
        llama_cpp.llama_cpp_config(parse([]))


@pytest.fixture
def no_default_cross_draft(monkeypatch):
    """As where SmolLM2 is not fetched (it may be here)."""
    monkeypatch.setattr(llama_cpp, "default_cross_draft", lambda: None)


@pytest.fixture
def head_dir(tmp_path) -> str:
    head = tmp_path / "head"
    head.mkdir()
    (head / "head.json").write_text("{}")
    return str(head)


def test_the_systems_are_every_one_whose_model_is_given(gguf_pair, head_dir, tmp_path, no_default_cross_draft):
    target, draft = gguf_pair
    config = llama_cpp.llama_cpp_config(parse(["--model", target, "--draft", draft]))
    assert config.systems == ("plain", "auto", "ngram", "draft_model", "lookup_then_draft", "staged", "suffix")
    assert config.skipped == (
        "No other-tokenizer draft row: smollm2 (SmolLM2-135M-Instruct) is not fetched (`specdec fetch "
        "smollm2`), and no --cross-tokenizer-draft was given.",
    )
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    config = llama_cpp.llama_cpp_config(
        parse(["--model", target, "--draft", draft, "--cross-tokenizer-draft", str(other), "--head", head_dir])
    )
    every = tuple(m for m in llama_cpp.METHODS if m not in llama_cpp.ADAPTED_METHODS)
    assert config.systems == every and config.skipped == ()
    assert (config.cross_draft, config.head) == (str(other), head_dir)
    config = llama_cpp.llama_cpp_config(parse(["--model", target]))
    assert config.systems == ("plain", "auto", "ngram", "suffix") and config.skipped[-1] == (
        "No --draft: no draft_model, lookup_then_draft, staged rows."
    )


def test_the_default_other_tokenizer_draft_is_smollm2s_gguf_file_where_fetched(gguf_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(registry.paths, "CACHE", tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    entry = registry.REGISTRY["smollm2"]
    file = registry.model_file(entry)
    assert llama_cpp.default_cross_draft() is None
    file.parent.mkdir(parents=True)
    with open(file, "wb") as out:
        out.truncate(entry.size)  # a sparse file of its size
    assert llama_cpp.default_cross_draft() == str(file)
    config = llama_cpp.llama_cpp_config(parse(["--model", gguf_pair[0], "--systems", "cross_tokenizer"]))
    assert (config.systems, config.cross_draft, config.skipped) == (("plain", "cross_tokenizer"), str(file), ())


def test_systems_chosen_keep_a_run_short_and_plain_always_runs(gguf_pair):
    target, draft = gguf_pair
    config = llama_cpp.llama_cpp_config(parse(["--model", target, "--draft", draft, "--systems", "staged,ngram"]))
    assert config.systems == ("plain", "ngram", "staged")
    runners = llama_cpp.llama_cpp_runners(BUILD, config, OPTIONS)
    assert [system.method for system in runners] == ["plain", "ngram"]  # llama.cpp has no staged drafts
    assert llama_cpp.command_line(parse(["--model", target, "--systems", "staged,ngram"])) == (
        f"specdec bench --llama-cpp --model {target} --out bench_out --systems staged,ngram --cpu-kinds native"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "ngram,medusa"], "systems must be among plain, auto, ngram, .*; got medusa"),
        (["--systems", "eagle"], "the system eagle needs --head .or leave it out of --systems."),
        (["--systems", "staged"], "the system staged needs --draft"),
        (["--systems", "cross_tokenizer", "--cross-tokenizer-draft", "/no/such.gguf"], "neither a GGUF file"),
        (["--draft", "a.gguf", "--draft", "b.gguf"], "--llama-cpp takes one --draft: its staged row"),
    ],
)
def test_systems_without_their_models_are_refused(gguf_pair, argv, message, no_default_cross_draft):
    with pytest.raises(ValueError, match=message):
        llama_cpp.llama_cpp_config(parse(["--model", gguf_pair[0]] + argv))


def test_the_systems_flags_need_llama_cpp():
    parser = argparse.ArgumentParser(prog="specdec")
    commands.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--systems", "ngram"])
    with pytest.raises(ValueError, match="--systems: for the comparison with llama.cpp only .add --llama-cpp."):
        args.run(args)
    args = parser.parse_args(["bench", "--sampled"])  # the main bench runs greedy and sampled rows anyway
    with pytest.raises(ValueError, match="--sampled: for the comparison with llama.cpp only"):
        args.run(args)
    args = parser.parse_args(["bench", "--adapt", "4", "--adapt-minutes", "2"])
    with pytest.raises(ValueError, match="--adapt, --adapt-minutes: for the comparison with llama.cpp only"):
        args.run(args)


def _row(engine, method, speed, acceptance=None, tau=None, prompt_set="edit", llama_plain=20.0, plain=25.0) -> dict:
    """A summarized row (llama_cpp.summarize's keys), specdec's drafters with made-up counts."""
    drafting = engine == "specdec" and method != "plain"
    return {
        "prompt_set": prompt_set,
        "engine": engine,
        "method": method,
        "label": f"{engine} {method}",
        "prompts": 2,
        "tokens": 256,
        "tokens_per_s": speed,
        "ratio_to_llama_cpp_plain": speed / llama_plain,
        "ratio_to_specdec_plain": speed / plain,
        "prompt_tokens_per_s": 90.0,
        "decode_tokens_per_s": speed * 1.1,
        "acceptance": acceptance,
        "tau": tau,
        "same_text_as_specdec_plain": 2,
        "alpha": 0.8 if drafting else None,
        "acceptance_by_position": [0.9, 0.7] if drafting else None,
        "cost_ratio_in_rounds": 0.01 if drafting else None,
        "rounds_by_k": [3, 0, 40] if drafting else None,
        "inner": {"drafted": 10, "judged": 8, "accepted": 6, "emitted": 12, "forwards": 6}
        if method == "staged"
        else None,
        "inner_alpha": 0.75 if method == "staged" else None,
        "inner_tau": 2.0 if method == "staged" else None,
    }


def _kind(cpu_kind: str) -> dict:
    rows = [
        _row("llama.cpp", "plain", 20.0),
        _row("specdec", "plain", 25.0, tau=1.0),
        _row("specdec", "ngram", 30.0, 0.71, 2.5),
        _row("specdec", "staged", 28.0, 0.5, 2.0),
    ]
    return {
        "cpu_kind": cpu_kind,
        "cpu_capability": cpu_kind.upper().replace("NATIVE", "AVX512"),
        "machine": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0", "date": "2026-11-25 16:00 UTC"},
        "threads": 2,
        "llama_cpp": {"commit": "0c1e570", "flags": ["-DGGML_NATIVE=ON"], "system_info": "AVX512 = 1"},
        "prompt_sets": {"edit": {"title": "edit prompts", "prompts": ["a", "b"]}},
        "verify_cost": {
            "llama.cpp": {"depth": 64, "verify_ms": 90.0, "step_ms": 30.0, "verify_cost": 3.0},
            "specdec": {"depth": 64, "verify_ms": 80.0, "step_ms": 40.0, "verify_cost": 2.0},
        },
        "rows": rows,
        "notes": ["a note"],
        "load_average": {"before": 3.5, "after": 1.25},
    }


def _results(*kinds: str) -> dict:
    return {
        "prompt_sets": {"edit": {}},
        "command": "specdec bench --llama-cpp",
        "config": {"model": "/m/t.gguf", "draft": "/m/d.gguf", "max_tokens": 128, "k": 5},
        "cpu_kinds": [_kind(kind) for kind in kinds],
    }


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the Markdown tables in text by their first cell, each row's cells after it in
    the order of the tables (a table too wide for the terminal is printed as several)."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.setdefault(cells[0], []).extend(cells[1:])
    return rows


def test_the_markdown_has_the_verdict_then_a_table_per_cpu_kind_and_prompt_set():
    text = llama_cpp_markdown(_results("native", "avx2"))
    assert text.startswith("# Against llama.cpp")
    assert "## AMD EPYC, AVX512 (as it is)" in text and "## AMD EPYC, AVX2 (held to AVX2)" in text
    verdict = text[text.index("## Verdict") : text.index("|")]  # before every table
    fastest = (
        "specdec's fastest, specdec ngram, 30.0 tok/s, against llama.cpp's fastest, llama.cpp plain, 20.0 "
        "tok/s: **1.50x**."
    )
    for kind in ("AVX512 (as it is)", "AVX2 (held to AVX2)"):
        assert f"AMD EPYC, {kind}, edit prompts: {fastest}" in " ".join(verdict.split())
    rows = table_rows(text)
    assert (
        rows["system"]
        == [
            "tok/s",
            "x llama.cpp plain",
            "x specdec plain",
            "prompt tok/s",
            "decode tok/s",
            "accepted ÷ drafted",
            "τ",
            "tokens",
            "same text",
        ]
        * 2
    )  # for each CPU kind
    assert rows["specdec ngram"] == ["30.0", "1.50x", "1.20x", "90.0", "33.0", "0.71", "2.50", "256", "2 of 2"] * 2
    assert rows["llama.cpp plain"] == ["20.0", "1.00x", "0.80x", "90.0", "22.0", "–", "–", "256", "2 of 2"] * 2
    # specdec's drafters: α, acceptance by position, c in rounds; the k chosen, a staged row's inner rounds
    assert rows["specdec drafter"] == ["α", "acceptance by draft position 1, 2, …", "c in rounds"] * 2
    assert rows["ngram"] == ["0.80", "0.90 0.70", "0.010"] * 2 and "plain" not in rows
    flat = " ".join(text.split())
    assert "k chosen by goodput (k:rounds), ngram: 0:3 2:40." in flat
    assert "staged, the draft model's inner rounds (prompt lookup drafting for it): α 0.75, τ 2.00" in flat
    assert rows["engine"] == ["7-token forward ms", "1-token step ms", "verify ÷ step"] * 2
    assert rows["llama.cpp"] == ["90.00", "30.00", "3.00"] * 2 and "- a note" in text
    assert "load average was 3.5 before the timed runs and 1.2 after them, on 2 cores" in " ".join(text.split())
    assert all(len(line) <= 100 for line in text.splitlines())


def test_issue_29s_goals_are_judged_from_the_rows():
    from specdec.tools.benchmark.goals import evaluate_llama_cpp_goals

    speeds = {  # tok/s by prompt set: llama.cpp plain 10 and specdec plain 12 on both
        "write": [("llama.cpp", "ngram", 9.0), ("llama.cpp", "draft_model", 12.0), ("specdec", "ngram", 15.0)]
        + [("specdec", "staged", 21.0)],
        "edit": [("llama.cpp", "ngram", 11.0), ("llama.cpp", "draft_model", 8.0), ("specdec", "ngram", 32.0)]
        + [("specdec", "staged", 11.0)],
    }
    rows = [
        _row(engine, method, speed, prompt_set=set_name, llama_plain=10.0, plain=12.0)
        for set_name, others in speeds.items()
        for engine, method, speed in [("llama.cpp", "plain", 10.0), ("specdec", "plain", 12.0)] + others
    ]
    goals = {g["name"]: g for g in evaluate_llama_cpp_goals(rows)}
    assert list(goals) == ["write, best drafter", "edit, best drafter", "vs llama.cpp speculative", "every drafter"]
    write, edit = goals["write, best drafter"], goals["edit, best drafter"]
    assert (write["bar"], write["measured"], write["met"]) == (2.0, pytest.approx(2.1), True)
    assert (edit["bar"], edit["measured"], edit["met"]) == (3.0, pytest.approx(3.2), True)
    assert "best staged: 21.0 tok/s" in write["detail"] and write["unit"] == "x llama.cpp plain"
    versus = goals["vs llama.cpp speculative"]  # write 21 ÷ 12 (its draft model), edit 32 ÷ 11 (its lookup)
    assert (versus["bar"], versus["measured"], versus["met"]) == (1.5, pytest.approx(21 / 12), True)
    assert "edit: ngram 32.0 vs llama.cpp ngram 11.0 tok/s (2.91x)" in versus["detail"]
    every = goals["every drafter"]  # staged on edit: 11 ÷ 12
    assert (every["bar"], every["measured"], every["met"]) == (0.95, pytest.approx(11 / 12), False)
    assert every["detail"].startswith("3/4 at or above; the slowest, staged on the edit prompts: 0.92x; missed by")

    only_edit = [r for r in rows if r["prompt_set"] == "edit" and r["method"] in ("plain", "ngram")]
    only_edit = [r for r in only_edit if r["engine"] == "specdec" or r["method"] == "plain"]
    goals = {g["name"]: g for g in evaluate_llama_cpp_goals(only_edit)}
    assert goals["write, best drafter"]["met"] is None and goals["vs llama.cpp speculative"]["met"] is None
    assert "not measured: no write prompts" in goals["write, best drafter"]["detail"]
    assert goals["edit, best drafter"]["met"] is True and goals["every drafter"]["met"] is True


def test_a_sampled_run_is_also_judged_on_its_best_drafter_against_specdec_plain():
    from specdec.tools.benchmark.goals import evaluate_llama_cpp_goals

    rows = [
        _row(engine, method, speed, prompt_set=set_name, llama_plain=10.0, plain=12.0)
        for set_name, best in (("write", 16.0), ("edit", 20.0))
        for engine, method, speed in [("llama.cpp", "plain", 10.0), ("specdec", "plain", 12.0)]
        + [("specdec", "ngram", best), ("specdec", "eagle", 13.0)]
    ]
    assert "sampled, best drafter" not in {g["name"] for g in evaluate_llama_cpp_goals(rows)}
    goal = evaluate_llama_cpp_goals(rows, "sampled")[-1]
    assert (goal["name"], goal["bar"], goal["measured"], goal["met"]) == (
        "sampled, best drafter",
        1.5,
        pytest.approx(16 / 12),
        False,
    )
    assert goal["detail"].startswith("write: ngram 16.0 tok/s (1.33x); edit: ngram 20.0 tok/s (1.67x); missed by")


def test_a_sampled_run_says_so_in_its_titles_and_docs_file(tmp_path):
    results = _results("native")
    results["cpu_kinds"][0]["sampling"] = {"name": "sampled", "temperature": 0.8, "top_p": 0.95}
    for row in results["cpu_kinds"][0]["rows"]:
        row["same_text_as_specdec_plain"] = None
    text = llama_cpp_markdown(results)
    assert "## AMD EPYC, AVX512 (as it is), sampled (temperature 0.8, top-p 0.95)" in text
    assert table_rows(text)["specdec ngram"][-1] == "–"  # no text compared
    assert "sampled, best drafter" in table_rows(text)
    write_llama_cpp_docs(_results("native"), tmp_path)
    write_llama_cpp_docs(results, tmp_path)  # beside the greedy run's, not over it
    assert sorted(p.name for p in (tmp_path / "benchmarks" / "llama_cpp").iterdir()) == [
        "native-sampled.json",
        "native.json",
    ]
    page = (tmp_path / "benchmarks.md").read_text()
    assert "## AMD EPYC, AVX512 (as it is)\n" in page and "(as it is), sampled (temperature 0.8" in page


def test_the_goals_come_with_the_verdict_before_the_tables():
    text = llama_cpp_markdown(_results("native"))
    before_tables = " ".join(text[: text.index("## AMD EPYC")].split())
    assert (
        "The goals (issue 29's, and issue 50's where measured), AMD EPYC, AVX512 (as it is): **1 of 4 met**, 1 "
        "missed, 2 not measured." in before_tables
    )
    rows = table_rows(text)
    assert rows["goal"] == ["bar", "measured", "verdict"]
    assert rows["edit, best drafter"] == ["≥ 3.00x llama.cpp plain", "1.50x llama.cpp plain", "**missed**"]
    assert rows["every drafter"] == ["≥ 0.95x specdec plain", "1.12x specdec plain", "met"]


def test_write_docs_places_the_section_after_the_kept_marker_and_replaces_it_later(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nthe bench's\n\n{KEPT_MARKER}\n\n## By hand\n\nkept\n")
    write_llama_cpp_docs(_results("native"), tmp_path)
    first = page.read_text()
    assert (
        first.index(KEPT_MARKER) < first.index(LLAMA_CPP_START) < first.index(LLAMA_CPP_END) < first.index("## By hand")
    )
    assert "## Against llama.cpp" in first and "(held to AVX2)" not in first
    write_llama_cpp_docs(_results("avx2"), tmp_path)  # the native kind's earlier results stay
    second = page.read_text()
    assert second.count(LLAMA_CPP_START) == 1 and "(as it is)" in second and "(held to AVX2)" in second
    assert second.endswith("## By hand\n\nkept\n") and second.startswith("# Benchmarks\n\nthe bench's\n")
    assert json.loads((tmp_path / "benchmarks" / "llama_cpp" / "avx2.json").read_text())["config"]["k"] == 5


# -- specdec's systems on tiny models (no llama.cpp, no downloads) --------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """A tiny GGUF target and a GGUF draft sharing its tokenizer, a draft of another tokenizer (a
    model directory) and a random EAGLE head for the target."""
    from gguf_files import tiny_hf_model, write_gguf
    from helpers import save_random_head, save_tiny_model

    root = tmp_path_factory.mktemp("llama-cpp-systems")
    target = write_gguf(root / "target.gguf", tiny_hf_model("llama", seed=0))
    return {
        "model": str(target),
        "draft": str(write_gguf(root / "draft.gguf", tiny_hf_model("qwen2", seed=1))),
        "cross_draft": str(save_tiny_model(root / "other", "llama", seed=2, vocab_size=270, num_hidden_layers=1)),
        "head": str(save_random_head(target, root / "head")),
    }


@pytest.mark.filterwarnings("ignore:the draft .* has a context of")
def test_every_specdec_system_runs_as_llm_builds_it_and_keeps_the_targets_output(tiny_models):
    from specdec.drafters import CrossTokenizerDrafter, DraftModelDrafter, EagleDrafter, NgramDrafter
    from specdec.spec.staged import StagedDrafter

    config = LlamaCppConfig(**tiny_models, max_tokens=12, k=3)
    every = tuple(m for m in llama_cpp.METHODS if m not in llama_cpp.ADAPTED_METHODS)  # they need --adapt
    assert config.systems == every
    _, runners = llama_cpp.load_specdec(config)
    assert [system.method for system in runners] == list(every)
    drafters = {system.method: runner.llm.engine.drafter for system, runner in runners.items()}
    assert drafters["plain"] is None and isinstance(drafters["ngram"], NgramDrafter)
    assert isinstance(drafters["staged"], StagedDrafter) and isinstance(drafters["staged"].inner, NgramDrafter)
    assert drafters["staged"].runner is drafters["draft_model"].runner  # the draft model's weights, shared
    assert type(drafters["draft_model"]) is DraftModelDrafter
    assert isinstance(drafters["cross_tokenizer"], CrossTokenizerDrafter)
    assert isinstance(drafters["eagle"], EagleDrafter)
    behind = drafters["lookup_then_eagle"]
    assert isinstance(behind.drafter, EagleDrafter) and behind.drafter is not drafters["eagle"]
    ids = list(range(5, 25)) * 2  # repeats: prompt lookup finds something
    llama_cpp.warm_up(runners, ids, config)
    records = [Record("edit", 0, LLAMA_PLAIN, _timed(12, 1.0, text=None))]
    records += [Record("edit", 0, system, runner(ids, "")) for system, runner in runners.items()]
    timed = {r.system.method: r.timed for r in records[1:]}
    assert len({t.text for t in timed.values()}) == 1 and all(t.tokens == 12 for t in timed.values())
    assert timed["staged"].inner is not None and set(timed["staged"].inner) == set(llama_cpp.INNER_COUNTS)
    assert all(t.inner is None for method, t in timed.items() if method != "staged")
    assert timed["ngram"].drafted and sum(timed["ngram"].rounds_by_k or ()) == timed["ngram"].rounds
    rows = llama_cpp.summarize(records, [r.system for r in records], config.k, ("edit",))
    specdec_rows = [r for r in rows if r["engine"] == "specdec"]
    assert all(r["same_text_as_specdec_plain"] == 1 and r["ratio_to_specdec_plain"] > 0 for r in specdec_rows)
    ngram = next(r for r in rows if r["method"] == "ngram")
    assert ngram["alpha"] is not None and ngram["acceptance_by_position"] and ngram["cost_ratio_in_rounds"] >= 0


@pytest.mark.filterwarnings("ignore:the draft .* has a context of")
def test_a_sampled_run_seeds_the_shared_stream_and_leaves_k_to_goodput(tiny_models):
    """Sampled at 0.8 / 0.95: the request carries no seed (a seeded one keeps the fixed k), the
    prompt's seed seeds the stream unseeded requests share: the same seed gives the target alone
    the same text, another seed another; a drafter's rounds take goodput's k."""
    config = LlamaCppConfig(tiny_models["model"], systems=("ngram",), max_tokens=16, k=3, sampling="sampled")
    _, runners = llama_cpp.load_specdec(config)
    plain, ngram = runners[SPECDEC_PLAIN], runners[System("specdec", "ngram")]
    stream_before = plain.llm.engine.shared_generator.get_state()
    params = plain.params(seed=4)  # what the setting asks for; building it changes nothing
    assert (params.temperature, params.top_p, params.seed, params.max_tokens) == (0.8, 0.95, 4, 16)
    assert torch.equal(plain.llm.engine.shared_generator.get_state(), stream_before)
    sent = plain._as_sent(params)  # as a timed call sends it: unseeded, the shared stream seeded 4
    assert sent.seed is None
    assert torch.equal(plain.llm.engine.shared_generator.get_state(), torch.Generator().manual_seed(4).get_state())
    ids = list(range(5, 25)) * 2
    texts = {seed: plain(ids, "", seed).text for seed in range(4)}
    assert plain(ids, "", 2).text == texts[2] and len(set(texts.values())) > 1
    policy = ngram.llm.engine.k_choice.policy
    before = sum(policy.k_counts.values())
    rounds = ngram(ids, "", 2).rounds
    assert rounds and sum(policy.k_counts.values()) - before == rounds  # every round's k was goodput's


def test_an_other_tokenizer_draft_that_shares_the_targets_is_refused(tiny_models):
    config = LlamaCppConfig(tiny_models["model"], cross_draft=tiny_models["draft"], systems=("cross_tokenizer",))
    with pytest.raises(ValueError, match="shares the target's tokenizer: give one of another tokenizer"):
        llama_cpp.load_specdec(config)


# -- the adaptation row (--adapt) ----------------------------------------------------------------------


def test_adapt_makes_the_adaptation_config(gguf_pair, head_dir):
    target, _ = gguf_pair
    config = llama_cpp.llama_cpp_config(parse(["--model", target, "--head", head_dir, "--adapt", "24"]))
    assert (config.adapt_requests, config.adapt_minutes, config.prompt_sets) == (24, 10.0, ("batch",))
    assert config.systems == ("plain", "eagle", "adapted_eagle") and config.head == head_dir
    argv = ["--model", target, "--head", head_dir, "--adapt", "6", "--adapt-minutes", "2.5", "--systems", "ngram"]
    config = llama_cpp.llama_cpp_config(parse(argv))
    assert config.systems == ("plain", "ngram", "eagle", "adapted_eagle") and config.adapt_minutes == 2.5
    assert "--adapt 6 --adapt-minutes 2.5 --cpu-kinds" in llama_cpp.command_line(parse(argv))
    assert "adapted_eagle" not in llama_cpp.llama_cpp_config(parse(["--model", target, "--head", head_dir])).systems


def test_adapt_without_head_takes_the_registrys_head_for_the_model(monkeypatch, tmp_path):
    """The default target (Qwen2.5-Coder-1.5B), as fetched: its shipped EAGLE-3 head in the checkout."""
    entry = registry.REGISTRY[llama_cpp.DEFAULT_TARGET]
    monkeypatch.setattr(registry.paths, "CACHE", tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    file = registry.model_file(entry)
    file.parent.mkdir(parents=True)
    with open(file, "wb") as out:
        out.write(b"GGUF")
        out.truncate(entry.size)
    config = llama_cpp.llama_cpp_config(parse(["--model", str(file), "--adapt", "8", "--systems", "plain"]))
    assert config.head is not None and Path(config.head).name == "qwen2.5-coder-1.5b-eagle3"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--adapt", "1"], "--adapt needs 2 requests or more"),
        (["--adapt", "4", "--prompt-sets", "write,edit"], "give one prompt set .--prompt-sets batch., got write,edit"),
        (["--adapt", "4", "--adapt-minutes", "0"], "--adapt-minutes must be above 0, got 0"),
        (["--adapt", "4", "--adapt-minutes", "nan"], "--adapt-minutes must be above 0, got nan"),
        (["--systems", "adapted_eagle"], "the system adapted_eagle needs --adapt N"),
        (["--systems", "adapted_auto"], "the system adapted_auto needs --adapt N"),
    ],
)
def test_bad_adaptation_flags_are_refused(gguf_pair, head_dir, argv, message):
    with pytest.raises(ValueError, match=message):
        llama_cpp.llama_cpp_config(parse(["--model", gguf_pair[0], "--head", head_dir] + argv))


def test_adapt_on_a_model_without_a_shipped_head_asks_for_one(gguf_pair):
    with pytest.raises(ValueError, match="no EAGLE head is registered for .*: give the head to start from with --head"):
        llama_cpp.llama_cpp_config(parse(["--model", gguf_pair[0], "--adapt", "4"]))


def _adaptation_rows(head_tau: float, adapted_tau: float, head_speed: float, adapted_speed: float) -> list[dict]:
    return [
        _row("llama.cpp", "plain", 10.0, prompt_set="batch", llama_plain=10.0),
        _row("specdec", "plain", 12.0, tau=1.0, prompt_set="batch", llama_plain=10.0, plain=12.0),
        _row("specdec", "eagle", head_speed, 0.5, head_tau, prompt_set="batch", llama_plain=10.0, plain=12.0),
        _row("specdec", "adapted_eagle", adapted_speed, 0.6, adapted_tau, "batch", llama_plain=10.0, plain=12.0),
    ]


def test_issue_50s_goals_are_judged_where_their_rows_ran():
    from specdec.tools.benchmark.goals import evaluate_llama_cpp_goals, issue_50_goals

    goals = {g["name"]: g for g in issue_50_goals(_adaptation_rows(1.6, 2.4, 14.0, 15.0))}
    assert list(goals) == ["adapted head, τ", "adapted head, tokens/s"]
    tau, speed = goals["adapted head, τ"], goals["adapted head, tokens/s"]
    assert (tau["bar"], tau["measured"], tau["met"]) == (1.25, pytest.approx(1.5), True)
    assert (speed["bar"], speed["measured"], speed["met"]) == (1.15, pytest.approx(15 / 14), False)
    assert speed["detail"].startswith("15.00 vs 14.00; missed by")
    rows = [
        _row("llama.cpp", "plain", 10.0, prompt_set="batch", llama_plain=10.0),
        _row("specdec", "auto", 32.0, 0.7, 3.0, prompt_set="batch", llama_plain=10.0),
        _row("specdec", "lookup_then_eagle", 20.0, 0.5, 1.8, prompt_set="batch", llama_plain=10.0),
    ]
    goals = {g["name"]: g for g in issue_50_goals(rows)}
    assert goals["batch job"]["measured"] == pytest.approx(3.2) and goals["batch job"]["met"] is True
    assert goals["batch job"]["detail"] == "32.0 tok/s on 2 requests (not the goal's 32: judged on what ran)"
    assert goals["batch job, default"]["measured"] == pytest.approx(1.6) and goals["batch job, default"]["met"]
    assert issue_50_goals([r for r in rows if r["method"] != "auto"]) == []  # not run: not judged
    assert [g["name"] for g in evaluate_llama_cpp_goals(rows)][-2:] == ["batch job", "batch job, default"]


def test_the_adaptation_is_reported_with_adapts_estimates_and_the_measured_ratio():
    results = _results("native")
    kind = results["cpu_kinds"][0]
    kind["prompt_sets"] = {"batch": {"title": "a batch job", "prompts": ["c", "d"]}}
    kind["rows"] = _adaptation_rows(1.6, 2.4, 14.0, 16.8)
    estimates = {"agreement_by_step": [0.5, 0.4], "greedy_agreement": 0.5, "tau_estimate": 1.9}
    kind["adaptation"] = {
        "requests": 24,
        "recorded": 24,
        "recorded_prompts": ["a", "b"],
        "recording_tokens": 3000,
        "recording_tokens_per_s": 14.2,
        "minutes": 10,
        "adapt_seconds": 700.0,
        "steps": 41,
        "training_seconds": 600.0,
        "before": estimates,
        "after": {**estimates, "agreement_by_step": [0.7, 0.6], "tau_estimate": 2.6},
        "improved": True,
    }
    flat = " ".join(llama_cpp_markdown(results).split())
    assert "### Adapting the head to the job" in llama_cpp_markdown(results)
    assert "The first 24 requests of the job, served by specdec's default at 14.2 tok/s" in flat
    assert "41 steps in 10.0 min of training, 11.7 min in all" in flat
    assert "agreement by drafting step 0.500 / 0.400 → 0.700 / 0.600, τ 1.90 → 2.60." in flat
    assert "τ 1.60 → 2.40 (1.50x), tok/s 14.0 → 16.8 (1.20x)" in flat
    assert "adapted head, τ" in table_rows(llama_cpp_markdown(results))


@pytest.fixture(scope="module")
def adapting(tmp_path_factory) -> dict[str, str]:
    """A tiny GGUF target and an untrained EAGLE-3 head reading both its layers."""
    from gguf_files import tiny_hf_model, write_gguf
    from helpers import save_random_head

    root = tmp_path_factory.mktemp("llama-cpp-adapt")
    target = write_gguf(root / "target.gguf", tiny_hf_model("llama", seed=3))
    return {"model": str(target), "head": str(save_random_head(target, root / "head", feature_layers=(0, 1)))}


def test_the_adaptation_records_the_first_requests_adapts_and_drafts_with_the_new_head(adapting):
    """The first requests of the job are served by the default and recorded; adapt trains on them
    (one step here: the budget); the adapted head drafts the measured requests after them, alone,
    keeping the target's output; adapt's estimates before and after are kept."""
    from specdec.drafters import EagleDrafter

    config = LlamaCppConfig(
        **adapting,
        prompt_sets=("batch",),
        adapt_requests=4,
        adapt_minutes=1e-4,
        prompts_per_set=1,
        max_tokens=8,
        max_prompt_chars=200,
    )
    target, runners = llama_cpp.load_specdec(config)
    recorded, measured = llama_cpp.job_prompts(target, config, "batch")
    assert (len(recorded), len(measured)) == (4, 1)
    assert {p.name for p, _, _ in recorded}.isdisjoint(p.name for p, _, _ in measured)
    adapted, summary = llama_cpp.adapted_runners(target, config, recorded, lambda message: None)
    assert list(adapted) == [System("specdec", "adapted_eagle")]  # adapted_auto where asked for
    runner = adapted[System("specdec", "adapted_eagle")]
    assert (summary["requests"], summary["recorded"], summary["steps"]) == (4, 4, 1)
    assert summary["recording_tokens"] == 4 * 8 and summary["recorded_prompts"] == [p.name for p, _, _ in recorded]
    assert set(summary["before"]) == set(summary["after"]) == {"agreement_by_step", "greedy_agreement", "tau_estimate"}
    drafter = runner.llm.engine.drafter
    assert isinstance(drafter, EagleDrafter) and drafter is not runners[System("specdec", "eagle")].llm.engine.drafter
    _, ids, _ = measured[0]
    assert runner(ids, "").text == runners[SPECDEC_PLAIN](ids, "").text


# -- the real thing, where it is here ------------------------------------------------------------------


def _real_models() -> tuple[str, str]:
    files = []
    for name in (llama_cpp.DEFAULT_TARGET, llama_cpp.DEFAULT_DRAFT):
        entry = registry.REGISTRY[name]
        if not registry.is_fetched(entry):
            pytest.skip(f"{name} is absent: `specdec fetch {name}` (or `make qwen`) fetches it")
        files.append(str(registry.model_path(entry)))
    return files[0], files[1]


@pytest.mark.slow
def test_one_real_prompt_end_to_end():
    target, _ = _real_models()
    build = LlamaCppBuild(llama_cpp.process_cpu_kind())
    if not build.is_built():
        pytest.skip(
            f"llama.cpp is not built in {build.build_dir}: `specdec bench --llama-cpp` (or `make llama-cpp`) builds it"
        )
    config = LlamaCppConfig(
        model=target, prompt_sets=("edit",), prompts_per_set=1, max_tokens=8, bench_repetitions=1, step_repeats=2
    )
    result = llama_cpp.measure(config, lambda message: None)
    rows = {(r["engine"], r["method"]): r for r in result["rows"]}
    specdec = {("specdec", method) for method in ("plain", "auto", "ngram", "suffix")}
    assert set(rows) == {("llama.cpp", "plain"), ("llama.cpp", "ngram"), *specdec}
    assert result["notes"] == []  # both engines read the same number of prompt tokens
    for row in rows.values():
        assert 1 <= row["tokens"] <= 8 + config.k + 1 and row["tokens_per_s"] > 0
    assert rows[("specdec", "plain")]["same_text_as_specdec_plain"] == 1
    assert rows[("llama.cpp", "plain")]["ratio_to_llama_cpp_plain"] == 1.0
    assert all(math.isfinite(cost["verify_cost"]) for cost in result["verify_cost"].values())
    assert result["llama_cpp"]["system_info"] and result["cpu_kind"] == llama_cpp.process_cpu_kind()
    assert len(result["runs"]) == len(rows) and {run["prompt_tokens"] for run in result["runs"]} == {
        rows[("specdec", "plain")]["prompt_tokens"]
    }
