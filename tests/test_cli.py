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
    expected = LLM(str(model_dir), dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert main(["generate", "--model", str(model_dir), "--draft", str(model_dir), "--k-policy", "fixed", "-k", "3",
                 "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32", "--compare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected)
    assert "[draft_model k=3]" in out and "α 1.000" in out and "τ" in out
    assert "[target alone]" in out and "speedup" in out and "greedy outputs identical: True" in out


def test_generate_ngram_sampled(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--ngram", "--prompt", "for i in range(10): for i in",
                 "--max-tokens", "8", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]) == 0
    assert "[ngram k=5]" in capsys.readouterr().out


def test_generate_with_a_tree(model_dir, capsys):
    prompt = "def add(a, b):"
    expected = LLM(str(model_dir), dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert main(["generate", "--model", str(model_dir), "--draft", str(model_dir), "--tree", "2,1", "-k", "3",
                 "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected) and "[draft_model k=3 tree 2,1]" in out


def test_generate_lookup_then_draft(model_dir, capsys):
    prompt = "for i in range(10): for i in"
    expected = LLM(str(model_dir), dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert main(["generate", "--model", str(model_dir), "--draft", str(model_dir), "--k-policy", "fixed", "--lookup", "-k", "3",
                 "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt + expected) and "[lookup_then_draft k=3]" in out


SWITCHES = ("--ngram", "--lookup")


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/dir"], "does not exist"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["-k", "-1", "--ngram"], "num_speculative_tokens"),
    (["--lookup"], "add --draft DIR"),
    (["--lookup", "--ngram"], "instead of --ngram"),
    (["--tree", "auto"], "needs a drafter"),
    (["--tree", "auto", "--ngram"], "grows trees"),
    (["--tree", "3,x", "--ngram"], "speculative_tree"),
])
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
    assert main(["generate", "--model", str(model_dir), "--draft", str(model_dir), "--k-policy", "fixed", "-k", "4", "--prompt",
                 "def add(a, b):", "--max-tokens", "12", "--dtype", "float32", "--color", "always"]) == 0
    from specdec.cli import DRAFT_COLOR
    body = _marked_body(capsys.readouterr().out)
    expected = LLM(str(model_dir), dtype="float32").generate(
        "def add(a, b):", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
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
    args = ["generate", "--model", str(model_dir), "--draft", str(model_dir), "--k-policy", "fixed", "-k", "4", "--prompt", "def add(a, b):",
            "--max-tokens", "16", "--dtype", "float32", "--color", "always"]
    assert main(args) == 0
    full = _strip_colors(_marked_body(capsys.readouterr().out))
    stop = full[len("def add(a, b):") + 6:][:3]  # a stop string a few characters into the completion
    assert main(args + ["--stop", stop]) == 0
    marked = _marked_body(capsys.readouterr().out)
    from specdec.cli import DRAFT_COLOR
    assert DRAFT_COLOR in marked and _strip_colors(marked) == full[:full.index(stop, len("def add(a, b):"))]


def test_compare_speedup_is_a_ratio_of_tokens_per_second(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--draft", str(model_dir), "-k", "3", "--prompt", "def f(",
                 "--max-tokens", "12", "--temperature", "1", "--seed", "2", "--stop", "e", "--compare"]) == 0
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
    [expected] = LLM(str(chat_dir), dtype="float32").chat([{"role": "user", "content": "def add(a, b):"}],
                                                          SamplingParams(temperature=0, max_tokens=8))
    assert main(["generate", "--model", str(chat_dir), "--ngram", "--chat", "def add(a, b):", "--max-tokens", "8",
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.startswith(expected.outputs[0].text + "\n")
    assert main(["generate", "--model", str(model_dir), "--chat", "hi", "--dtype", "float32"]) == 2
    assert "no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --prompt or --chat, not both
        main(["generate", "--model", str(model_dir), "--chat", "hi", "--prompt", "x"])
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
        assert main(["generate", "--model", str(model_dir), "--draft", str(short), "-k", "2", "--prompt", "x = 1",
                     "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "has a context of 16 tokens" in line]
    assert len(said) == 1 and said[0].startswith("specdec: the draft ")
    assert "UserWarning" not in err and "draft_model.py" not in err
