"""specdec chat-data: the target's answers to stdlib chat prompts, as a corpus distill reads."""

from __future__ import annotations

import json

import pytest

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.tools.training.chat_data import ChatDataConfig, write_chat_data
from specdec.tools.training.chat_prompts import chat_prompts
from specdec.tools.training.corpus import HELD_OUT_MODULES, load_corpus

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("chat") / "model", seed=4, init_std=0.3)
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return path


CONFIG = ChatDataConfig(train_prompts=4, held_out_prompts=2, sampled_fraction=0.5, max_tokens=6, batch_size=3)


@pytest.mark.slow
def test_answers_are_the_targets_and_held_out_prompts_stay_held_out(chat_model, tmp_path):
    out = write_chat_data(str(chat_model), str(tmp_path / "data"), CONFIG, dtype="float32", progress=lambda line: None)
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.txt"))
    assert names == [
        "held_out/00000-greedy.txt",
        "held_out/00000-sampled.txt",
        "held_out/00001-greedy.txt",
        "train/00000-greedy.txt",
        "train/00000-sampled.txt",
        "train/00001-greedy.txt",
        "train/00001-sampled.txt",
        "train/00002-greedy.txt",
        "train/00003-greedy.txt",
    ]
    corpus = load_corpus(out)
    assert sorted(d.name for d in corpus.held_out) == names[:3]
    llm = LLM(model=str(chat_model), dtype="float32", speculative_method="none")
    stdlib = load_corpus()
    for split, directory in (("train", "train"), ("held_out", "held_out")):
        prompts = chat_prompts(stdlib, split, limit=2)
        for i, prompt in enumerate(prompts):
            assert (prompt.document in HELD_OUT_MODULES) == (split == "held_out")
            [answer] = llm.chat(list(prompt.messages), SamplingParams(temperature=0, max_tokens=6))
            rendered = llm.tokenizer.apply_chat_template(list(prompt.messages))
            text = (out / f"{directory}/{i:05d}-greedy.txt").read_text()
            assert text.startswith(rendered) and text[len(rendered) :].removesuffix("</s>") == answer.outputs[0].text
    manifest = json.loads((out / "chat_data.json").read_text())
    assert manifest["finished"] and manifest["answers"] == {"train": 6, "held_out": 3}


@pytest.mark.slow
def test_a_stopped_run_resumes_where_it_stopped(chat_model, tmp_path):
    out = tmp_path / "data"
    lines = []

    def stop_after_first_batch(line: str) -> None:
        lines.append(line)
        if "3/9 answers" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_chat_data(str(chat_model), str(out), CONFIG, dtype="float32", progress=stop_after_first_batch)
    staging = tmp_path / "data.incomplete"
    assert not out.exists() and len(list(staging.rglob("*.txt"))) == 3
    first = {p.name: p.read_text() for p in staging.rglob("*.txt")}
    lines.clear()
    more = ChatDataConfig(train_prompts=5, held_out_prompts=2, sampled_fraction=0.5, max_tokens=6, batch_size=2)
    write_chat_data(str(chat_model), str(out), more, dtype="float32", progress=lines.append)
    assert "3 already written, 7 to go" in lines[0]  # more prompts and another batch size: the answers stand
    assert all((out / "train" / name).read_text() == text for name, text in first.items() if "train" in name)


@pytest.mark.slow
def test_a_finished_corpus_asked_for_more_prompts_answers_only_the_new_ones(chat_model, tmp_path):
    """Its answers are kept (copied into the new run) where the answering settings are the same;
    another answer length answers everything afresh."""
    out = tmp_path / "data"
    write_chat_data(str(chat_model), str(out), CONFIG, dtype="float32", progress=lambda line: None)
    first = {p.relative_to(out): p.read_text() for p in out.rglob("*.txt")}
    lines = []
    more = ChatDataConfig(train_prompts=6, held_out_prompts=2, sampled_fraction=0.5, max_tokens=6, batch_size=3)
    write_chat_data(str(chat_model), str(out), more, dtype="float32", progress=lines.append)
    assert "9 already written, 3 to go" in lines[0]
    assert all((out / name).read_text() == text for name, text in first.items())
    assert json.loads((out / "chat_data.json").read_text())["answers"] == {"train": 9, "held_out": 3}
    longer = ChatDataConfig(train_prompts=6, held_out_prompts=2, sampled_fraction=0.5, max_tokens=7, batch_size=3)
    lines.clear()
    write_chat_data(str(chat_model), str(out), longer, dtype="float32", progress=lines.append)
    assert "0 already written, 12 to go" in lines[0]


def test_bad_settings_and_a_model_without_a_template_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="sampled_fraction must be in"):
        ChatDataConfig(sampled_fraction=1.5)
    plain = save_tiny_model(tmp_path / "plain")
    for target in (["--target", str(plain)], [str(plain)]):  # the old flag, and TARGET first as everywhere
        assert main(["chat-data", *target, "--out", str(tmp_path / "out"), "--train-prompts", "1"]) == 2
        assert "has no chat template" in capsys.readouterr().err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.incomplete").exists()


def test_a_full_disk_is_said_in_one_line_naming_the_disk_and_what_was_kept(chat_model, tmp_path, capsys, monkeypatch):
    """A write that fails for want of space (it printed only "[Errno 28] No space left on device")
    names the disk, how much is free and the answers kept; no half-written answer is left, and the
    rerun goes on from the kept ones."""
    import errno
    from pathlib import Path

    out, staging = tmp_path / "data", tmp_path / "data.incomplete"
    real_write_text, answers = Path.write_text, []

    def write_until_full(self, text, *args, **kwargs):
        if self.suffix == ".part" and len(answers) == 2:
            real_write_text(self, text[:10])  # part of the file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.suffix == ".part":
            answers.append(self)
        return real_write_text(self, text, *args, **kwargs)

    run = ["chat-data", str(chat_model), "--out", str(out), "--train-prompts", "2", "--held-out-prompts", "1"]
    run += ["--max-tokens", "4", "--batch-size", "1", "--dtype", "float32"]
    monkeypatch.setattr(Path, "write_text", write_until_full)
    assert main(run) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: no space left on the disk holding {staging} while writing the chat-data")
    assert f"MB free); the 2 answers written are kept in {staging}: free some space and rerun" in lines[0]
    assert sorted(p.name for p in staging.rglob("*.txt")) == ["00000-greedy.txt", "00001-greedy.txt"]
    assert not list(staging.rglob("*.part")) and not out.exists()
    monkeypatch.setattr(Path, "write_text", real_write_text)
    assert main(run) == 0
    assert "2 already written, 2 to go" in capsys.readouterr().out
    assert len(list(out.rglob("*.txt"))) == 4 and not staging.exists()


def test_an_out_of_dot_is_refused_in_words(chat_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["chat-data", str(chat_model), "--out", ".", "--train-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "--out '.' is the current directory, which an output directory would replace" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_sharegpt_prompts_are_answered_by_the_target(chat_model, tmp_path, monkeypatch):
    """--prompts sharegpt: chat-data answers ShareGPT's first messages (here a fake dataset of
    the package's shape), the held-out ones into held_out/; greedy answers are the target's."""
    import io

    from helpers import fake_sharegpt
    from specdec.tools.training import sharegpt_prompts as sharegpt

    text, _ = fake_sharegpt(200, seed=5)
    monkeypatch.setattr(sharegpt, "HELD_OUT_SHARE", 0.25)
    monkeypatch.setattr(
        sharegpt, "_package_prompts", lambda max_chars: sharegpt._all_prompts(io.StringIO(text), max_chars)
    )
    config = ChatDataConfig(train_prompts=3, held_out_prompts=2, sampled_fraction=0, max_tokens=5, prompts="sharegpt")
    out = write_chat_data(str(chat_model), str(tmp_path / "data"), config, dtype="float32", progress=lambda line: None)
    assert json.loads((out / "chat_data.json").read_text())["settings"]["prompts"] == "sharegpt"
    llm = LLM(model=str(chat_model), dtype="float32", speculative_method="none")
    for split in ("train", "held_out"):
        prompts = sharegpt.sharegpt_prompts(split, limit=2, data=io.StringIO(text))
        for i, prompt in enumerate(prompts):
            assert sharegpt.is_held_out(prompt.source.removeprefix("sharegpt:")) == (split == "held_out")
            [answer] = llm.chat(list(prompt.messages), SamplingParams(temperature=0, max_tokens=5))
            rendered = llm.tokenizer.apply_chat_template(list(prompt.messages))
            written = (out / f"{split}/{i:05d}-greedy.txt").read_text()
            assert (
                written.startswith(rendered) and written[len(rendered) :].removesuffix("</s>") == answer.outputs[0].text
            )


def test_an_unknown_prompt_source_is_refused():
    with pytest.raises(ValueError, match="prompts must be one of stdlib, sharegpt"):
        ChatDataConfig(prompts="wikipedia")
