"""Staged drafts (spec/staged.py): each stage drafts for the next by speculative decoding, the last
for the target. Greedy output is the target's own, token for token in float32, batched and ragged;
sampled output follows the target's distribution (chi-square, as in test_distribution.py); a
seeded request gets the same tokens alone or batched; bad stages are clear errors, said in the
words of the interface they came through; --draft A --draft B builds what
LLM(speculative_model=[A, B]) builds.

The drafts here are the target's weights plus noise ("near" less, "far" more), so that every stage
accepts some tokens and rejects others: random models of their own agree with nothing.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_distribution import DIMS, SETTINGS, VOCAB, assert_follows, continuation_logits, exact_distributions

from helpers import load_hf, random_prompts, save_random_head, save_tiny_model, token_ids
from specdec import LLM, SamplingParams, SpecStats
from specdec.config import SpeculativeConfig
from specdec.spec.staged import StagedDrafter


def save_perturbed(target_dir: Path, out: Path, scale: float, seed: int) -> str:
    """The target's weights plus Gaussian noise of scale times each tensor's spread (at least
    0.1), saved at out with the target's tokenizer files."""
    model = load_hf(target_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp(min=0.1))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """test_distribution.py's target over 32 tokens (the same seed: its greedy continuations
    repeat, so prompt lookup finds what follows), a near and a far copy of it, a larger model
    than it, and its prompt for the chi-square tests: its own greedy continuation of one token."""
    root = tmp_path_factory.mktemp("staged")
    target = save_tiny_model(root / "target", "llama", seed=7, vocab_size=VOCAB, tokenizer=False, init_std=0.5, **DIMS)
    larger = {**DIMS, "num_hidden_layers": 2}
    return {
        "target": str(target),
        "near": save_perturbed(target, root / "near", 0.1, seed=4),
        "far": save_perturbed(target, root / "far", 0.2, seed=5),
        # for the chi-square tests: drafts further off, as test_distribution.py's, whose errors a
        # wrong draft distribution would not hide
        "near off": save_perturbed(target, root / "near off", 0.2, seed=6),
        "far off": save_perturbed(target, root / "far off", 0.4, seed=7),
        "larger": str(save_tiny_model(root / "larger", "llama", seed=3, vocab_size=VOCAB, tokenizer=False, **larger)),
    }


@pytest.fixture(scope="module")
def target_alone(models) -> LLM:
    return LLM(models["target"], dtype="float32", skip_tokenizer_init=True, speculative_method="none")


def staged_llm(models: dict[str, str], stages: tuple[str, ...], **kwargs) -> LLM:
    """An LLM over the target with these stages (names in models, or "[ngram]")."""
    return LLM(
        models["target"],
        speculative_model=[models.get(name, name) for name in stages],
        dtype="float32",
        skip_tokenizer_init=True,
        **kwargs,
    )


def inner_stats(llm: LLM) -> SpecStats:
    """The inner rounds of llm's last stage, in its last generate."""
    drafter = llm.engine.drafter
    assert isinstance(drafter, StagedDrafter)
    return drafter.stats


STAGED_DRAWS = 40_000  # copies of one prompt in each chi-square test
PROMPTS = random_prompts(5, seed=29, lengths=(3, 12), vocab=VOCAB)  # ragged
MAX_TOKENS = (24, 17, 30, 9, 21)


# ---------------------------------------------------------------------------------------------
# Greedy: the target's own output.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stages, k, max_num_seqs",
    [
        (("[ngram]", "near"), 2, 256),
        (("[ngram]", "near"), 4, 256),
        (("far", "near"), 2, 256),
        (("far", "near"), 4, 256),
        (("[ngram]", "far", "near"), 4, 2),  # three stages; two slots, so sequences leave and join
    ],
)
def test_greedy_staged_output_is_the_targets(models, target_alone, stages, k, max_num_seqs):
    """With k fixed, so that every round drafts: the output is the target's, and both the inner
    stage and the target accepted some drafts and rejected others."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm = staged_llm(models, stages, num_speculative_tokens=k, speculative_k_policy="fixed", max_num_seqs=max_num_seqs)
    outputs = llm.generate(PROMPTS, params)
    assert token_ids(outputs) == token_ids(target_alone.generate(PROMPTS, params))
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    judged = sum(out.metrics.num_judged_tokens for out in outputs)
    assert 0 < accepted < judged, f"the target accepted {accepted} of {judged} judged drafts"
    inner = inner_stats(llm)
    assert 0 < inner.num_accepted_tokens < inner.num_judged_tokens, inner.summary()


def test_greedy_staged_output_is_the_targets_by_goodput(models, target_alone):
    """LLM's default policy, outer and inner: whatever k each round takes, the target's output."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm = staged_llm(models, ("[ngram]", "far", "near"))
    assert token_ids(llm.generate(PROMPTS, params)) == token_ids(target_alone.generate(PROMPTS, params))


def test_the_draft_is_the_models_own_greedy_chain(models):
    """The staged draft of [far -> near] proposes what near alone proposes (its greedy chain), so
    the target accepts as many tokens, round by round, as behind near alone."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    staged = staged_llm(models, ("far", "near"), num_speculative_tokens=3, speculative_k_policy="fixed")
    alone = staged_llm(models, ("near",), num_speculative_tokens=3, speculative_k_policy="fixed")  # one stage
    by_position = [out.metrics.accepted_by_position for out in staged.generate(PROMPTS, params)]
    assert by_position == [out.metrics.accepted_by_position for out in alone.generate(PROMPTS, params)]


def test_a_seeded_request_gets_the_same_tokens_alone_or_batched_beside_greedy_rows(models, target_alone):
    """A batch of greedy and sampled rows: the greedy rows are the target's; the seeded sampled
    row's tokens do not depend on its batch (its inner and outer rounds draw from its own
    generator, at the fixed k a seeded row keeps)."""
    llm = staged_llm(models, ("[ngram]", "far", "near"), num_speculative_tokens=3)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, ignore_eos=True, seed=5)
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(PROMPTS[:4], [greedy, seeded, unseeded, greedy])
    alone = llm.generate(PROMPTS[1], seeded)
    assert token_ids(batch)[1] == token_ids(alone)[0]
    expected = token_ids(target_alone.generate([PROMPTS[0], PROMPTS[3]], greedy))
    assert [token_ids(batch)[0], token_ids(batch)[3]] == expected


# ---------------------------------------------------------------------------------------------
# Sampled: the target's distribution (chi-square).
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "stages, setting",
    [(("[ngram]", "near off"), "T1.0"), (("far off", "near off"), "T0.7-top_k5")],
    ids=["ngram-near", "far-near"],
)
def test_sampled_staged_output_follows_the_target(models, stages, setting):
    """max_tokens 4, k 3: after the prefill's token, the first round verifies two staged draft
    tokens (the inner stage drafts the first for the draft model, which judges it), then a
    recovered or bonus token. Over 40,000 copies of one prompt (the target's own greedy
    continuation of one token) the four tokens follow their exact marginals and the first three
    their exact joint; drafts were accepted and rejected at both levels."""
    T, V = 4, VOCAB
    target = load_hf(Path(models["target"]))
    prompt = [5]
    with torch.no_grad():
        for _ in range(7):
            prompt.append(int(target(torch.tensor([prompt])).logits[0, -1].argmax()))
    joints = exact_distributions(continuation_logits(target, prompt, T), SETTINGS[setting])
    llm = staged_llm(
        models, stages, num_speculative_tokens=3, speculative_k_policy="fixed", max_num_seqs=STAGED_DRAWS, seed=2900
    )
    params = SamplingParams(max_tokens=T, ignore_eos=True, **SETTINGS[setting])
    outputs = llm.generate([prompt] * STAGED_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 4]
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    judged = sum(out.metrics.num_judged_tokens for out in outputs)
    inner = inner_stats(llm)
    assert 1000 < accepted < judged - 1000, f"the target accepted {accepted} of {judged} judged drafts"
    assert 1000 < inner.num_accepted_tokens < inner.num_judged_tokens - 1000, inner.summary()
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"staged {stages} {setting}: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens[:, :3].T, (V,) * 3), joints[2], f"staged {stages}: joint of 3")


# ---------------------------------------------------------------------------------------------
# Configuration: bad stages are clear errors; the command line builds what LLM builds.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_model=[]), "speculative_model=() holds 0 stages; staged drafts need at least two"),
        (
            dict(speculative_model=["D", "[ngram]"]),
            "'[ngram]' (prompt lookup) can only be the first stage, not stage 2",
        ),
        (
            dict(speculative_model=["D", ""]),
            "every stage is a draft model's directory or '[ngram]' (prompt lookup), got ''",
        ),
        (
            dict(speculative_model=["D", 3]),
            "every stage is a draft model's directory or '[ngram]' (prompt lookup), got 3",
        ),
        (
            dict(speculative_model=["D", "E"], speculative_method="eagle"),
            "speculative_model=('D', 'E') lists stages, which speculative_method='eagle' does not take",
        ),
        (
            dict(speculative_model="D", speculative_method="staged"),
            "speculative_method='staged' needs a list of stages",
        ),
        (
            dict(speculative_model=["[ngram]", "D"], draft_confidence_threshold=0.3),
            "draft_confidence_threshold=0.3 stops a draft model's steps early",
        ),
        (dict(speculative_model=["[ngram]", "D"], speculative_tree="auto"), "needs a drafter that grows trees"),
    ],
)
def test_bad_stages_are_clear_errors_before_anything_loads(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM("no-such-target", **kwargs)


def test_every_method_has_a_drafter():
    """drafters/' registry and the staged drafter (registered in llm.py: it sits above drafters/)."""
    from specdec.config import SPECULATIVE_METHODS
    from specdec.llm import ALL_DRAFTERS

    assert set(ALL_DRAFTERS) == set(SPECULATIVE_METHODS)


def test_one_stage_is_that_drafter():
    from specdec.llm import speculative_config

    assert speculative_config(["D"], None) == SpeculativeConfig(method="draft_model", model="D")
    assert speculative_config(["[ngram]"], None) == SpeculativeConfig(method="ngram")
    assert speculative_config(("[ngram]", Path("D")), None) == SpeculativeConfig(
        method="staged", model=("[ngram]", "D")
    )


@pytest.mark.parametrize(
    "stages, message",
    [
        (("near", "target"), ") is the target itself: the stages draft for the target"),
        (("near", "near"), "stages 1 and 2 are the same model"),
        (("larger", "near"), "drafts for the next stage"),
        (("near", "larger"), "drafts for the target"),
        (("[ngram]", "head"), "is an EAGLE head"),
    ],
)
def test_stages_that_cannot_work_are_refused_when_loaded(models, tmp_path, stages, message):
    if "head" in stages:
        models = dict(models, head=str(save_random_head(Path(models["target"]), tmp_path / "head")))
    with pytest.raises(ValueError, match=re.escape(message)):
        staged_llm(models, stages)


def test_the_command_line_builds_what_llm_builds():
    from specdec.cli import build_parser
    from specdec.llm import speculative_config, speculative_config_from
    from specdec.model_flags import speculative_config_from_flags

    parser = build_parser()

    def config(command, *flags):
        extra = ["--prompt", "x"] if command == "generate" else []
        return speculative_config_from_flags(parser.parse_args([command, "M", *extra, *flags]))

    for command in ("generate", "serve"):
        staged = config(command, "--draft", "A", "--draft", "B", "-k", "3")
        assert staged == speculative_config(["A", "B"], None, num_speculative_tokens=3)  # LLM's keywords
        assert staged == speculative_config_from({"model": ["A", "B"], "num_speculative_tokens": 3})
        assert staged == SpeculativeConfig(method="staged", model=("A", "B"), num_speculative_tokens=3)
        assert config(command, "--draft", "[ngram]", "--draft", "B", "--ngram-max", "3") == SpeculativeConfig(
            method="staged", model=("[ngram]", "B"), ngram_max=3
        )
        assert config(command, "--draft", "A") == SpeculativeConfig(
            method="draft_model", model="A"
        )  # once: one draft model, as before
        assert config(command, "--draft", "[ngram]") == SpeculativeConfig(method="ngram")


def test_a_bad_stage_on_the_command_line_is_said_in_flags(models, tmp_path, capsys):
    from specdec.cli import main

    for flags, said in (
        (["--draft", "D", "--draft", "[ngram]"], "error: --draft D --draft '[ngram]': '[ngram]' (prompt lookup) can"),
        (
            ["--lookup", "--draft", "A", "--draft", "B"],
            "error: --lookup puts prompt lookup in front of one draft model",
        ),
        (["--draft", "A", "--draft", "B", "--tree", "auto"], "error: --tree auto needs a drafter that grows trees"),
        (["--draft", "A", "--draft", "B", "--ngram-min", "2"], "error: --ngram-min sets prompt lookup, which these"),
    ):
        assert main(["generate", models["target"], "--prompt", "x", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and "speculative_" not in err, err
    assert main(["bench", models["target"], "--draft", "A", "--draft", "B", "--out", str(tmp_path / "out")]) == 2
    assert "the bench measures one draft model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
