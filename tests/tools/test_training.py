"""The training recipes: a tiny `specdec train` run writes a directory that specdec and
transformers load alike, its loss falls, an interrupted run resumes exactly; a tiny
`specdec distill` run raises α; bad corpora get clear errors."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from helpers import CORPUS_FILES, stdlib_corpus
from specdec.models.checkpoint import save_pretrained
from specdec.models.loader import ModelLoadError, load_pretrained
from specdec.tools.training.commands import add_distill_parser, add_train_parser
from specdec.tools.training.corpus import (
    END_OF_TEXT,
    HELD_OUT_MODULES,
    Document,
    evaluation_windows,
    load_corpus,
    sample_windows,
    split_held_out,
)
from specdec.tools.training.distill import DistillConfig, acceptance_metrics, divergence_loss, sample_from_target
from specdec.tools.training.loop import TrainConfig, learning_rate
from specdec.tools.training.train import PRESETS, ModelShape, model_shape, new_model, next_token_loss

TINY_RUN = [
    "--preset",
    "tiny",
    "--context",
    "64",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup",
    "4",
    "--eval-tokens",
    "2048",
    "--log-every",
    "10",
    "--device",
    "cpu",
]


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_parser(commands)
    add_distill_parser(commands)
    args = parser.parse_args([str(a) for a in argv])
    return args.run(args)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained_dir(corpus_dir, tmp_path_factory) -> Path:
    """A tiny model trained for 40 steps, saved in float32 in shards of at most 200 kB."""
    out = tmp_path_factory.mktemp("trained")
    assert (
        cli(
            "train",
            "--corpus",
            corpus_dir,
            "--out",
            out,
            *TINY_RUN,
            "--steps",
            "40",
            "--eval-every",
            "20",
            "--checkpoint-every",
            "20",
            "--save-dtype",
            "float32",
            "--max-shard-mb",
            "0.2",
        )
        == 0
    )
    return out


# ---------------------------------------------------------------------------- train


def test_trained_directory_loads_in_specdec_and_transformers_alike(trained_dir, corpus_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_pretrained(trained_dir, "float32")
    theirs = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.model.config.vocab_size, (3, 57), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        our_logits = ours.model(ids, torch.arange(57).expand(3, 57), None)
        their_logits = theirs(ids).logits
    assert (our_logits - their_logits).abs().max() <= 1e-4
    assert our_logits.std() > 0.1  # a trained model, not a constant one

    hf_tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    texts = [(corpus_dir / "types.py").read_text()[:3000], "  x\t= 'é 日本' # <|endoftext|> tail\r\n", "z" * 300]
    for text in texts:
        assert ours.tokenizer.encode(text) == hf_tokenizer(text).input_ids
    eos = ours.tokenizer.token_to_id(END_OF_TEXT)
    config = json.loads((trained_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == eos
    assert json.loads((trained_dir / "generation_config.json").read_text())["eos_token_id"] == eos
    assert ours.eos_token_ids == (eos,) and hf_tokenizer.eos_token_id == eos


def test_trained_directory_is_sharded_within_the_limit(trained_dir):
    index = json.loads((trained_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (trained_dir / "model.safetensors").exists()
    assert all((trained_dir / shard).stat().st_size <= 200_000 for shard in shards)
    assert sorted(p.name for p in trained_dir.glob("model-*.safetensors")) == shards


def test_training_loss_fell(trained_dir):
    log = json.loads((trained_dir / "training_log.json").read_text())
    evaluations = log["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 20, 40] and log["finished"] and log["step"] == 40
    assert evaluations[-1]["held_out_loss"] < evaluations[0]["held_out_loss"] - 0.5
    assert log["train_loss"] < evaluations[0]["held_out_loss"] - 1.0
    assert log["tokens_seen"] == 40 * 8 * 64


def test_model_card_states_the_run(trained_dir, corpus_dir):
    """README.md beside the weights: the command that made them, the corpus and its held-out
    files, steps, tokens, hardware and the held-out loss, all as the log recorded them."""
    from specdec.tools.training.model_card import main as model_card_main

    log = json.loads((trained_dir / "training_log.json").read_text())
    card = (trained_dir / "README.md").read_text()
    assert f"specdec train --batch-size 8 --checkpoint-every 20 --context 64 --corpus {corpus_dir}" in card
    assert "--steps 40" in card and f"--out {trained_dir}" in card
    assert f"{log['tokens_seen']:,} tokens" in card and "seed 0" in card
    assert f"{len(CORPUS_FILES) - len(log['held_out'])} training documents" in card
    assert all(name in card for name in log["held_out"])
    first, last = log["evaluations"][0], log["evaluations"][-1]
    assert f"{first['held_out_loss']:.3f} (step 0) → {last['held_out_loss']:.3f} (step 40)" in card
    assert log["cpu"] in card
    assert "Python code" not in card and "Python Software Foundation" not in card  # not the standard library
    assert model_card_main([str(trained_dir), "--moved", f"{trained_dir}=models/tiny"]) == 0
    moved = (trained_dir / "README.md").read_text()
    assert "--out models/tiny" in moved
    assert f"Copied after the run: `{trained_dir}` to `models/tiny` (the command above names the new places)" in moved


def test_interrupted_run_resumes_where_it_stopped(corpus_dir, tmp_path):
    run = [
        "--corpus",
        corpus_dir,
        *TINY_RUN,
        "--steps",
        "20",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "10",
        "--seed",
        "5",
    ]
    assert cli("train", *run, "--out", tmp_path / "whole") == 0
    assert cli("train", *run, "--out", tmp_path / "split", "--stop-after", "10") == 0  # the 'interruption'
    staging = tmp_path / "split.incomplete"  # an unfinished run stays beside --out, which it leaves untouched
    halfway = torch.load(staging / "checkpoint" / "last.pt", weights_only=True)
    assert halfway["state"]["step"] == 10 and not (tmp_path / "split").exists()
    assert not (staging / "training_log.json").exists()  # a stopped session's log stays with its checkpoint
    assert not json.loads((staging / "checkpoint" / "training_log.json").read_text())["finished"]
    with pytest.raises(ModelLoadError, match="unfinished output of a `specdec train` run"):
        load_pretrained(staging)
    assert cli("train", *run, "--out", tmp_path / "split", "--resume") == 0
    assert not staging.exists()

    whole, split = (json.loads((tmp_path / name / "training_log.json").read_text()) for name in ("whole", "split"))
    assert split["step"] == 20 and split["tokens_seen"] == whole["tokens_seen"]
    assert split["evaluations"] == whole["evaluations"]  # steps 0, 10, 20: step 0 not evaluated again
    final = [torch.load(tmp_path / name / "checkpoint" / "last.pt", weights_only=True) for name in ("whole", "split")]
    assert final[0]["state"]["losses"] == final[1]["state"]["losses"]
    for name, tensor in final[0]["model"].items():
        assert torch.equal(tensor, final[1]["model"][name]), name

    with pytest.raises(ValueError, match="lr"):  # other settings cannot silently continue the run
        cli("train", *run, "--out", tmp_path / "split", "--lr", "1e-3")


def test_train_init_goes_on_from_a_trained_model(trained_dir, corpus_dir, tmp_path):
    """--init: the first evaluation is the trained model's last (float32 weights, the same
    held-out windows), training goes on lowering it, and the card names both runs."""
    out = tmp_path / "continued"
    run = [
        "--corpus",
        corpus_dir,
        "--batch-size",
        "8",
        "--lr",
        "1e-3",
        "--warmup",
        "2",
        "--eval-tokens",
        "2048",
        "--device",
        "cpu",
        "--steps",
        "20",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--save-dtype",
        "float32",
    ]
    assert cli("train", "--init", trained_dir, "--out", out, *run) == 0
    first_run = json.loads((trained_dir / "training_log.json").read_text())
    log = json.loads((out / "training_log.json").read_text())
    start, end = log["evaluations"][0], log["evaluations"][-1]
    assert start["held_out_loss"] == pytest.approx(first_run["evaluations"][-1]["held_out_loss"], abs=1e-4)
    assert end["step"] == 20 and end["held_out_loss"] < start["held_out_loss"]
    assert (out / "tokenizer.json").read_text() == (trained_dir / "tokenizer.json").read_text()
    assert json.loads((out / "config.json").read_text())["hidden_size"] == PRESETS["tiny"].hidden_size
    card = (out / "README.md").read_text()
    assert "2 runs, in this order" in card and f"--init {trained_dir} " in card and "the model of an earlier" in card
    assert log["init_log"]["step"] == 40

    with pytest.raises(ValueError, match="--init takes the model's size"):
        cli("train", "--init", trained_dir, "--out", tmp_path / "sized", *run, "--preset", "tiny")


def test_train_reusing_a_tokenizer_shares_its_vocabulary(trained_dir, corpus_dir, tmp_path):
    out = tmp_path / "draft"
    assert (
        cli(
            "train",
            "--corpus",
            corpus_dir,
            "--out",
            out,
            "--tokenizer",
            trained_dir,
            *TINY_RUN,
            "--hidden-size",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
        )
        == 0
    )
    assert (out / "tokenizer.json").read_text() == (trained_dir / "tokenizer.json").read_text()
    target_config, draft_config = (json.loads((p / "config.json").read_text()) for p in (trained_dir, out))
    assert draft_config["vocab_size"] == target_config["vocab_size"]
    assert draft_config["eos_token_id"] == target_config["eos_token_id"]
    assert draft_config["torch_dtype"] == "bfloat16" and (out / "model.safetensors").is_file()


# ---------------------------------------------------------------------------- distill


def test_distill_raises_acceptance(trained_dir, corpus_dir, tmp_path):
    from specdec import LLM, SamplingParams

    out = tmp_path / "distilled"
    assert (
        cli(
            "distill",
            "--target",
            trained_dir,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            *TINY_RUN,
            "--hidden-size",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--intermediate-size",
            "64",
            "--steps",
            "30",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--on-policy-fraction",
            "0.25",
            "--sample-temperature",
            "0",
            "--prompt-tokens",
            "8",
        )
        == 0
    )
    log = json.loads((out / "training_log.json").read_text())
    before, after = log["evaluations"][0], log["evaluations"][-1]
    assert after["step"] == 30
    assert after["held_out_alpha"] > before["held_out_alpha"] + 0.05
    assert abs(after["held_out_alpha"] + after["held_out_tv"] - 1) < 1e-6
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (trained_dir / name).read_bytes()
    shards = b"".join(f.read_bytes() for f in sorted(trained_dir.glob("model-*-of-*.safetensors")))
    weights = hashlib.sha256(shards).hexdigest()[:16]
    assert log["target_sha256"] == weights and f"sha256 `{weights}`" in (out / "README.md").read_text()

    llm = LLM(
        str(trained_dir),
        speculative_model=str(out),
        num_speculative_tokens=3,
        dtype="float32",
        speculative_k_policy="fixed",
    )  # α of every round, whether or not drafting pays
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    speculative = llm.generate("def copy(x):\n", params)[0]
    alone = llm.target_only().generate("def copy(x):\n", params)[0]
    assert speculative.outputs[0].token_ids == alone.outputs[0].token_ids
    assert speculative.metrics.num_draft_tokens > 0  # the draft did propose

    # a second run continuing from this draft (--init): its card names both runs, in order
    continued = tmp_path / "continued"
    assert (
        cli(
            "distill",
            "--target",
            trained_dir,
            "--init",
            out,
            "--out",
            continued,
            "--corpus",
            corpus_dir,
            "--batch-size",
            "8",
            "--eval-tokens",
            "2048",
            "--steps",
            "3",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
        )
        == 0
    )
    card = (continued / "README.md").read_text()
    first_command, second_command = f"--out {out} ", f"--init {out} "
    assert first_command in card and second_command in card
    assert card.index(first_command) < card.index(second_command) and "started from" in card
    assert "other weights of the target" not in card and "not record" not in card  # both runs: the same target
    assert f"{before['held_out_alpha']:.3f} (step 0 of the first run)" in card  # the evaluation spans both runs

    # --out the --init draft itself: refused before anything is written, the draft intact
    before_files = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    with pytest.raises(ValueError, match="is --init .*: writing there would destroy it"):
        cli(
            "distill",
            "--target",
            trained_dir,
            "--init",
            out,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            "--batch-size",
            "8",
            "--eval-tokens",
            "2048",
            "--steps",
            "2",
            "--force",
        )
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before_files
    assert not (tmp_path / "distilled.incomplete").exists()

    with pytest.raises(ValueError, match="drop --preset"):
        cli("distill", "--target", trained_dir, "--init", out, "--out", tmp_path / "x", "--preset", "target")
    with pytest.raises(ValueError, match="vocab-size"):
        cli("distill", "--target", trained_dir, "--out", tmp_path / "x", "--vocab-size", "4000")
    assert not (tmp_path / "x").exists()


def test_embeddings_from_target_are_its_best_low_rank_geometry():
    """The projected embedding P [V, h] keeps the target's embedding E [V, H] where it matters
    for both lookups and a tied output layer: P Pᵀ is, up to the scale, E Eᵀ's best rank-h
    approximation, whose error is the discarded singular values (Eckart-Young; numpy's SVD)."""
    import numpy as np

    from specdec.models.llama import ModelConfig
    from specdec.tools.training.distill import project_embeddings
    from specdec.tools.training.train import new_model

    shape = dict(vocab_size=200, num_layers=1, num_kv_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    target = new_model(ModelConfig(hidden_size=48, intermediate_size=64, num_heads=2, head_dim=24, **shape), seed=1)
    draft = new_model(ModelConfig(hidden_size=16, intermediate_size=32, num_heads=2, head_dim=8, **shape), seed=2)
    with torch.no_grad():
        target.embed_tokens.weight.mul_(torch.linspace(0.2, 3.0, 48))  # a spread of directions to choose from
    std_before = float(draft.embed_tokens.weight.std())
    project_embeddings(target, draft)
    embedding = target.embed_tokens.weight.detach().double().numpy()
    projected = draft.embed_tokens.weight.detach().double().numpy()
    assert draft.lm_head.weight is draft.embed_tokens.weight  # the tied output layer moves with it
    assert abs(projected.std() - std_before) < 1e-3 * std_before
    gram, low_rank = embedding @ embedding.T, projected @ projected.T
    scale = np.sum(gram * low_rank) / np.sum(low_rank * low_rank)  # the least-squares scale
    singular = np.linalg.svd(embedding, compute_uv=False)
    best_error = np.sqrt(np.sum(singular[16:] ** 4))
    assert abs(np.linalg.norm(gram - scale * low_rank) - best_error) < 1e-6 * np.linalg.norm(gram)
    with pytest.raises(ValueError, match="hidden size 48 is wider"):
        project_embeddings(draft, target)


def test_frequent_tokens_are_the_most_common_ids():
    from collections import Counter

    from specdec.tools.training.distill import frequent_share, frequent_tokens

    stream = torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(3)) ** 2 % 97  # uneven counts
    counts = Counter(stream.tolist())
    expected = sorted(sorted(counts, key=lambda token: (-counts[token], token))[:10])
    assert frequent_tokens(stream, 97, 10).tolist() == expected
    with_rare = frequent_tokens(stream, 97, 10, always=(96,))  # 96 never occurs: it displaces the 10th
    assert 96 in with_rare.tolist() and len(with_rare) == 10 and set(expected) - set(with_rare.tolist())
    assert abs(frequent_share(stream, torch.tensor(expected)) - sum(counts[t] for t in expected) / 2000) < 1e-12
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        frequent_tokens(stream, 97, 98)


def test_distill_a_draft_over_part_of_the_vocabulary(trained_dir, corpus_dir, tmp_path):
    """--output-vocab N: the draft's output layer scores the N most frequent training tokens
    (EOS among them), distillation raises α, and speculation with it stays exact."""
    from specdec import LLM, SamplingParams
    from specdec.models.loader import load_pretrained

    out = tmp_path / "part"
    assert (
        cli(
            "distill",
            "--target",
            trained_dir,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            *TINY_RUN,
            "--hidden-size",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--intermediate-size",
            "64",
            "--steps",
            "30",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--output-vocab",
            "200",
            "--embeddings-from-target",
            "--on-policy-fraction",
            "0.25",
            "--sample-temperature",
            "0",
            "--prompt-tokens",
            "8",
        )
        == 0
    )
    log = json.loads((out / "training_log.json").read_text())
    assert log["evaluations"][-1]["held_out_alpha"] > log["evaluations"][0]["held_out_alpha"] + 0.05
    draft = load_pretrained(out, "float32")
    assert draft.model.config.output_vocab_size == 200 and not draft.model.config.tie_word_embeddings
    assert draft.eos_token_ids[0] in draft.model.output_token_ids.tolist()
    assert "output layer scores the 200 tokens most frequent" in (out / "README.md").read_text()
    llm = LLM(
        str(trained_dir),
        speculative_model=str(out),
        num_speculative_tokens=3,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    speculative = llm.generate("def copy(x):\n", params)[0]
    assert (
        speculative.outputs[0].token_ids == llm.target_only().generate("def copy(x):\n", params)[0].outputs[0].token_ids
    )
    assert speculative.metrics.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="--output-vocab shapes a new draft"):
        cli("distill", "--target", trained_dir, "--init", out, "--out", tmp_path / "x", "--output-vocab", "10")


def test_a_model_trained_then_distilled_gets_a_card_for_both(trained_dir, corpus_dir, tmp_path):
    """--init across kinds: a `train` model distilled further. The train run measured no α, so
    the card's α starts at the distillation's first evaluation."""
    out = tmp_path / "distilled"
    assert (
        cli(
            "distill",
            "--target",
            trained_dir,
            "--init",
            trained_dir,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            "--batch-size",
            "8",
            "--eval-tokens",
            "2048",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
        )
        == 0
    )
    log, card = json.loads((out / "training_log.json").read_text()), (out / "README.md").read_text()
    first, last = log["evaluations"][0], log["evaluations"][-1]
    assert "2 runs, in this order" in card
    assert f"α = 1 − TV {first['held_out_alpha']:.3f} (step 0 of the last) → {last['held_out_alpha']:.3f}" in card


def test_model_card_names_runs_distilled_from_other_target_weights():
    """A draft continued across a change of its target (the target trained further, say):
    the card says which runs saw other target weights, or did not record them."""
    from specdec.tools.training.model_card import _target_history

    runs = [{}, {"target_sha256": "aa"}, {"target_sha256": "aa"}, {"target_sha256": "bb"}]
    paragraph = _target_history(runs)[0]
    assert paragraph.startswith("Runs 2 and 3 distilled from other weights of the target than the last run's.")
    assert "Run 1 does not record which weights of the target it distilled from" in paragraph
    assert _target_history(runs[3:]) == [] and _target_history(runs[1:3]) == []
    assert _target_history([{}, {}]) == [
        "No run records which weights of the target it distilled from (the record came later).",
        "",
    ]


def test_acceptance_is_one_minus_total_variation():
    generator = torch.Generator().manual_seed(3)
    draft_logits, target_logits = (torch.randn(2, 5, 40, generator=generator) * 3 for _ in range(2))
    metrics = acceptance_metrics(draft_logits, target_logits, temperature=1.0)
    alpha = torch.minimum(draft_logits.softmax(-1), target_logits.softmax(-1)).sum(-1).mean()
    assert abs(metrics["held_out_alpha"] - float(alpha)) < 1e-6
    same = acceptance_metrics(target_logits, target_logits, temperature=0.7)
    assert abs(same["held_out_alpha"] - 1) < 1e-6 and same["held_out_greedy_agreement"] == 1.0
    softened = acceptance_metrics(draft_logits, target_logits, temperature=0.7)  # both distributions at T = 0.7
    alpha_07 = torch.minimum((draft_logits / 0.7).softmax(-1), (target_logits / 0.7).softmax(-1)).sum(-1).mean()
    assert abs(softened["held_out_alpha"] - float(alpha_07)) < 1e-6 and abs(float(alpha_07) - float(alpha)) > 0.01
    tv_07 = divergence_loss(draft_logits, target_logits, 0.7, "tv")
    assert abs(float(tv_07) - (1 - float(alpha_07))) < 1e-5
    for divergence in ("tv", "fkl", "fkl+tv"):
        assert divergence_loss(target_logits, target_logits, 1.0, divergence).abs() < 1e-5
        assert divergence_loss(draft_logits, target_logits, 1.0, divergence) > 0.1
    tv = divergence_loss(draft_logits, target_logits, 1.0, "tv")
    assert abs(float(tv) - (1 - float(alpha))) < 1e-5


# ---------------------------------------------------------------------------- corpus


def test_default_corpus_is_the_standard_library_with_fixed_held_out_modules():
    corpus = load_corpus()
    train_names = {d.name for d in corpus.train}
    assert sorted(d.name for d in corpus.held_out) == sorted(HELD_OUT_MODULES)
    assert not train_names & set(HELD_OUT_MODULES)
    assert "os.py" in train_names and "json/decoder.py" in train_names
    excluded = ("site-packages", "test", "tests", "idle_test")
    assert not any(part in excluded for name in train_names for part in name.split("/")[:-1])
    assert sum(len(d.text) for d in corpus.train) > 5_000_000


def test_corpus_errors_are_clear(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "blank.txt")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).tolist()))
    with pytest.raises(ValueError, match="not text") as error:
        load_corpus(binary)
    assert str(binary) in str(error.value)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not text"):
        load_corpus(latin1)
    (tmp_path / "only_binary").mkdir()
    shutil.copyfile(binary, tmp_path / "only_binary" / "a.bin")
    with pytest.raises(ValueError, match="empty.*1 files skipped"):
        load_corpus(tmp_path / "only_binary")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="does not exist"):  # through the command, before writing anything
        cli("train", "--corpus", missing, "--out", out, *TINY_RUN)
    assert not out.exists()


def test_held_out_split_of_other_corpora(tmp_path):
    documents = [Document(f"f{i:02d}.txt", f"text {i}\n") for i in range(23)]
    train_docs, held_out = split_held_out(documents)
    assert [d.name for d in held_out] == ["f09.txt", "f19.txt"] and len(train_docs) == 21
    train_docs, held_out = split_held_out(documents[:3])
    assert [d.name for d in held_out] == ["f02.txt"]
    named_like_held_out = [Document("queue.py", "a = 1\n"), Document("glob.py", "b = 2\n")]
    train_docs, held_out = split_held_out(named_like_held_out)  # all of them: not the stdlib rule
    assert [d.name for d in train_docs] == ["queue.py"] and [d.name for d in held_out] == ["glob.py"]
    with_directory = [
        Document("train/a.txt", "a\n"),
        Document("held_out/b.txt", "b\n"),
        Document("glob.py", "c\n"),
        Document("held_outside.txt", "d\n"),
    ]
    train_docs, held_out = split_held_out(with_directory)  # held_out/ wins over the names
    assert [d.name for d in held_out] == ["held_out/b.txt"] and len(train_docs) == 3
    lines = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "one.txt").write_text(lines)
    corpus = load_corpus(tmp_path / "one.txt")
    assert corpus.train[0].text + corpus.held_out[0].text == lines
    assert corpus.held_out[0].text.startswith("line 9") and corpus.train[0].text.endswith("\n")


def test_windows_are_slices_of_the_stream():
    stream = torch.randperm(1000, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    windows = sample_windows(stream, 6, 31, torch.Generator().manual_seed(4))
    assert windows.shape == (6, 32) and windows.dtype == torch.int64
    for row in windows:
        start = int((stream == row[0]).nonzero())
        assert torch.equal(row, stream[start : start + 32].long())
    held = evaluation_windows(stream, 100, max_tokens=450)
    assert held.shape == (4, 101) and torch.equal(held[1], stream[100:201].long())
    assert evaluation_windows(stream[:20], 100, 450).shape == (1, 20)


# ---------------------------------------------------------------------------- configuration


def test_presets_sizes():
    target, draft, tiny = (PRESETS[name].model_config().num_parameters for name in ("target", "draft", "tiny"))
    assert 20e6 <= target <= 25e6 and target >= 10 * draft and 1e5 <= tiny <= 1e6
    assert PRESETS["target"].vocab_size == PRESETS["draft"].vocab_size
    model = new_model(PRESETS["tiny"].model_config(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny"].model_config().num_parameters
    assert model_shape("draft", context=256).context == 256


def test_configuration_errors_are_clear():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="CUDA|device"):
        TrainConfig(device="cuda:7" if torch.cuda.is_available() else "cuda")
    with pytest.raises(ValueError, match="num_kv_heads"):
        model_shape("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="preset"):
        model_shape("huge")
    with pytest.raises(ValueError, match="missing"):
        model_shape(None, hidden_size=64)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShape(
            vocab_size=100, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, context=32
        )
    with pytest.raises(ValueError, match="on_policy_fraction"):
        DistillConfig(on_policy_fraction=1.5)
    with pytest.raises(ValueError, match="divergence"):
        DistillConfig(divergence="reverse")
    with pytest.raises(ValueError, match="sample_temperature"):
        DistillConfig(sample_temperature=-0.5)
    with pytest.raises(ValueError, match="temperature"):
        DistillConfig(temperature=float("inf"))  # α would read 1 and the loss 0: nothing learned
    with pytest.raises(ValueError, match="warmup 50 must be fewer"):
        TrainConfig(steps=50, warmup=50)
    assert TrainConfig(steps=50).warmup == 5 and TrainConfig(steps=5000).warmup == 100  # a tenth, at most 100


def test_on_policy_text_at_temperature_zero_is_the_targets_greedy_text():
    """Each sampled token is the argmax of a cache-free forward over the text before it."""
    model = new_model(PRESETS["tiny"].model_config(), seed=5).eval()
    prompt = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(11))
    text = sample_from_target(model, prompt, 12, 0.0, torch.Generator().manual_seed(0))  # [3, 12]
    assert torch.equal(text[:, :4], prompt)
    positions = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        logits = model(text, positions, None)  # [3, 12, V]
    assert torch.equal(text[:, 4:], logits[:, 3:-1].argmax(-1))
    sampled = sample_from_target(model, prompt, 12, 1.0, torch.Generator().manual_seed(0))
    assert not torch.equal(sampled, text)  # a random tiny model's samples are not its greedy text


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    rates = [learning_rate(step, config) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert learning_rate(100, config) == pytest.approx(1e-4)
    for offset in (30, 45, 60):  # a cosine between warm-up's end (step 10) and step 100
        fraction = offset / 90
        cosine = 0.5 * (1 + math.cos(math.pi * fraction))
        assert learning_rate(10 + offset, config) == pytest.approx(1e-4 + 9e-4 * cosine)


class _GradientRecorder:
    """Stands in for the optimizer: records the gradients train_step hands it."""

    def __init__(self, model):
        self.model, self.param_groups, self.gradients = model, [{}], None

    def step(self):
        self.gradients = torch.cat([p.grad.flatten() for p in self.model.parameters()])

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def test_gradient_accumulation_averages_like_one_big_batch():
    """grad_accum=2 of 4 windows each: the same loss and gradients as one batch of the same 8."""
    from specdec.tools.training.loop import Task, train_step

    windows = torch.randint(0, 300, (8, 17), generator=torch.Generator().manual_seed(8))
    losses, gradients = [], []
    for grad_accum, batch_size in ((1, 8), (2, 4)):
        config = TrainConfig(steps=10, batch_size=batch_size, grad_accum=grad_accum, bf16=False, grad_clip=1e9)
        model = new_model(PRESETS["tiny"].model_config(), seed=3)
        batches = iter(windows.split(batch_size))
        task = Task(
            model, lambda generator, batches=batches: next(batches), next_token_loss, lambda m: {}, batch_size * 16, {}
        )
        recorder = _GradientRecorder(model)
        losses.append(train_step(task, recorder, config, torch.Generator(), contextlib.nullcontext(), 1e-3))
        gradients.append(recorder.gradients)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-4, atol=1e-7)


def test_save_pretrained_shards_only_when_needed(tmp_path):
    model = new_model(PRESETS["tiny"].model_config(), seed=9)
    single = save_pretrained(model, tmp_path / "single", torch.bfloat16)
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()
    sharded = save_pretrained(model, tmp_path / "single", torch.bfloat16, max_shard_bytes=100_000)
    assert not (sharded / "model.safetensors").exists()  # the earlier single file was replaced
    files = sorted(sharded.glob("model-*.safetensors"))
    assert len(files) >= 4 and all(f.stat().st_size <= 100_000 for f in files)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(8))
    loaded = load_pretrained(sharded, "float32", load_tokenizer=False).model
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())  # what a bfloat16 save keeps
        expected = model(ids, torch.arange(30)[None], None)
        assert torch.allclose(loaded(ids, torch.arange(30)[None], None), expected, atol=1e-5)


def test_bf16_autocast_only_where_bfloat16_is_native(monkeypatch, capsys):
    """--precision bf16 (the default) trains under bfloat16 autocast on a CPU that runs it
    natively, and in float32, with a note, where bfloat16 matmuls would be emulated."""
    import contextlib

    import specdec.platform
    from specdec.platform import Platform
    from specdec.tools.training.loop import TrainConfig, _autocast

    for native in (True, False):
        monkeypatch.setattr(
            specdec.platform,
            "detect_platform",
            lambda device, native=native: Platform("cpu", "AVX2", native_bf16=native, native_fp16=False),
        )
        autocast = _autocast(TrainConfig(), torch.device("cpu"))
        assert isinstance(autocast, torch.autocast) == native
        assert ("bfloat16 is emulated" in capsys.readouterr().err) == (not native)
    assert isinstance(_autocast(TrainConfig(bf16=False), torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("divergence", ["fkl+tv", "tv", "fkl"])
def test_the_scored_tokens_loss_equals_the_full_vocabulary_loss(divergence):
    """A draft over part of the vocabulary: the loss computed over its scored tokens equals
    divergence_loss over the whole vocabulary with the other tokens' logits at -inf, and so do
    their gradients."""
    from specdec.tools.training.distill import divergence_loss, scored_divergence_loss

    g = torch.Generator().manual_seed(11)
    V, scored = 300, torch.randperm(300, generator=g)[:40].sort().values
    target_logits = torch.randn(2, 5, V, generator=g) * 3
    target_logits[..., scored] += 2  # the scored tokens hold most, not all, of the target's mass
    draft_scores = (torch.randn(2, 5, 40, generator=g) * 2).requires_grad_(True)
    full = torch.full((2, 5, V), float("-inf")).index_copy(-1, scored, draft_scores)
    expected = divergence_loss(full, target_logits, 0.8, divergence)
    got = scored_divergence_loss(draft_scores, target_logits, scored, 0.8, divergence)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    (expected_grad,) = torch.autograd.grad(expected, draft_scores)
    (got_grad,) = torch.autograd.grad(got, draft_scores)
    assert torch.allclose(got_grad, expected_grad, rtol=1e-4, atol=1e-7)
