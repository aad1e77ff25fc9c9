"""Bad input, one kind per case: each is refused with the exception a caller can catch (a
ValueError, or its subclass ModelLoadError for model files) and a message that names the
problem, before any work is done; and what used to hang (a k far beyond what a request can
use) now finishes at once with the target's own output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import save_tiny_model, stdlib_corpus
from specdec import LLM, ModelLoadError, SamplingParams
from specdec.cli import main

CONTEXT = 256  # helpers.hf_config's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad") / "tiny", "llama", seed=3, init_std=0.2)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), dtype="float32", speculative_method="none")


def broken_copy(model_dir: Path, tmp_path: Path, change) -> Path:
    """A copy of the model with change(tensors) applied to its weights."""
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(model_dir, path)
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------- LLM(...)

LLM_CASES = [  # (arguments besides the model, what the message must say)
    ({"seed": "abc"}, "seed must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer"),
    ({"skip_tokenizer_init": "no"}, "skip_tokenizer_init must be True or False"),
    ({"speculative_model": 123}, "speculative_model must be the path"),
    ({"num_speculative_tokens": 2.0, "speculative_method": "ngram"}, "num_speculative_tokens must be an integer"),
    ({"device": "tpu"}, "device must be cpu, cuda"),
]


@pytest.mark.parametrize("arguments, message", LLM_CASES, ids=[str(a) for a, _ in LLM_CASES])
def test_bad_llm_arguments_are_refused_before_loading(arguments, message, tmp_path):
    """Checked before the model is read: the model path here does not even exist."""
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "not-loaded-yet"), **arguments)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            {"speculative_method": "none", "num_speculative_tokens": 3},
            "num_speculative_tokens=3 with speculative_method='none', which turns speculation off",
        ),
        ({"speculative_method": "none", "ngram_prompt_lookup_min": 2}, "ngram_min=2 with speculative_method='none'"),
        (
            {"speculative_method": "none", "draft_confidence_threshold": float("nan")},
            "draft_confidence_threshold=nan with speculative_method='none'",
        ),
        ({"speculative_method": "none", "draft_dtype": "float16"}, "draft_dtype='float16' with speculative_method"),
        (
            {"speculative_method": "none", "speculative_model": "D"},
            "speculative_model='D' with speculative_method='none'",
        ),
        (
            {"speculative_method": "ngram", "draft_confidence_threshold": 0.5},
            "draft_confidence_threshold=0.5 configure a draft model, and speculative_method='ngram' uses none",
        ),
        ({"speculative_method": "ngram", "draft_dtype": "bfloat16"}, "draft_dtype='bfloat16' configure a draft model"),
    ],
)
def test_speculation_options_that_would_be_ignored_are_refused(arguments, message, tmp_path):
    """Options of speculation given with speculation turned off (or of a draft model given to
    prompt lookup) would do nothing, silently; they are refused, before loading."""
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "not-loaded-yet"), **arguments)


@pytest.mark.parametrize(
    "model, message",
    [
        (None, "model must be the path of a Hugging Face model directory, got None"),
        ("", "model must be the path"),
        (42, "got 42"),
    ],
)
def test_a_model_that_is_not_a_path(model, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(model, speculative_method="none")


def test_a_dtype_that_is_neither_a_name_nor_a_torch_dtype(model_dir):
    with pytest.raises(ValueError, match=r"dtype must be 'auto', one of .* or a torch dtype, got \['float32'\]"):
        LLM(str(model_dir), dtype=["float32"], speculative_method="none")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.bool])
def test_a_torch_dtype_that_is_not_a_supported_float(model_dir, dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype} is not supported"):
        LLM(str(model_dir), dtype=dtype, speculative_method="none")


def test_a_torch_float_dtype_is_taken(model_dir):
    assert LLM(str(model_dir), dtype=torch.bfloat16, speculative_method="none").target.model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "alias, dtype",
    [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32), ("half", torch.float16)],
)
def test_dtype_aliases_and_torch_dtypes_for_the_draft_too(model_dir, alias, dtype):
    """The spellings vLLM and transformers users write, for the target and for the draft."""
    llm = LLM(
        str(model_dir), dtype=alias, speculative_model=str(model_dir), draft_dtype=alias, num_speculative_tokens=2
    )
    assert llm.target.model.dtype == dtype and llm.engine.drafter.model.dtype == dtype
    assert (
        LLM(
            str(model_dir), speculative_model=str(model_dir), draft_dtype=dtype, num_speculative_tokens=2
        ).engine.drafter.model.dtype
        == dtype
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_weights_holding_nan_or_inf_are_refused_at_load(model_dir, tmp_path, value):
    def poison(tensors):
        name = "model.layers.1.mlp.down_proj.weight"
        tensors[name][3, 5] = value

    path = broken_copy(model_dir, tmp_path, poison)
    with pytest.raises(ModelLoadError, match=r"\['model.layers.1.mlp.down_proj.weight'\] hold NaN or infinite"):
        LLM(str(path), speculative_method="none")


def test_weights_that_overflow_the_asked_dtype_are_refused(model_dir, tmp_path):
    def enlarge(tensors):
        tensors["model.norm.weight"][0] = 1e6  # beyond float16's largest, 65504

    path = broken_copy(model_dir, tmp_path, enlarge)
    assert LLM(str(path), dtype="float32", speculative_method="none")  # fine as saved
    with pytest.raises(ModelLoadError, match="once converted to float16"):
        LLM(str(path), dtype="float16", speculative_method="none")


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/elsewhere.safetensors", "a/../../x.safetensors"])
def test_a_shard_index_pointing_outside_the_model_is_refused(model_dir, tmp_path, shard):
    import shutil

    path = tmp_path / "indexed"
    shutil.copytree(model_dir, path)
    weight_map = {name: "model.safetensors" for name in load_file(path / "model.safetensors")}
    weight_map["lm_head.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="shard paths must stay inside the model directory"):
        LLM(str(path), speculative_method="none")


def test_k_beyond_the_context_is_refused(model_dir):
    with pytest.raises(
        ValueError,
        match=f"num_speculative_tokens=10000000 is more than the model's context "
        f"length \\({CONTEXT} tokens\\).*at most {CONTEXT - 1}",
    ):
        LLM(str(model_dir), speculative_method="ngram", num_speculative_tokens=10_000_000)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_k_far_beyond_the_request_drafts_only_what_it_can_use(model_dir, llm, method):
    """k = 255 with max_tokens = 4: each round drafts no more than the request can still emit
    (it used to draft and verify all k every round); the output is the target's own."""
    draft = {"speculative_model": str(model_dir)} if method == "draft_model" else {}
    fast = LLM(str(model_dir), dtype="float32", speculative_method=method, num_speculative_tokens=CONTEXT - 1, **draft)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = fast.generate("def add(a, b):", params)[0]
    assert out.outputs[0].token_ids == llm.generate("def add(a, b):", params)[0].outputs[0].token_ids
    assert out.metrics.num_draft_tokens <= 3  # after the prefill's token, at most 3 more can be emitted
    assert fast.runner.cache.max_len < 64  # the cache is sized by what is used, not by k


def test_a_cache_larger_than_free_memory_is_refused_before_allocating(llm, monkeypatch):
    """max_tokens that a model with a vast context allows, but memory does not: a clear error
    (it used to allocate until the kernel killed the process), and the LLM still works after."""
    import specdec.kv_cache as kv_cache

    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = llm.generate("def add(a, b):", params)[0].outputs[0].token_ids
    llm.runner.cache = None  # as a new LLM: the next generate allocates
    with monkeypatch.context() as patch:
        patch.setattr(kv_cache, "free_memory_bytes", lambda device: 100_000)  # 100 kB free
        with pytest.raises(
            ValueError,
            match=r"key/value cache of 1[45] blocks of 16 positions needs [\d,]+ bytes, more than "
            r"the 100,000 bytes free on cpu: 1 sequences at once.*lower max_tokens",
        ):
            llm.generate("def add(a, b):", params)
    assert llm.generate("def add(a, b):", params)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ("a", 5, "sampling_params must be a SamplingParams or a list of them, got 5"),
        ({"prompt_token_ids": "abc"}, None, "'prompt_token_ids' must be a list of token ids, got 'abc'"),
        ({"prompt": [1, 2]}, None, "'prompt' must be text, got \\[1, 2\\]"),
        (
            {"prompt": "ab", "prompt_token_ids": [1, 2]},
            None,
            "takes 'prompt' \\(text\\) or 'prompt_token_ids', not both",
        ),
    ],
)
def test_bad_generate_arguments(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)


def test_stop_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids \[320, 999\] are outside the vocabulary \[0, 320\)"):
        llm.generate("x", SamplingParams(stop_token_ids=[3, 320, 999]))


def test_a_draft_with_a_shorter_context_is_said(model_dir, tmp_path):
    short = save_tiny_model(tmp_path / "short", "llama", seed=5, init_std=0.2, max_position_embeddings=16)
    with pytest.warns(UserWarning, match="has a context of 16 tokens, the target 256: past 16 tokens"):
        LLM(str(model_dir), speculative_model=str(short), num_speculative_tokens=2)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_llm(model_dir, tmp_path_factory) -> LLM:
    import shutil

    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(model_dir, path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    return LLM(str(path), dtype="float32", speculative_method="none")


@pytest.mark.parametrize(
    "messages, message",
    [
        (None, "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        (["hi"], r"messages\[0\] must be a dict with 'role' and 'content', got 'hi'"),
        ([CHAT, []], "messages must be a non-empty list"),
        ([CHAT, [{"role": "user"}]], r"messages\[0\]\['content'\] must be text"),
        ([{"content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] must be text, got None"),
        (
            [{"role": "user", "content": "hi"}, {"role": "user", "content": 7}],
            r"messages\[1\]\['content'\] must be text",
        ),
    ],
)
def test_bad_chat_messages(chat_llm, messages, message):
    with pytest.raises(ValueError, match=message):
        chat_llm.chat(messages)
    assert chat_llm.chat(CHAT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # and it still chats


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}", "TemplateSyntaxError"),
        ("{{ nothing.defined() }}", "UndefinedError"),
        ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),
    ],
)
def test_a_chat_template_that_fails_is_named(chat_llm, template, message, monkeypatch):
    monkeypatch.setattr(chat_llm.tokenizer, "chat_template", template)
    with pytest.raises(ValueError, match=f"the model's chat template failed \\({message}"):
        chat_llm.chat(CHAT)


# ---------------------------------------------------------------------------- SamplingParams(...)

PARAMS_CASES = [
    ({"stop": 123}, "stop must be a string or a list of strings, got 123"),
    ({"stop": [""]}, "stop must be non-empty strings"),
    ({"stop": [b"x"]}, "stop must be non-empty strings"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"stop_token_ids": "2"}, "stop_token_ids must be a list of token ids"),
    ({"seed": "7"}, "seed must be an integer"),
]


@pytest.mark.parametrize("fields, message", PARAMS_CASES, ids=[str(f) for f, _ in PARAMS_CASES])
def test_bad_sampling_params(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


# ---------------------------------------------------------------------------- the command line


def test_a_prompt_too_long_for_the_context_quotes_the_users_max_tokens(model_dir, capsys):
    """The error names the request's max_tokens, not the 2 tokens of generate's warm-up."""
    assert main(["generate", "--model", str(model_dir), "--prompt", "x = 1\n" * 300, "--max-tokens", "100"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens=100 exceeds the model's context length 256" in err and "max_tokens=2 " not in err


@pytest.mark.parametrize(
    "command, flags, message",
    [
        (
            "distill",
            ["--sample-temperature", "0"],
            "--sample-temperature and --prompt-tokens shape the text the target "
            "writes, which only --on-policy-fraction F > 0 uses",
        ),
        ("distill", ["--prompt-tokens", "8", "--on-policy-fraction", "0"], "only --on-policy-fraction F > 0 uses"),
        ("train", ["--tokenizer", "TARGET", "--vocab-size", "1000"], "--tokenizer brings its vocabulary"),
    ],
)
def test_training_flags_that_would_be_ignored(model_dir, tmp_path, capsys, command, flags, message):
    source = ["--target", str(model_dir)] if command == "distill" else ["--preset", "tiny"]
    flags = [str(model_dir) if flag == "TARGET" else flag for flag in flags]
    assert main([command, *source, "--out", str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_resuming_with_other_steps_says_how_to_keep_the_warmup(tmp_path, capsys):
    """The default warm-up follows --steps, so resuming with other --steps changes it: the
    refusal says which --warmup keeps the run's."""
    corpus = stdlib_corpus(tmp_path / "corpus", ("abc.py", "copy.py", "stat.py"))
    run = [
        "train",
        "--out",
        str(tmp_path / "out"),
        "--preset",
        "tiny",
        "--context",
        "16",
        "--batch-size",
        "2",
        "--eval-tokens",
        "64",
        "--log-every",
        "0",
        "--corpus",
        str(corpus),
    ]
    assert main([*run, "--steps", "20", "--stop-after", "1"]) == 0
    assert main([*run, "--steps", "40"]) == 2
    assert (
        "warmup 2 -> 4) (warm-up defaults to a tenth of --steps, at most 100: pass --warmup 2"
        in capsys.readouterr().err
    )
    assert main([*run, "--steps", "40", "--warmup", "2", "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert main([*run, "--steps", "40", "--warmup", "2", "--stop-after", "1"]) == 2
    assert "the checkpoint is at step 2, past --stop-after 1" in capsys.readouterr().err


def test_prompt_tokens_cut_to_the_context_is_said(model_dir, tmp_path, capsys):
    corpus = stdlib_corpus(tmp_path / "corpus", ("abc.py", "copy.py", "stat.py", "keyword.py"))
    trained = tmp_path / "target"
    run = [
        "--batch-size",
        "2",
        "--eval-tokens",
        "128",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--log-every",
        "0",
        "--eval-every",
        "0",
        "--corpus",
        str(corpus),
    ]
    assert main(["train", "--out", str(trained), "--preset", "tiny", "--context", "16", *run]) == 0
    assert (
        main(
            [
                "distill",
                "--target",
                str(trained),
                "--out",
                str(tmp_path / "draft"),
                "--hidden-size",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--layers",
                "1",
                "--on-policy-fraction",
                "1",
                "--prompt-tokens",
                "40",
                *run,
            ]
        )
        == 0
    )
    assert "--prompt-tokens 40 is not below the context (16 tokens)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-method", "none", "-k", "3"], "-k sets speculation, which --speculative-method none turns off"),
        (
            ["--speculative-method", "none", "--draft-confidence", "0.5", "--draft", "D"],
            "--draft-confidence and --draft set",
        ),
        (["--speculative-method", "none", "--draft-dtype", "float16"], "--draft-dtype sets speculation"),
        (["--ngram", "--draft-confidence", "0.5"], "--draft-confidence sets the draft model, and --ngram uses none"),
    ],
)
def test_generate_flags_that_would_be_ignored(model_dir, capsys, flags, message):
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-tokens", "2", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-shard-mb", "1e-9"], "--max-shard-mb must be a number of at least 0.000001"),
        (["--batch-size", "100000000"], "--batch-size 100000000 windows of 17 tokens"),
    ],
)
def test_training_flags_refused_before_training(tmp_path, capsys, flags, message):
    corpus = stdlib_corpus(tmp_path / "corpus", ("abc.py", "copy.py", "stat.py"))
    assert (
        main(
            [
                "train",
                "--out",
                str(tmp_path / "out"),
                "--preset",
                "tiny",
                "--context",
                "16",
                "--steps",
                "2",
                "--corpus",
                str(corpus),
                *flags,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # nothing written


def test_a_stop_string_on_the_command_line_reads_backslash_n_as_a_newline():
    """`--stop "\\n"` (what a shell passes for "\n") is a newline, as a user means; "\\\\n" is
    a backslash and an n, and other backslashes stay as they are."""
    from specdec.cli import build_parser

    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "p", "--stop", "\\n", "--stop", "a\\\\n", "--stop", "\\t\\x"]
    )
    assert args.stop == ["\n", "a\\n", "\t\\x"]


def test_generate_with_a_k_beyond_the_context_says_why(model_dir, capsys):
    """The issue's `-k 1000 --max-tokens 4` on a model with a shorter context: said with the flag typed."""
    assert (
        main(["generate", "--model", str(model_dir), "--ngram", "-k", "1000", "--prompt", "x", "--max-tokens", "4"])
        == 2
    )
    assert "error: -k 1000 is more than the model's context length" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "-2"])
def test_a_kv_cache_memory_that_is_no_size_is_refused_before_loading(value, tmp_path, capsys):
    """`--kv-cache-memory inf` or `1e300` crashed with a traceback (int(inf)); the model here does
    not exist, so the flag is checked before anything is loaded."""
    assert main(["serve", str(tmp_path / "no_model"), "--kv-cache-memory", value]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory must be a number of GB above 0 and at most 1e9 (leave it out for no limit" in err
    assert f"got {float(value)}" in err and "Traceback" not in err


def test_a_max_num_seqs_no_engine_runs_is_refused_before_loading(tmp_path, capsys):
    """`--max-num-seqs 10000000` timed a forward of 10^7 rows and died in the allocator; the model
    here does not exist, so the flag is checked before anything is loaded."""
    assert main(["serve", str(tmp_path / "no_model"), "--max-num-seqs", "10000000"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs 10,000,000 is more requests at once than one engine runs (at most 65,536" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_prefill_time_bound_that_is_no_time_is_refused_before_loading(tmp_path, capsys, value):
    assert main(["serve", str(tmp_path / "no_model"), "--max-prefill-seconds", value]) == 2
    err = capsys.readouterr().err
    assert f"--max-prefill-seconds must be a positive number of seconds, got {float(value)}" in err
    assert "Traceback" not in err


def test_slots_whose_memory_is_not_free_are_refused_before_any_timing(model_dir, capsys, monkeypatch):
    """Slots that one round's forward over them all (k + 1 positions each) and their block table
    cannot fit beside the cache are refused with the most that fit, exit 2, before a forward is
    timed (60,000 slots once calibrated for minutes, and more died in the allocator)."""
    import specdec.engine.capacity as capacity

    timed = []
    monkeypatch.setattr(capacity, "free_memory_bytes", lambda device: 200 * 10**6)  # 200 MB: a 100 MB cache
    monkeypatch.setattr(capacity.Capacity, "_time_target", lambda self, *shape: timed.append(shape))
    serve = ["serve", str(model_dir), "--ngram", "-k", "4", "--k-policy", "goodput"]
    assert main([*serve, "--max-num-seqs", "60000"]) == 2
    err = capsys.readouterr().err
    assert "error: max_num_seqs 60,000: that many sequences at once take about" in err
    assert "more than the 0.1 GB free; lower max_num_seqs (--max-num-seqs) to at most 4," in err
    assert "Traceback" not in err and timed == []


def test_serving_times_its_round_costs_at_no_more_than_the_rows_it_caps(model_dir, monkeypatch):
    """Many slots that fit are served, their round costs timed up to MAX_TIMED_ROWS rows (goodput
    corrects a larger batch's from its own rounds), not at every power of two up to them."""
    import specdec.engine.capacity as capacity

    assert capacity.timed_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capacity.timed_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capacity.timed_batch_sizes(100_000) == [1 << i for i in range(9)]  # up to 256
    timed = []
    monkeypatch.setattr(capacity.Capacity, "_time_target", lambda self, rows, *rest: timed.append(rows))
    llm = LLM(str(model_dir), dtype="float32", speculative_method="ngram", num_speculative_tokens=3, max_num_seqs=5000)
    assert llm.speculative_config.k_policy == "goodput"
    assert llm.engine.prepare_to_serve(max_model_len=64) == 5000
    assert timed and max(timed) == capacity.MAX_TIMED_ROWS
