"""`specdec generate`: prints the completion and the metrics; --compare adds the speedup."""

from __future__ import annotations

import pytest

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cli") / "m", "llama", seed=4, init_std=0.3)


def test_generate_prints_completion_and_metrics(model_dir, capsys):
    prompt = "def add(a, b):"
    expected = (
        LLM(str(model_dir), dtype="float32", speculative_method="none")
        .generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
        .text
    )
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--draft",
                str(model_dir),
                "--k-policy",
                "fixed",
                "-k",
                "3",
                "--prompt",
                prompt,
                "--max-tokens",
                "12",
                "--dtype",
                "float32",
                "--compare",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected)
    assert "[draft_model k=3]" in out and "α 1.000" in out and "τ" in out
    assert "[target alone]" in out and "speedup" in out and "greedy outputs identical: True" in out


def test_generate_ngram_sampled(model_dir, capsys):
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--ngram",
                "--prompt",
                "for i in range(10): for i in",
                "--max-tokens",
                "8",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert "[ngram k=5]" in capsys.readouterr().out


def test_generate_with_a_tree(model_dir, capsys):
    prompt = "def add(a, b):"
    expected = (
        LLM(str(model_dir), dtype="float32", speculative_method="none")
        .generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
        .text
    )
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--draft",
                str(model_dir),
                "--tree",
                "2,1",
                "-k",
                "3",
                "--prompt",
                prompt,
                "--max-tokens",
                "12",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected) and "[draft_model k=3 tree 2,1]" in out


def test_generate_lookup_then_draft(model_dir, capsys):
    prompt = "for i in range(10): for i in"
    expected = (
        LLM(str(model_dir), dtype="float32", speculative_method="none")
        .generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
        .text
    )
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--draft",
                str(model_dir),
                "--k-policy",
                "fixed",
                "--lookup",
                "-k",
                "3",
                "--prompt",
                prompt,
                "--max-tokens",
                "12",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected) and "[lookup_then_draft k=3]" in out


SWITCHES = ("--ngram", "--lookup")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/dir"], "does not exist"),
        (["--temperature", "-1"], "--temperature must be a number >= 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
        (["-k", "-1", "--ngram"], "-k must be an integer >= 0, got -1"),
        (["--lookup"], "add --draft DIR"),
        (["--lookup", "--ngram"], "instead of --ngram"),
        (["--tree", "auto"], "--speculative-method auto drafts a tree wherever earlier text continued the match"),
        (["--tree", "auto", "--ngram"], "--tree auto needs a drafter that grows trees"),
        (["--tree", "3,x", "--ngram"], "--tree must be 'chain', 'auto', or branching factors"),
    ],
)
def test_bad_input_is_one_clear_line(model_dir, capsys, args, message):
    base = {"--model": str(model_dir), "--prompt": "x"}
    options = [a for a in args if a not in SWITCHES]
    for flag, value in zip(options[::2], options[1::2]):
        base[flag] = value
    argv = ["generate"] + [item for pair in base.items() for item in pair] + [a for a in args if a in SWITCHES]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_accepted_draft_tokens_are_marked(model_dir, capsys):
    """With the target as its own draft every token after the first is an accepted draft:
    the colored runs, with the color codes removed, give back the completion exactly."""
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--draft",
                str(model_dir),
                "--k-policy",
                "fixed",
                "-k",
                "4",
                "--prompt",
                "def add(a, b):",
                "--max-tokens",
                "12",
                "--dtype",
                "float32",
                "--color",
                "always",
            ]
        )
        == 0
    )
    from specdec.cli import DRAFT_COLOR

    body = _marked_body(capsys.readouterr().out)
    expected = (
        LLM(str(model_dir), dtype="float32", speculative_method="none")
        .generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
    )
    assert _strip_colors(body) == "def add(a, b):" + expected.text
    assert body.count(DRAFT_COLOR) >= 1
    plain_first = body.index(DRAFT_COLOR) > len("def add(a, b):")  # the prefill's token is the target's
    assert plain_first or expected.text == ""


def test_divergence_note_names_the_position_and_the_precision():
    import torch

    from specdec.cli import divergence_note

    assert divergence_note([1, 2, 3], [1, 2, 4], torch.float32) == "the outputs first differ at generated token 2"
    note = divergence_note([1, 2, 3], [1, 2], torch.bfloat16)
    assert note.startswith("the outputs first differ at generated token 2: in bfloat16") and "float32" in note


def _marked_body(out: str) -> str:
    """The prompt and the marked completion in generate's output (after the legend, before the metrics)."""
    return out.split("\n\n", 1)[1].split("\n\n[draft_model")[0]


def _strip_colors(text: str) -> str:
    from specdec.cli import DRAFT_COLOR, RESET

    return text.replace(DRAFT_COLOR, "").replace(RESET, "")


@pytest.mark.parametrize("text", ["x = '€'", "naïve = 1  # 😀 ok"])
def test_marking_keeps_characters_split_across_runs(text):
    """Multi-byte characters the byte-level tokenizer splits into several tokens, with the
    runs changing inside them (every other token an accepted draft): the marked text, colors
    removed, is the decoded text, with no replacement characters."""
    from helpers import make_tokenizer
    from specdec.cli import DRAFT_COLOR, mark_draft_tokens
    from specdec.llm import CompletionOutput
    from specdec.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(make_tokenizer(320))
    prompt_ids = tokenizer.encode("s = 1\n", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode("ascii", "ignore").decode())  # some character takes several tokens
    completion = CompletionOutput(0, tokenizer.decode(ids), ids, "length", [i % 2 == 0 for i in range(len(ids))])
    marked = mark_draft_tokens(tokenizer, prompt_ids, completion)
    assert _strip_colors(marked) == text and "\ufffd" not in marked and DRAFT_COLOR in marked


def test_marking_a_completion_cut_by_a_stop_string(model_dir, capsys):
    """--stop cuts the text: still marked, and cut at the same place."""
    args = [
        "generate",
        str(model_dir),
        "--draft",
        str(model_dir),
        "--k-policy",
        "fixed",
        "-k",
        "4",
        "--prompt",
        "def add(a, b):",
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
        "--color",
        "always",
    ]
    assert main(args) == 0
    full = _strip_colors(_marked_body(capsys.readouterr().out))
    stop = full[len("def add(a, b):") + 6 :][:3]  # a stop string a few characters into the completion
    assert main(args + ["--stop", stop]) == 0
    marked = _marked_body(capsys.readouterr().out)
    from specdec.cli import DRAFT_COLOR

    assert DRAFT_COLOR in marked and _strip_colors(marked) == full[: full.index(stop, len("def add(a, b):"))]


def test_compare_speedup_is_a_ratio_of_tokens_per_second(model_dir, capsys):
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--draft",
                str(model_dir),
                "-k",
                "3",
                "--prompt",
                "def f(",
                "--max-tokens",
                "12",
                "--temperature",
                "1",
                "--seed",
                "2",
                "--stop",
                "e",
                "--compare",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rates = [float(line.split(" tok/s")[0].rsplit(" ", 1)[1]) for line in out.splitlines() if "tok/s" in line]
    speedup = float(out.split("speedup ")[1].split("x")[0])
    assert speedup == pytest.approx(rates[0] / rates[1], rel=0.02)


def test_generate_chat_renders_the_template_and_prints_the_reply(model_dir, tmp_path, capsys):
    import json
    import shutil

    chat_dir = tmp_path / "chat"
    shutil.copytree(model_dir, chat_dir)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>"
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
    [expected] = LLM(str(chat_dir), dtype="float32", speculative_method="none").chat(
        [{"role": "user", "content": "def add(a, b):"}], SamplingParams(temperature=0, max_tokens=8)
    )
    assert (
        main(
            [
                "generate",
                str(chat_dir),
                "--ngram",
                "--chat",
                "def add(a, b):",
                "--max-tokens",
                "8",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(expected.outputs[0].text + "\n")
    assert main(["generate", str(model_dir), "--chat", "hi", "--dtype", "float32"]) == 2
    assert "no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --prompt or --chat, not both
        main(["generate", str(model_dir), "--chat", "hi", "--prompt", "x"])
    assert "not allowed with argument --chat" in capsys.readouterr().err


def test_version_is_the_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"specdec {version('specdec')}"


def test_a_known_condition_is_said_in_specdecs_words_without_a_source_line(model_dir, tmp_path, capsys):
    """A draft with a shorter context than its target: one line on stderr, as specdec's other
    messages read, not a UserWarning with a file and line number."""
    import warnings

    short = save_tiny_model(tmp_path / "short", "llama", seed=5, init_std=0.2, max_position_embeddings=16)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert (
            main(
                ["generate", str(model_dir), "--draft", str(short), "-k", "2", "--prompt", "x = 1", "--max-tokens", "2"]
            )
            == 0
        )
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "has a context of 16 tokens" in line]
    assert len(said) == 1 and said[0].startswith("specdec: the draft ")
    assert "UserWarning" not in err and "draft_model.py" not in err


# One vocabulary: SpeculativeConfig's fields are the flags of generate, serve and bench, spelled
# and explained once (their metadata in config.py); the model comes first in every subcommand.

SPECULATING = ("generate", "serve", "bench")


def _subcommands():
    from specdec.cli import build_parser

    return build_parser().commands


def _options(parser) -> dict:
    """option string -> its argparse action."""
    return {option: action for action in parser._actions for option in action.option_strings}


def test_every_speculative_field_is_a_flag_of_generate_serve_and_bench_spelled_the_same():
    from dataclasses import fields

    from specdec.config import SpeculativeConfig

    commands = _subcommands()
    spellings = {}
    for command in SPECULATING:
        options = _options(commands[command])
        for f in fields(SpeculativeConfig):
            flags = (*f.metadata["flags"], *f.metadata["old_flags"])
            assert f.metadata["help"] and all(flag in options for flag in flags), (command, f.name)
            assert len({options[flag].dest for flag in flags}) == 1  # the old spellings set the same thing
            spellings.setdefault(f.name, set()).add(
                tuple(sorted(o for o in options if options[o].dest == options[flags[0]].dest))
            )
    assert {name: len(found) for name, found in spellings.items()} == {name: 1 for name in spellings}


def test_a_field_added_to_speculative_config_is_a_flag_of_every_command(monkeypatch):
    from dataclasses import dataclass, fields

    from specdec import model_flags
    from specdec.config import SpeculativeConfig, setting

    @dataclass(frozen=True)
    class Extended(SpeculativeConfig):
        draft_temperature: float = setting(
            1.0, "the draft's temperature", "--draft-temperature", metavar="T", parse=float
        )

    monkeypatch.setattr(model_flags, "speculative_fields", lambda: {f.name: f for f in fields(Extended)})
    commands = _subcommands()
    for command in SPECULATING:
        action = _options(commands[command])["--draft-temperature"]
        assert "the draft's temperature" in action.help and "(default: 1)" in action.help


def test_help_shows_each_speculative_flags_default(capsys):
    commands = _subcommands()
    for command in ("generate", "serve"):
        options = _options(commands[command])
        from dataclasses import fields

        from specdec.config import SpeculativeConfig

        for f in fields(SpeculativeConfig):
            assert f"(default: {f.metadata['shown']})" in options[f.metadata["flags"][0]].help, (command, f.name)
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
        for shown in (
            "-k K, --num-speculative-tokens K",
            "(default: 5)",
            "(default: goodput)",
            "(default: chain)",
            "(default: auto)",
            "(default: 4)",
            "(default: 0)",
            "(default: half the target's depth)",
        ):
            assert shown in text, (command, shown)
        assert "--adaptive-confidence" not in text and "--model" not in text  # the old spellings: taken, not shown
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--draft-confidence P" in text and "(default: 0.5 in the bench)" in text
    assert "--adaptive-confidence" not in text
    assert "--k-policy {goodput,fixed}" not in text  # taken, and refused: the bench measures both policies


@pytest.mark.parametrize(
    "flags, said, keywords, python_said",
    [
        (
            ["--ngram", "-k", "-1"],
            "-k must be an integer >= 0, got -1",
            dict(speculative_method="ngram", num_speculative_tokens=-1),
            "num_speculative_tokens must be an integer >= 0",
        ),
        (
            ["--ngram", "--num-speculative-tokens", "-1"],
            "--num-speculative-tokens must be an integer >= 0, got -1",
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": -1}),
            "num_speculative_tokens must be",
        ),
        (
            ["--draft", "DRAFT", "--draft-confidence", "2"],
            "--draft-confidence must be in [0, 1], got 2.0",
            dict(speculative_model="DRAFT", draft_confidence_threshold=2),
            "draft_confidence_threshold must be in [0, 1]",
        ),
        (
            ["--ngram", "--ngram-min", "3", "--ngram-max", "2"],
            "need 1 <= --ngram-min <= --ngram-max, got 3, 2",
            dict(speculative_method="ngram", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2),
            "need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got 3, 2",
        ),
        (
            ["--speculative-method", "eagle"],
            "--speculative-method eagle needs --draft DIR",
            dict(speculative_method="eagle"),
            "speculative_method='eagle' needs speculative_model=<draft directory>",
        ),
        (
            ["--speculative-method", "ngram", "--draft", "DRAFT"],
            "but --draft DRAFT was given",
            dict(speculative_method="ngram", speculative_model="DRAFT"),
            "but speculative_model='DRAFT' was given",
        ),
        (
            ["--draft", "DRAFT", "--draft-dtype", "fp7"],
            "--draft-dtype must be one of",
            dict(speculative_model="DRAFT", draft_dtype="fp7"),
            "draft_dtype must be one of",
        ),
    ],
)
def test_a_bad_value_names_the_flag_on_the_command_line_and_the_keyword_in_python(
    model_dir, capsys, flags, said, keywords, python_said
):
    """One validation (SpeculativeConfig's), said in the words of the interface it came through."""
    import re

    flags = [str(model_dir) if flag == "DRAFT" else flag for flag in flags]
    said = said.replace("DRAFT", str(model_dir))
    for command in ("generate", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else []
        assert main([command, str(model_dir), *extra, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and "Traceback" not in err, (command, err)
        assert not re.search(
            r"\b(speculative_\w+|num_speculative_tokens|draft_confidence_threshold|ngram_prompt)", err
        ), err
    keywords = {key: str(model_dir) if value == "DRAFT" else value for key, value in keywords.items()}
    python_said = python_said.replace("DRAFT", str(model_dir))
    with pytest.raises(ValueError) as error:
        LLM(str(model_dir), **keywords)
    assert python_said in str(error.value) and "--" not in str(error.value)


def test_the_bench_checks_its_speculative_flags_as_generate_does(model_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    for flags, said in (
        (["-k", "-1"], "error: -k must be an integer >= 0, got -1"),
        (["--draft-confidence", "2"], "error: --draft-confidence must be in [0, 1], got 2.0"),
        (["--adaptive-confidence", "2"], "error: --adaptive-confidence must be in [0, 1], got 2.0"),
        (["--tree", "3,x"], "error: --tree must be 'chain', 'auto', or branching factors"),
        (["--early-exit", "0"], "error: --early-exit must be an integer >= 1, got 0"),
        (["--k-policy", "fixed"], "--k-policy does not apply to it (generate and serve take it)"),
        (
            ["--ngram-min", "2", "--speculative-method", "ngram"],
            "--speculative-method and --ngram-min do not apply to it",
        ),
        (["-k", "3", "--ks", "1,2"], "-k K is --ks K: give one of them"),
    ):
        assert main(["bench", str(model_dir), "--out", out, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err, (flags, err)
    assert not (tmp_path / "out").exists()  # refused before anything was measured or written


def test_the_model_comes_first_in_every_subcommand_and_the_old_flags_are_still_taken(tmp_path, capsys):
    from specdec.cli import build_parser

    parser = build_parser()
    for argv in (
        ["generate", "M", "--prompt", "x"],
        ["generate", "--model", "M", "--prompt", "x"],
        ["generate", "--prompt", "x", "M"],
        ["serve", "M"],
        ["serve", "--model", "M"],
        ["bench", "M"],
        ["bench", "--model", "M", "--quick"],
        ["generate", "M", "--model", "M", "--prompt", "x"],
    ):
        assert parser.parse_args(argv).model == "M", argv
    for argv in (
        ["distill", "T", "--out", "o"],
        ["distill", "--target", "T", "--out", "o"],
        ["train-heads", "T", "--out", "o"],
        ["train-heads", "--target", "T", "--out", "o"],
    ):
        assert parser.parse_args(argv).target == "T", argv
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "A", "--model", "B"])
    assert "two models given, A and B: give one" in capsys.readouterr().err
    for command, argv in (("generate", ["--prompt", "x"]), ("serve", []), ("distill", ["--out", str(tmp_path)])):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {command} needs a ") and f"specdec {command} " in err
    args = parser.parse_args(["bench", "--adaptive-confidence", "0.25", "--early-exit"])
    assert args.draft_confidence == 0.25 and args.early_exit is not None


def test_the_bench_says_its_run_in_the_same_words(model_dir):
    from specdec.cli import build_parser
    from specdec.tools.benchmark.commands import bench_config, command_line

    parser = build_parser()
    args = parser.parse_args(
        [
            "bench",
            str(model_dir),
            "--adaptive-confidence",
            "0.25",
            "-k",
            "3",
            "--early-exit",
            "--draft-quantization",
            "int8",
            "--draft",
            str(model_dir),
        ]
    )
    line = command_line(args)
    assert line.startswith(f"specdec bench {model_dir} --draft {model_dir}") and "--draft-confidence 0.25" in line
    assert "-k 3" in line and "--early-exit" in line and "--draft-quantization int8" in line
    assert parser.parse_args(line.split()[1:]) == args
    config = bench_config(args)
    assert (config.ks, config.adaptive_confidence, config.draft_quantization, config.early_exit_layer) == (
        (3,),
        0.25,
        "int8",
        1,
    )  # --early-exit alone: half the target's depth


def test_the_flags_build_the_speculative_config_llm_takes(model_dir):
    """--draft-quantization none is None (dequantize a GGUF draft), not LLM's "not given"."""
    from specdec.cli import build_parser
    from specdec.config import SpeculativeConfig
    from specdec.model_flags import speculative_config_from_flags

    parser = build_parser()

    def config(*flags):
        return speculative_config_from_flags(parser.parse_args(["generate", "M", "--prompt", "x", *flags]))

    assert config() == SpeculativeConfig(method="auto")  # speculation on by default
    assert config("-k", "3") == SpeculativeConfig(method="auto", num_speculative_tokens=3)
    assert config("--speculative-method", "none") is None
    assert config("--draft", "D", "--draft-quantization", "none", "-k", "3") == SpeculativeConfig(
        method="draft_model", model="D", draft_quantization=None, num_speculative_tokens=3
    )
    assert config("--ngram", "--ngram-min", "2", "--ngram-max", "3", "--k-policy", "fixed") == SpeculativeConfig(
        method="ngram", ngram_min=2, ngram_max=3, k_policy="fixed"
    )
    assert config("--draft", "D", "--lookup", "--draft-dtype", "bf16") == SpeculativeConfig(
        method="lookup_then_draft", model="D", draft_dtype="bfloat16"
    )
    assert config("--early-exit") == SpeculativeConfig(method="early_exit")
    assert config("--early-exit", "2", "--draft-confidence", "0.3") == SpeculativeConfig(
        method="early_exit", early_exit_layer=2, draft_confidence_threshold=0.3
    )
    with pytest.raises(ValueError, match="--ngram-min sets prompt lookup, which --draft alone does not use"):
        config("--draft", "D", "--ngram-min", "2")


@pytest.mark.parametrize(
    "model, name",
    [
        ("smollm2", "smollm2"),  # a registered model, by name
        ("/home/u/.cache/specdec/models/smollm2/hf", "smollm2"),  # where `specdec fetch` converts it
        ("/cache/models/smollm2/hf/", "smollm2"),  # under another SPECDEC_CACHE
        (
            "/c/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "qwen2.5-coder-1.5b-instruct",
        ),
        ("models/code-target/", "code-target"),  # a directory of one's own
        ("/data/llama-3.2-1b.Q4_0.gguf", "llama-3.2-1b.Q4_0.gguf"),  # a file of one's own
        ("/data/other/hf", "hf"),  # not where a fetch puts one: the directory's name, as given
    ],
)
def test_the_served_name_is_the_one_the_user_knows(model, name):
    """The model's name in the API when --served-model-name is not given: a registered model's
    name, by that name or at its fetched path (never `hf`), else the directory's or file's."""
    from specdec.serve.settings import default_served_name

    assert default_served_name(model) == name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--served-model-name", "a", "M"], "--served-model-name took ['a', 'M'] as names; give MODEL first"),
        (["serve", "M", "--served-model-name", " "], "--served-model-name [' ']: a name is empty"),
        (["serve", "M", "--max-request-bytes", "0"], "--max-request-bytes must be at least 1, got 0"),
        (["serve", "M", "--api-key", "a", "--api-key", " "], "--api-key (or SPECDEC_API_KEY) is empty"),
        (["serve", "M", "--api-key", "a", "--api-key", "a"], "--api-key: a key is given twice"),
    ],
)
def test_bad_serve_flags_are_one_clear_line(argv, message, capsys):
    """Refused before the model is read (M does not exist)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, on_ray",
    [
        ([], False),
        (["--replicas", "2"], True),
        (["--replica-threads", "1"], True),  # one replica on Ray: the ingress and router before one engine
        (["--ray-address", "auto"], True),  # one engine joining a cluster
    ],
)
def test_serve_runs_on_ray_with_replicas_or_a_ray_flag(flags, on_ray):
    from specdec.cli import build_parser
    from specdec.serve.commands import runs_on_ray

    assert runs_on_ray(build_parser().parse_args(["serve", "M", *flags])) == on_ray
