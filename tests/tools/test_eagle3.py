"""EAGLE-3 heads (training/eagle3.py): the stored features are the target's own; training-time
test computes what sequential drafting computes; a short run teaches the head, which then drafts
with the target's greedy output unchanged."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from helpers import load_hf, random_prompts, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.models.eagle import EagleHead, head_config, load_head
from specdec.models.loader import load_pretrained
from specdec.tools.training import eagle3
from specdec.tools.training.corpus import load_corpus
from specdec.tools.training.eagle3 import (
    Eagle3Config,
    compute_features,
    document_tokens,
    read_features,
    text_pieces,
    train_eagle3,
    ttt_predictions,
)
from specdec.tools.training.loop import TrainConfig

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
WORDS = "def return self value for in range if else import class print list dict x y n".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 4-layer chat target and a chat-data-like corpus of rendered conversations."""
    root = tmp_path_factory.mktemp("eagle3")
    target = save_tiny_model(root / "target", seed=4, init_std=0.3, num_hidden_layers=4)
    (target / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    rng = random.Random(7)
    for split, count in (("train", 12), ("held_out", 3)):
        (root / "data" / split).mkdir(parents=True)
        for i in range(count):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            answer = " ".join(rng.choice(WORDS[:6]) for _ in range(rng.randint(30, 60)))  # a narrower language
            text = f"<s>user: {question}</s><s>assistant: {answer}</s>"
            (root / "data" / split / f"{i:05d}-greedy.txt").write_text(text)
    return {"target": target, "data": root / "data", "root": root}


def test_stored_features_are_the_targets_layers_and_distribution(corpus, tmp_path):
    target = load_pretrained(corpus["target"], "float32")
    manifest = compute_features(target, (0, 2), 5, corpus["data"], tmp_path / "f", progress=lambda line: None)
    _, arrays = read_features(tmp_path / "f")
    reference = load_hf(corpus["target"])
    text = (corpus["data"] / "train" / "00000-greedy.txt").read_text()
    tokenizer = target.tokenizer
    assert tokenizer is not None
    ids, first_answer = document_tokens(text, tokenizer, "<s>assistant: ")
    answer = text.split("<s>assistant: ")[1]
    assert tokenizer.decode(ids[first_answer:], skip_special_tokens=False).strip() == answer
    assert not tokenizer.decode(ids[first_answer - 1 :], skip_special_tokens=False).strip().startswith(answer)
    train = arrays["train"]
    n = len(ids)
    assert train.token_ids[:n].tolist() == ids
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], dim=-1)  # layers 0 and 2 [T, 2H]
    torch.testing.assert_close(train.features[:n].float(), expected, atol=2e-2, rtol=2e-2)  # stored in bfloat16
    top = out.logits[0].log_softmax(-1).topk(5)
    assert torch.equal(train.top_ids[:n, 0].long(), top.indices[:, 0])
    torch.testing.assert_close(train.top_logprobs[:n].float(), top.values, atol=2e-3, rtol=2e-3)
    assert train.answer_next[:n].tolist() == [first_answer - 1 <= t < n - 1 for t in range(n)]
    assert len(manifest["splits"]["train"]["documents"]) == 12 and manifest["finished"]
    assert train.num_tokens == manifest["splits"]["train"]["tokens"]


def test_a_stopped_feature_pass_resumes_to_the_same_files(corpus, tmp_path):
    target = load_pretrained(corpus["target"], "float32")
    whole = tmp_path / "whole"
    compute_features(target, (1,), 3, corpus["data"], whole, progress=lambda line: None)
    stopped = tmp_path / "stopped"
    compute_features(target, (1,), 3, corpus["data"], stopped, progress=lambda line: None)
    manifest = json.loads((stopped / "features.json").read_text())  # as if stopped after 5 train documents,
    manifest["finished"] = False  # with a sixth half written after the manifest's last record
    kept = sum(
        len(document_tokens(p.read_text(), target.tokenizer, "<s>assistant: ")[0])
        for p in sorted((corpus["data"] / "train").glob("*.txt"))[:5]
    )
    names = sorted(p.name for p in (corpus["data"] / "train").glob("*.txt"))[:5]
    manifest["splits"] = {"train": {"documents": names, "tokens": kept}, "held_out": {"documents": [], "tokens": 0}}
    (stopped / "features.json").write_text(json.dumps(manifest))
    for file in (stopped / "held_out").iterdir():
        file.write_bytes(b"")
    compute_features(target, (1,), 3, corpus["data"], stopped, progress=lambda line: None)
    for split in ("train", "held_out"):
        for file in (whole / split).iterdir():
            assert file.read_bytes() == (stopped / split / file.name).read_bytes(), file


def test_training_time_test_computes_what_drafting_computes(corpus):
    """Step j's prediction at index t equals the head run as the drafter runs it: the real
    entries 0..t fed through its cache, then j steps each feeding its own last prediction with
    the next true token at the next position."""
    config = load_pretrained(corpus["target"], "float32", load_tokenizer=False).model.config
    torch.manual_seed(3)
    head = EagleHead(head_config(config, intermediate_size=96), (0, 1, 3)).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(5)
    T, steps, H = 40, 4, config.hidden_size
    ids = torch.randint(0, config.vocab_size, (2, T), generator=g)  # [B, T]
    features = torch.randn(2, T, 3 * H, generator=g)  # [B, T, 3H]
    embed = torch.nn.Embedding(config.vocab_size, H)
    with torch.no_grad():
        predictions = ttt_predictions(head, embed, ids, features, steps)  # steps x [B, W, H]
        fused = head.fuse_features(features)  # [B, T, H]
        for t in (0, 7, T - steps - 1):
            cache = head.new_cache(2, T + steps)
            fed = head(embed(ids[:, 1 : t + 2]), fused[:, : t + 1], torch.arange(t + 1).expand(2, -1), cache)
            predicted = fed[:, -1:]  # [B, 1, H]: step 0 at index t
            torch.testing.assert_close(predictions[0][:, t], predicted[:, 0], atol=1e-5, rtol=1e-4)
            for step in range(1, steps):
                position = torch.full((2, 1), t + step)
                predicted = head(embed(ids[:, t + 1 + step : t + 2 + step]), predicted, position, cache)
                torch.testing.assert_close(predictions[step][:, t], predicted[:, 0], atol=1e-5, rtol=1e-4)


def test_a_short_run_teaches_the_head_which_drafts_the_targets_own_output(corpus, tmp_path):
    config = TrainConfig(
        steps=40, batch_size=4, lr=3e-3, eval_every=0, checkpoint_every=0, log_every=0, eval_tokens=256, bf16=False
    )
    eagle3 = Eagle3Config(feature_layers=(0, 1, 3), ttt_steps=3, context=48, output_vocab=64, intermediate_size=96)
    out = tmp_path / "head"
    result = train_eagle3(corpus["target"], corpus["data"], out, config, eagle3)
    first, last = result.first_evaluation, result.last_evaluation
    assert last["held_out_loss_0"] < first["held_out_loss_0"] - 0.5
    assert last["held_out_tau_estimate"] > first["held_out_tau_estimate"]
    head = load_head(out, load_pretrained(corpus["target"], "float32").model.config, torch.float32)
    assert head.feature_layers == (0, 1, 3) and head.config.output_vocab_size == 64
    assert "EAGLE-3" in (out / "README.md").read_text()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(3, seed=31)
    expected = token_ids(
        LLM(str(corpus["target"]), dtype="float32", speculative_method="none").generate(prompts, greedy)
    )
    drafted = LLM(str(corpus["target"]), dtype="float32", speculative_model=str(out), num_speculative_tokens=3)
    outputs = drafted.generate(prompts, greedy)
    assert token_ids(outputs) == expected
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


def test_the_command_line_trains_an_eagle3_head_and_refuses_eagle1_flags(corpus, tmp_path, capsys):
    common = ["train-heads", str(corpus["target"]), "--out", str(tmp_path / "h")]
    assert main([*common, "--eagle3", "--data", str(corpus["data"]), "--feature-weight", "1"]) == 2
    assert "--feature-weight shape an EAGLE-1 head's training" in capsys.readouterr().err
    assert main([*common, "--data", str(corpus["data"])]) == 2
    assert "needs both --eagle3 and --data" in capsys.readouterr().err
    flags = [
        "--eagle3",
        "--data",
        str(corpus["data"]),
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--context",
        "40",
        "--output-vocab",
        "50",
        "--ttt-steps",
        "2",
        "--head-intermediate",
        "64",
        "--feature-layers",
        "1,2",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--eval-tokens",
        "80",
    ]
    assert main([*common, "--text", str(corpus["data"] / "train")]) == 2  # EAGLE-1: --text is not its
    assert "an EAGLE-1 head trains on --corpus" in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 4))
    assert main([*common, *flags, "--text", str(text), "--text-tokens", "30"]) == 0
    assert "held_out_tau_estimate" in capsys.readouterr().out
    saved = json.loads((tmp_path / "h" / "head.json").read_text())
    assert saved["feature_layers"] == [1, 2] and saved["model"]["intermediate_size"] == 64
    log = json.loads((tmp_path / "h" / "training_log.json").read_text())
    assert log["text"] == str(text) and 29 <= log["text_tokens"] <= 30


def test_a_run_from_init_head_starts_where_that_head_ended_and_refuses_another_shape(corpus, tmp_path, capsys):
    """--init-head: the run's first held-out evaluation is the saved head's last (the same
    weights and scored tokens on the same held-out windows); a head of another shape is refused
    by name, and EAGLE-1 training refuses the flag."""
    config = TrainConfig(
        steps=6, batch_size=2, lr=3e-3, eval_every=0, checkpoint_every=0, log_every=0, eval_tokens=96, bf16=False
    )
    eagle3 = Eagle3Config(feature_layers=(0, 2), ttt_steps=2, context=48, output_vocab=40, intermediate_size=64)
    features = tmp_path / "features"
    first = train_eagle3(corpus["target"], corpus["data"], tmp_path / "a", config, eagle3, features, "float32")
    go_on = train_eagle3(
        corpus["target"], corpus["data"], tmp_path / "b", config, eagle3, features, "float32", init_head=tmp_path / "a"
    )
    metrics = [k for k in first.last_evaluation if k.startswith("held_out")]
    assert metrics and {k: go_on.first_evaluation[k] for k in metrics} == pytest.approx(
        {k: first.last_evaluation[k] for k in metrics}, abs=1e-4
    )
    target_config = load_pretrained(corpus["target"], "float32").model.config
    heads = [load_head(tmp_path / name, target_config, torch.float32) for name in ("a", "b")]
    assert torch.equal(heads[0].output_token_ids, heads[1].output_token_ids)
    assert json.loads((tmp_path / "b" / "training_log.json").read_text())["init_head"] == str(tmp_path / "a")
    wider = Eagle3Config(feature_layers=(0, 2), ttt_steps=2, context=48, output_vocab=50, intermediate_size=64)
    with pytest.raises(ValueError, match="another shape: output_vocab_size 40 .this run: 50."):
        train_eagle3(corpus["target"], corpus["data"], tmp_path / "c", config, wider, features, init_head=first.out)
    other_layers = Eagle3Config(feature_layers=(1, 2), ttt_steps=2, context=48, output_vocab=40, intermediate_size=64)
    with pytest.raises(ValueError, match=r"reads the target's layers \[0, 2\], this run \[1, 2\]"):
        train_eagle3(
            corpus["target"], corpus["data"], tmp_path / "d", config, other_layers, tmp_path / "f2", init_head=first.out
        )
    eagle1 = ["train-heads", str(corpus["target"]), "--out", str(tmp_path / "e"), "--init-head", str(tmp_path / "a")]
    assert main(eagle1) == 2
    assert "--init-head starts an EAGLE-3 head's training" in capsys.readouterr().err


def test_documents_a_corpus_gains_are_added_after_the_stored_ones(corpus, tmp_path):
    target = load_pretrained(corpus["target"], "float32")
    growing = tmp_path / "data"
    for split in ("train", "held_out"):
        (growing / split).mkdir(parents=True)
    files = sorted((corpus["data"] / "train").glob("*.txt"))
    for file in files[::2] + sorted((corpus["data"] / "held_out").glob("*.txt"))[:1]:
        (growing / file.parent.name / file.name).write_text(file.read_text())
    compute_features(target, (1,), 3, growing, tmp_path / "f", progress=lambda line: None)
    for file in files[1::2]:
        (growing / "train" / file.name).write_text(file.read_text())
    manifest = compute_features(target, (1,), 3, growing, tmp_path / "f", progress=lambda line: None)
    assert manifest["splits"]["train"]["documents"] == [f.name for f in files[::2] + files[1::2]]
    _, arrays = read_features(tmp_path / "f")
    expected = [
        t
        for f in files[::2] + files[1::2]
        for t in document_tokens(f.read_text(), target.tokenizer, "<s>assistant: ")[0]
    ]
    assert arrays["train"].token_ids.tolist() == expected


def test_a_text_corpus_is_stored_in_pieces_after_the_chat_answers_every_token_drafted(corpus, tmp_path, monkeypatch):
    """--text: a plain text corpus's training documents, shuffled, cut into pieces of at most
    TEXT_PIECE_TOKENS tokens up to --text-tokens in all, stored after the chat documents; every
    position of a piece predicts a token the head learns (none past its end)."""
    monkeypatch.setattr(eagle3, "TEXT_PIECE_TOKENS", 16)
    target = load_pretrained(corpus["target"], "float32")
    rng = random.Random(9)
    (tmp_path / "text").mkdir()
    for i in range(4):  # the last of fewer than ten files is held out: 3 train
        (tmp_path / "text" / f"m{i}.py").write_text(" ".join(rng.choice(WORDS) for _ in range(30)))
    text_corpus = load_corpus(tmp_path / "text")
    pieces = text_pieces(text_corpus, target.tokenizer, 70)
    lengths = [len(piece.tokens()[0]) for piece in pieces]
    assert 69 <= sum(lengths) <= 70 and max(lengths) == 16  # a 1-token rest makes no piece
    assert all(piece.tokens()[1] == 0 for piece in pieces)
    assert all(piece.name.startswith("text:m") for piece in pieces) and "m3.py" not in str([p.name for p in pieces])
    whole = {d.name: target.tokenizer.backend.encode(d.text, add_special_tokens=False).ids for d in text_corpus.train}
    first = pieces[0].name.split(":")[1]
    assert pieces[0].tokens()[0] == whole[first][:16]  # a document's first piece: its first tokens
    manifest = compute_features(
        target, (1,), 3, corpus["data"], tmp_path / "f", progress=lambda line: None, text=pieces
    )
    names = manifest["splits"]["train"]["documents"]
    assert names[:12] == sorted(f.name for f in (corpus["data"] / "train").glob("*.txt"))
    assert names[12:] == [piece.name for piece in pieces]
    _, arrays = read_features(tmp_path / "f")
    train, chat_tokens = arrays["train"], arrays["train"].num_tokens - sum(lengths)
    assert train.token_ids[chat_tokens:].tolist() == [t for piece in pieces for t in piece.tokens()[0]]
    ends = {chat_tokens + sum(lengths[: i + 1]) - 1 for i in range(len(lengths))}  # each piece's last position
    assert train.answer_next[chat_tokens:].tolist() == [t not in ends for t in range(chat_tokens, train.num_tokens)]


# ----------------------------------------------------------------------------- where features go


def files_under(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def command(corpus, out, *more: str) -> list[str]:
    """A short train-heads --eagle3 run's command line."""
    return [
        "train-heads",
        str(corpus["target"]),
        "--eagle3",
        "--data",
        str(corpus["data"]),
        "--out",
        str(out),
        *("--steps", "2", "--batch-size", "2", "--context", "40", "--output-vocab", "40", "--ttt-steps", "2"),
        *("--head-intermediate", "32", "--feature-layers", "1,2", "--eval-every", "0", "--checkpoint-every", "0"),
        *("--eval-tokens", "40", *more),
    ]


def test_features_are_refused_where_they_would_write_into_inputs_or_a_users_directory(corpus, tmp_path, capsys):
    """--features takes the rules of an output directory: never the data, the target or the run's
    output; a non-empty directory of other files only with --force, which writes beside them."""
    before = {name: files_under(corpus[name]) for name in ("data", "target")}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    out = tmp_path / "head"
    refused = [
        (corpus["data"], f"--features '{corpus['data']}' is --data"),
        (corpus["data"] / "train", "lies inside --data"),
        (corpus["target"], f"--features '{corpus['target']}' is TARGET"),
        (out, "is --out"),
        (tmp_path, "holds --out"),
        (mine, "already holds files (notes.txt) that are not an earlier `specdec train-heads --eagle3` run's"),
        (mine / "notes.txt", "is a file"),
    ]
    for features, says in refused:
        assert main(command(corpus, out, "--features", str(features))) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    assert {name: files_under(corpus[name]) for name in ("data", "target")} == before
    assert files_under(mine) == ["notes.txt"] and files_under(tmp_path) == ["mine", "mine/notes.txt"]
    assert main(command(corpus, out, "--features", str(mine), "--force")) == 0
    assert (mine / "notes.txt").read_text() == "my notes" and (mine / "features.json").is_file()
    capsys.readouterr()
    assert main(command(corpus, tmp_path / "again", "--features", str(mine))) == 2  # ours, and the user's file
    assert "and also notes.txt, which that run did not write; move them away, or pass --force" in (
        capsys.readouterr().err
    )
    (mine / "notes.txt").unlink()
    assert main(command(corpus, tmp_path / "again", "--features", str(mine))) == 0  # features of ours alone


def test_an_out_of_dot_is_refused_in_words(corpus, tmp_path, capsys, monkeypatch):
    """--out . (whose default features directory, ./.features, once failed with "PosixPath('.') has
    an empty name") is the current directory, which an output never replaces."""
    monkeypatch.chdir(tmp_path)
    assert main(command(corpus, ".")) == 2
    err = capsys.readouterr().err
    assert "--out '.' is the current directory" in err and "Traceback" not in err
    assert files_under(tmp_path) == []


def test_features_on_a_full_disk_name_their_disk_and_resume(corpus, tmp_path, capsys, monkeypatch):
    """A full disk under --features (on another disk than --out) is said of that disk, in one
    line; the features stored so far are kept and a rerun goes on from them."""
    import errno

    import specdec.output_dir as output_dir

    features, out = tmp_path / "other_disk" / "features", tmp_path / "head"
    free = {str(features): 1000}
    monkeypatch.setattr(output_dir, "free_bytes", lambda path: free.get(str(path), 72_964 * 10**6))
    written = []
    real_write = eagle3._Appender.write

    def write_until_full(self, rows):
        if len(written) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(rows["token_ids"]))
        real_write(self, rows)

    monkeypatch.setattr(eagle3._Appender, "write", write_until_full)
    assert main(command(corpus, out, "--features", str(features))) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: no space left on the disk holding {features} while writing the target's")
    assert "(0.0 MB free)" in lines[0] and "72,964" not in lines[0]
    assert f"kept in {features}: free some space there" in lines[0]
    stored = json.loads((features / "features.json").read_text())["splits"]["train"]["documents"]
    assert len(stored) == 4 and not out.exists()
    monkeypatch.setattr(eagle3._Appender, "write", real_write)
    assert main(command(corpus, out, "--features", str(features))) == 0
    assert "features: 11 documents to read (4 stored)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the tokens a head scores


@pytest.fixture(scope="module")
def reduced_target(corpus, tmp_path_factory):
    """The chat target with an output layer over 100 of its 320 tokens (a distilled draft's kind)."""
    import dataclasses
    import shutil

    from specdec.models.checkpoint import save_pretrained
    from specdec.models.llama import LlamaModel

    full = load_pretrained(corpus["target"], "float32", load_tokenizer=False).model
    scored = torch.arange(0, 300, 3)[:100]  # ascending ids, the end-of-text token 1 not among them
    config = dataclasses.replace(full.config, output_vocab_size=len(scored), tie_word_embeddings=False)
    part = LlamaModel(config)
    state = {name: tensor for name, tensor in full.state_dict().items() if name != "lm_head.weight"}
    part.load_state_dict({**state, "lm_head.weight": full.lm_head.weight[scored], "output_token_ids": scored})
    path = save_pretrained(part, tmp_path_factory.mktemp("reduced") / "target", torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(corpus["target"] / name, path / name)
    return path


def test_a_target_scoring_fewer_tokens_than_the_default_gets_a_head_scoring_all_of_them(
    corpus, reduced_target, tmp_path, capsys
):
    """The default --output-vocab (32,768) past the target's output layer (100 rows of its 320
    tokens) is cut to all of them, said in the log (it was an IndexError); the head drafts for
    that target with its greedy output unchanged. A size the user asks for that cannot be had
    is refused by name."""
    config = TrainConfig(
        steps=4, batch_size=2, eval_every=0, checkpoint_every=0, log_every=0, eval_tokens=96, bf16=False
    )
    eagle3_config = Eagle3Config(feature_layers=(0, 2), ttt_steps=2, context=48, intermediate_size=64)
    out = tmp_path / "head"
    train_eagle3(reduced_target, corpus["data"], out, config, eagle3_config, save_dtype="float32")
    assert "output layer scores 100 tokens of its 320 (output_vocab_size): the head scores all of them" in (
        capsys.readouterr().err
    )
    target_config = load_pretrained(reduced_target, "float32").model.config
    assert load_head(out, target_config, torch.float32).config.output_vocab_size == 0
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(2, seed=33)
    expected = token_ids(LLM(str(reduced_target), dtype="float32", speculative_method="none").generate(prompts, greedy))
    drafted = LLM(str(reduced_target), dtype="float32", speculative_model=str(out), num_speculative_tokens=2)
    assert token_ids(drafted.generate(prompts, greedy)) == expected
    for asked, says in ((50, "scoring only part of a reduced output layer is not supported"), (100, "at most those")):
        with pytest.raises(ValueError, match=says):
            asking = dataclasses.replace(eagle3_config, output_vocab=asked)
            train_eagle3(reduced_target, corpus["data"], tmp_path / f"h{asked}", config, asking)
        assert not (tmp_path / f"h{asked}").exists() and not (tmp_path / f"h{asked}.features").exists()


def test_an_eagle1_head_asking_part_of_a_reduced_output_layer_is_refused(reduced_target, tmp_path):
    """The same limit for an EAGLE-1 head's --output-vocab (it was an IndexError), before any work."""
    from specdec.tools.training.heads import HeadsConfig, train_heads

    config = TrainConfig(steps=1, batch_size=1, eval_every=0, checkpoint_every=0, log_every=0, bf16=False)
    for asked, says in ((50, "scoring only part of a reduced output layer is not supported"), (100, "at most those")):
        with pytest.raises(ValueError, match=says):
            train_heads(reduced_target, tmp_path / "head", config, HeadsConfig(output_vocab=asked))
        assert list(tmp_path.iterdir()) == []
