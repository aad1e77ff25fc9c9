"""`specdec train-heads`: a few dozen steps raise a head's held-out greedy agreement with its
target; the head directory drafts for that target (greedy output the target's own, most drafts
accepted, where an untrained head's are not); an interrupted run resumes exactly; the loss is
EAGLE's; bad input is refused before anything is written."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from helpers import save_tiny_model, stdlib_corpus
from specdec.models.eagle import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    EagleHead,
    head_config,
    load_head,
    read_head_config,
    save_head,
)
from specdec.models.loader import ModelLoadError, load_pretrained
from specdec.tools.training.commands import add_restrict_head_parser, add_train_heads_parser, add_train_parser
from specdec.tools.training.heads import HeadsConfig, add_noise, head_loss, new_head

TINY_HEADS = [
    "--context",
    "32",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup",
    "4",
    "--eval-tokens",
    "1024",
    "--log-every",
    "10",
    "--device",
    "cpu",
    "--prompt-tokens",
    "8",
]


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_parser(commands)
    add_train_heads_parser(commands)
    add_restrict_head_parser(commands)
    args = parser.parse_args([str(a) for a in argv])
    return args.run(args)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def target_dir(corpus_dir, tmp_path_factory):
    """A tiny target trained for 40 steps by `specdec train`: its text has the structure a head
    can follow (a random model's next token is a chaotic function of its whole context, which no
    one-layer head predicts, trained or not)."""
    out = tmp_path_factory.mktemp("target") / "target"
    assert (
        cli(
            "train",
            "--corpus",
            corpus_dir,
            "--out",
            out,
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
            "--device",
            "cpu",
            "--steps",
            "40",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--save-dtype",
            "float32",
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def head_dir(target_dir, corpus_dir, tmp_path_factory):
    """A head trained for 40 steps (the default data: the target's own text, greedy or at 0.8)."""
    out = tmp_path_factory.mktemp("heads") / "head"
    assert (
        cli(
            "train-heads",
            target_dir,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            *TINY_HEADS,
            "--steps",
            "40",
            "--eval-every",
            "20",
            "--checkpoint-every",
            "0",
            "--save-dtype",
            "float32",
        )
        == 0
    )
    return out


def test_training_raises_the_held_out_greedy_agreement(head_dir, target_dir, corpus_dir):
    log = json.loads((head_dir / "training_log.json").read_text())
    evaluations = log["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 20, 40] and log["finished"] and log["kind"] == "train-heads"
    before, after = evaluations[0], evaluations[-1]
    assert before["held_out_greedy_agreement"] < 0.1 and after["held_out_greedy_agreement"] > 0.5
    assert after["held_out_alpha"] > before["held_out_alpha"] + 0.2
    assert after["held_out_feature_loss"] < 0.5 * before["held_out_feature_loss"]
    assert abs(after["held_out_alpha"] + after["held_out_tv"] - 1) < 1e-6
    assert log["tokens_seen"] == 40 * 8 * 32

    head_json = json.loads((head_dir / HEAD_CONFIG).read_text())
    assert head_json["target"] == str(target_dir.resolve()) and head_json["torch_dtype"] == "float32"
    assert head_json["training"]["steps"] == 40 and head_json["training"]["last_evaluation"] == after
    assert head_json["target_sha256"] == log["target_sha256"]
    assert sorted(p.name for p in head_dir.iterdir()) == [
        "README.md",
        "checkpoint",
        HEAD_CONFIG,
        HEAD_WEIGHTS,
        "training_log.json",
    ]

    card = (head_dir / "README.md").read_text()
    assert (
        f"specdec train-heads {target_dir} --batch-size 8 --checkpoint-every 0 --context 32 --corpus {corpus_dir}"
        in card
    )
    assert (
        f"greedy agreement {before['held_out_greedy_agreement']:.3f} → {after['held_out_greedy_agreement']:.3f}" in card
    )
    assert "40 steps of 8 windows" in card and f"sha256 `{log['target_sha256']}`" in card


def test_the_checkpoint_holds_the_head_only(head_dir):
    """The frozen target is neither optimised nor saved: the checkpoint's weights and optimizer
    state are the head's alone."""
    checkpoint = torch.load(head_dir / "checkpoint" / "last.pt", weights_only=True)
    head_keys = set(EagleHead(*read_head_config(head_dir)).state_dict())
    assert set(checkpoint["model"]) == head_keys
    assert len(checkpoint["optimizer"]["state"]) == len(head_keys)  # one AdamW state per head parameter


def test_the_head_drafts_for_its_target(head_dir, target_dir, tmp_path):
    """Through LLM(..., speculative_method="eagle"): greedy output is the target's own (verification
    guarantees it), and the trained head's drafts are mostly accepted where an untrained head's
    (the initial head of the run) are not: training and drafting feed the head alike."""
    from specdec import LLM, SamplingParams

    target_config = load_pretrained(target_dir, "float32", load_tokenizer=False).model.config
    head = load_head(head_dir, target_config, torch.float32)
    assert isinstance(head, EagleHead) and head.config == head_config(target_config)
    untrained = save_head(new_head(head_config(target_config), seed=0), tmp_path / "untrained", torch.float32)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def copy(x):\n", "class Point:\n    def __init__(self", "import os\n"]
    plain = LLM(str(target_dir), dtype="float32", speculative_method="none")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    acceptance = {}
    for name, directory in (("trained", head_dir), ("untrained", untrained)):
        llm = LLM(
            str(target_dir),
            speculative_model=str(directory),
            speculative_method="eagle",
            dtype="float32",
            num_speculative_tokens=3,
            speculative_k_policy="fixed",
        )
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected, name
        proposed = sum(o.metrics.num_draft_tokens for o in outputs)
        acceptance[name] = sum(o.metrics.num_accepted_tokens for o in outputs) / proposed
    assert acceptance["trained"] > 0.3 and acceptance["untrained"] < 0.05, acceptance


def test_training_feeds_the_head_as_drafting_does(target_dir):
    """drafters/eagle.py feeds the head, one entry per position p through its cache, the
    target's feature f_p with the token p+1 after it; training's causal pass over a window reads
    the same entries at the same positions, so it predicts the same features."""
    from specdec.tools.training.heads import predict_features, target_features

    target = load_pretrained(target_dir, "float32", load_tokenizer=False).model
    head = new_head(head_config(target.config), seed=3).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in head.parameters():  # larger weights than a new head's: attention over the entries matters
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    token_ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        features = target_features(target, token_ids)  # [2, 12, H]
        trained_way = predict_features(head, target, token_ids, features[:, :-1])  # [2, 11, H]
        cache = head.new_cache(2, 12)
        drafted_way = torch.cat(
            [
                head(
                    target.embed_tokens(token_ids[:, p + 1 : p + 2]),
                    features[:, p : p + 1],
                    torch.full((2, 1), p),
                    cache,
                )
                for p in range(11)
            ],
            dim=1,
        )  # [2, 11, H]
    torch.testing.assert_close(trained_way, drafted_way, atol=1e-5, rtol=1e-4)


def test_an_interrupted_run_resumes_where_it_stopped(target_dir, corpus_dir, tmp_path):
    """Stopped at step 4 and rerun, a run ends with the same weights as one never stopped: the
    same text (half of it the target's, at either temperature) and the same noise."""
    run = [
        target_dir,
        "--corpus",
        corpus_dir,
        *TINY_HEADS,
        "--steps",
        "8",
        "--eval-every",
        "4",
        "--checkpoint-every",
        "4",
        "--on-policy-fraction",
        "0.5",
        "--seed",
        "5",
        "--save-dtype",
        "float32",
    ]
    assert cli("train-heads", *run, "--out", tmp_path / "whole") == 0
    assert cli("train-heads", *run, "--out", tmp_path / "split", "--stop-after", "4") == 0
    staging = tmp_path / "split.incomplete"
    assert torch.load(staging / "checkpoint" / "last.pt", weights_only=True)["state"]["step"] == 4
    assert not (tmp_path / "split").exists() and not (staging / HEAD_WEIGHTS).exists()
    assert not json.loads((staging / "checkpoint" / "training_log.json").read_text())["finished"]
    assert cli("train-heads", *run, "--out", tmp_path / "split", "--resume") == 0
    assert not staging.exists()

    whole, split = (json.loads((tmp_path / name / "training_log.json").read_text()) for name in ("whole", "split"))
    assert split["evaluations"] == whole["evaluations"] and split["tokens_seen"] == whole["tokens_seen"]
    final = [torch.load(tmp_path / name / "checkpoint" / "last.pt", weights_only=True) for name in ("whole", "split")]
    assert final[0]["state"]["losses"] == final[1]["state"]["losses"]
    for name, tensor in final[0]["model"].items():
        assert torch.equal(tensor, final[1]["model"][name]), name
    assert (tmp_path / "whole" / HEAD_WEIGHTS).read_bytes() == (tmp_path / "split" / HEAD_WEIGHTS).read_bytes()

    with pytest.raises(ValueError, match="differs in heads"):  # another loss cannot silently continue the run
        cli("train-heads", *run, "--out", tmp_path / "split", "--token-weight", "0.5", "--steps", "10")


def test_the_loss_is_eagles_and_the_noise_is_bounded():
    """head_loss = feature_weight · smooth L1 + token_weight · KL(p ‖ q), p and q through the
    target's output layer; 0 for a perfect prediction. The noise lies within ± feature_noise ×
    the features' root mean square, and a seed draws the same noise again."""
    from specdec.models.llama import ModelConfig
    from specdec.tools.training.train import new_model

    config = ModelConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    target = new_model(config, seed=2).requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    features = torch.randn(2, 7, 32, generator=g) * 1.5  # [B, T-1, H]
    predicted = features + 0.4 * torch.randn(2, 7, 32, generator=g)
    heads_config = HeadsConfig(feature_weight=0.7, token_weight=0.3)

    target_log_probs = target.logits(features).log_softmax(-1)  # [B, T-1, V]
    head_log_probs = target.logits(predicted).log_softmax(-1)
    kl = (target_log_probs.exp() * (target_log_probs - head_log_probs)).sum(-1).mean()
    smooth_l1 = torch.where(
        (predicted - features).abs() < 1, 0.5 * (predicted - features) ** 2, (predicted - features).abs() - 0.5
    ).mean()
    expected = 0.7 * smooth_l1 + 0.3 * kl
    assert torch.allclose(head_loss(predicted, features, target, heads_config), expected, rtol=1e-5)
    assert float(head_loss(features, features, target, heads_config)) < 1e-6

    noisy = add_noise(features, 0.1, seed=9)
    half_width = 0.1 * float(features.pow(2).mean().sqrt())
    assert (noisy - features).abs().max() <= half_width * (1 + 1e-6)
    assert (noisy - features).abs().max() > 0.95 * half_width  # uniform over the whole width, not less
    assert torch.equal(add_noise(features, 0.1, seed=9), noisy) and not torch.equal(add_noise(features, 0.1, 10), noisy)
    assert add_noise(features, 0.0, seed=9) is features


def test_the_cli_writes_a_head_and_lengthens_it(target_dir, corpus_dir, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "head"
    command = [
        "train-heads",
        str(target_dir),
        "--out",
        str(out),
        "--corpus",
        str(corpus_dir),
        *TINY_HEADS,
        "--warmup",
        "1",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--sample-temperatures",
        "0",
    ]
    assert main([*command, "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"head written to {out}" in printed and "held-out greedy agreement" in printed
    head_json = json.loads((out / HEAD_CONFIG).read_text())
    assert head_json["torch_dtype"] == "bfloat16" and head_json["training"]["steps"] == 3
    assert (out / HEAD_WEIGHTS).is_file() and "--sample-temperatures 0 " in (out / "README.md").read_text()

    assert main([*command, "--steps", "5"]) == 0  # the same --out: goes on from step 3
    captured = capsys.readouterr()
    assert "resuming from" in captured.err and "(step 3)" in captured.err
    assert json.loads((out / HEAD_CONFIG).read_text())["training"]["steps"] == 5

    (out / "notes.txt").write_text("mine")
    assert main([*command, "--steps", "6"]) == 2  # a file of the user's: never replaced
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--feature-noise", "-1"], "feature_noise must be a number >= 0"),
        (["--feature-weight", "0", "--token-weight", "0"], "both 0"),
        (["--on-policy-fraction", "1.5"], "on_policy_fraction must be in"),
        (["--sample-temperatures", "0,-0.5"], "sample_temperatures must be"),
        (["--context", "1"], "context must be an integer >= 2"),
        (["--prompt-tokens", "0"], "prompt_tokens must be"),
        (["--on-policy-fraction", "0", "--sample-temperatures", "0.5"], "--on-policy-fraction 0 leaves out"),
        (["--steps", "0"], "steps must be"),
    ],
)
def test_bad_settings_are_one_clear_error(target_dir, tmp_path, capsys, flags, message):
    from specdec.cli import main

    out = tmp_path / "head"
    assert main(["train-heads", str(target_dir), "--out", str(out), "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "head.incomplete").exists()


def test_bad_targets_are_refused_and_nothing_is_written(target_dir, corpus_dir, head_dir, tmp_path):
    out = tmp_path / "out"
    run = ["--out", out, "--corpus", corpus_dir, *TINY_HEADS, "--steps", "6"]
    cases = [
        (tmp_path / "nowhere", "does not exist"),
        (corpus_dir, "config.json"),  # a directory of text, not a model
        (head_dir, "config.json"),  # a head is not a target
        (target_dir / "model.safetensors", "is a file, not a model directory"),
    ]
    for target, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            cli("train-heads", target, *run)
        assert not out.exists() and not (tmp_path / "out.incomplete").exists(), target
    with pytest.raises(ValueError, match="is TARGET .*: writing there would destroy it"):
        cli("train-heads", target_dir, *run[:1], target_dir, *run[2:])
    tokenless = save_tiny_model(tmp_path / "tokenless", "llama", seed=1, tokenizer=False)
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        cli("train-heads", tokenless, *run)
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()
    with pytest.raises(SystemExit):  # a head is one file: no shards to size
        cli("train-heads", target_dir, *run, "--max-shard-mb", "1")
    for bad in (
        dict(sample_temperatures=()),
        dict(token_weight=float("nan")),
        dict(target_dtype="float16"),
        dict(sample_temperatures=(True,)),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HeadsConfig(**bad)


def test_a_head_over_part_of_the_vocabulary(target_dir, corpus_dir, tmp_path):
    """--output-vocab N: the head scores the N most frequent tokens of the training text (the
    end-of-text token among them), saved with it; it drafts only those, the output stays the
    target's, and after training most of its drafts are accepted. Its token loss is the KL over
    the scored tokens, q renormalised over them."""
    from specdec import LLM, SamplingParams
    from specdec.drafters.eagle import EagleDrafter

    out = tmp_path / "head"
    assert (
        cli(
            "train-heads",
            target_dir,
            "--out",
            out,
            "--corpus",
            corpus_dir,
            *TINY_HEADS,
            "--steps",
            "40",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--save-dtype",
            "float32",
            "--output-vocab",
            "96",
        )
        == 0
    )
    target = load_pretrained(target_dir, "float32")
    head = load_head(out, target.model.config, torch.float32)
    ids = head.output_token_ids
    assert head.config.output_vocab_size == 96 and len(ids) == 96 and bool((ids[1:] > ids[:-1]).all())
    assert set(target.eos_token_ids) <= set(ids.tolist())

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def copy(x):\n", "class Point:\n    def __init__(self", "import os\n"]
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(target_dir), dtype="float32", speculative_method="none").generate(prompts, params)
    ]
    llm = LLM(
        str(target_dir),
        speculative_model=str(out),
        dtype="float32",
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
    )
    drafted = []
    original = EagleDrafter.propose

    def recording(self, batch, k, sampling):
        draft = original(self, batch, k, sampling)
        drafted.extend(draft.token_ids[:, :1].flatten().tolist())
        return draft

    EagleDrafter.propose = recording
    try:
        outputs = llm.generate(prompts, params)
    finally:
        EagleDrafter.propose = original
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert drafted and set(drafted) <= set(ids.tolist())
    proposed = sum(o.metrics.num_draft_tokens for o in outputs)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) / proposed > 0.3

    features = torch.randn(2, 5, target.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    predicted = features + 0.3 * torch.randn(features.shape, generator=torch.Generator().manual_seed(2))
    target_probs = target.model.logits(features).softmax(-1)  # [B, T, V]
    scored = predicted @ target.model.lm_head.weight[ids].T  # [B, T, S]
    kl = (
        (
            torch.special.xlogy(target_probs[..., ids], target_probs[..., ids])
            - target_probs[..., ids] * scored.log_softmax(-1)
        )
        .sum(-1)
        .mean()
    )
    heads_config = HeadsConfig(feature_weight=0.0, token_weight=1.0)
    assert torch.allclose(head_loss(predicted, features, target.model, heads_config, head), kl, rtol=1e-4)

    from safetensors.torch import load_file, save_file

    from specdec.models.eagle import HeadLoadError

    weights = load_file(str(out / HEAD_WEIGHTS))
    for bad in (ids.flip(0), torch.cat([ids[:-1], torch.tensor([target.model.config.vocab_size])])):
        save_file({**weights, "output_token_ids": bad.contiguous()}, str(out / HEAD_WEIGHTS))
        with pytest.raises(HeadLoadError, match="output_token_ids must be ascending distinct token ids"):
            load_head(out, target.model.config, torch.float32)


def test_restrict_head_cuts_the_output_layer_and_keeps_the_weights(head_dir, target_dir, corpus_dir, tmp_path):
    """specdec restrict-head: the same head weights, the N most frequent tokens of the corpus
    (end of text among them) scored, a card section saying so; a cut head is not cut again, and
    N at least the vocabulary is refused."""
    out = tmp_path / "cut"
    assert (
        cli(
            "restrict-head",
            head_dir,
            "--target",
            target_dir,
            "--output-vocab",
            "64",
            "--corpus",
            corpus_dir,
            "--out",
            out,
        )
        == 0
    )
    target = load_pretrained(target_dir, "float32")
    full, cut = (load_head(d, target.model.config, torch.float32) for d in (head_dir, out))
    assert cut.config.output_vocab_size == 64 and set(target.eos_token_ids) <= set(cut.output_token_ids.tolist())
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, cut.state_dict()[name]), name
    assert "restrict-head" in (out / "README.md").read_text()
    assert json.loads((out / HEAD_CONFIG).read_text())["restricted"]["output_vocab"] == 64
    with pytest.raises(ValueError, match="already scores only 64 tokens"):
        cli(
            "restrict-head",
            out,
            "--target",
            target_dir,
            "--output-vocab",
            "32",
            "--corpus",
            corpus_dir,
            "--out",
            tmp_path / "again",
        )
    with pytest.raises(ValueError, match="not below the vocabulary size"):
        cli(
            "restrict-head",
            head_dir,
            "--target",
            target_dir,
            "--output-vocab",
            str(target.model.config.vocab_size),
            "--corpus",
            corpus_dir,
            "--out",
            tmp_path / "whole",
        )
    assert not (tmp_path / "again").exists() and not (tmp_path / "whole").exists()
