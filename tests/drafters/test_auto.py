"""speculative_method="auto", the default (drafters/auto.py): the drafters chosen for a target
the registry knows (its shipped drafter behind suffix decoding) and for any other (suffix
decoding alone), prompt lookup where arctic-inference is missing, a shipped drafter that does
not load passed over, the settings the chosen method does not use reset, and "none" turning
speculation off. Greedy output is the target alone's in float32 either way."""

from __future__ import annotations

import json

import pytest

from helpers import random_prompts, save_random_head, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.config import ConfigError, SpeculativeConfig
from specdec.drafters import auto
from specdec.models.registry import Part, RegisteredModel, model_file, registered_as

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def entry(name: str, drafters: tuple[str, ...]) -> RegisteredModel:
    part = Part(f"{name}-part==1.0", f"{name}_part/data/{name}.gguf", 1)
    return RegisteredModel(name, (part,), f"{name}.gguf", 1, "0" * 64, "MIT", name, "test", drafters=drafters)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("auto") / "target", "llama", seed=5, num_hidden_layers=1)


@pytest.fixture
def checkout(tmp_path, target):
    """A checkout (root) with a draft model at models/tiny-draft and a head at models/tiny-head;
    a registry naming "tiny" (the draft first), "headed" (the head) and "missing" (neither there)."""
    root = tmp_path / "checkout"
    (root / "models").mkdir(parents=True)
    save_tiny_model(root / "models" / "tiny-draft", "llama", seed=6, num_hidden_layers=1)
    save_random_head(target, root / "models" / "tiny-head", seed=1)
    registry = {
        "tiny": entry("tiny", ("models/not-here", "models/tiny-draft")),
        "headed": entry("headed", ("models/tiny-head",)),
        "missing": entry("missing", ("models/not-here",)),
        "bare": entry("bare", ()),
    }
    return root, registry


@pytest.fixture
def with_suffix():
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed: make setup")


def choose(checkout, name, config=None):
    root, registry = checkout
    return auto.choose_drafters(config or SpeculativeConfig(), name, root, registry)


def test_a_registered_target_gets_its_shipped_drafter_behind_suffix_decoding(checkout, with_suffix):
    root, _ = checkout
    drafted = choose(checkout, "tiny")
    assert (drafted.config.method, drafted.config.model) == ("suffix_then_draft", str(root / "models" / "tiny-draft"))
    assert "ships draft model" in drafted.reason and "suffix decoding" in drafted.reason
    headed = choose(checkout, "headed")
    assert headed.config.method == "suffix_then_draft" and headed.config.model.endswith("tiny-head")
    assert "ships EAGLE head" in headed.reason
    assert headed.as_dict()["method"] == "suffix_then_draft"


@pytest.mark.parametrize(
    "name, why",
    [
        ("missing", "missing's shipped drafter is not in this checkout"),
        ("bare", "bare's shipped drafter is not in this checkout (none)"),
        ("someone-elses-model", "no drafter is registered for this model"),
        (None, "no drafter is registered for this model"),
    ],
)
def test_any_other_target_gets_suffix_decoding_alone(checkout, with_suffix, name, why):
    chosen = choose(checkout, name)
    assert (chosen.config.method, chosen.config.model) == ("suffix", None)
    assert chosen.reason.startswith(why) and chosen.drafters == "suffix"
    assert chosen.as_dict() == {"method": "suffix", "model": None, "reason": chosen.reason}


def test_without_arctic_inference_prompt_lookup_takes_suffix_decodings_place(checkout, monkeypatch):
    monkeypatch.setattr(auto, "suffix_decoding_installed", lambda: False)
    assert choose(checkout, "tiny").config.method == "lookup_then_draft"
    free = choose(checkout, "someone-elses-model")
    assert free.config.method == "ngram" and "arctic-inference" in free.reason
    assert free.config.ngram_min == 1  # ngram's own default, not auto's "chosen later"


def test_settings_given_with_auto_apply_where_the_chosen_method_uses_them(checkout, with_suffix):
    given = SpeculativeConfig(
        num_speculative_tokens=3, draft_dtype="float32", suffix_decoding_max_tree_depth=12, k_policy="fixed"
    )
    drafted = choose(checkout, "tiny", given).config
    assert (drafted.num_speculative_tokens, drafted.draft_dtype, drafted.suffix_decoding_max_tree_depth) == (
        3,
        "float32",
        12,
    )
    free = choose(checkout, "someone-elses-model", given).config
    default = SpeculativeConfig()
    assert free.draft_dtype == default.draft_dtype  # no draft model to set: back to the default
    assert (free.suffix_decoding_max_tree_depth, free.k_policy, free.num_speculative_tokens) == (12, "fixed", 3)


def test_registered_as_knows_a_model_by_name_or_by_where_fetch_put_it(tmp_path):
    registry = {"tiny": entry("tiny", ()), "conv": replace_converted(entry("conv", ()), "hf")}
    cache = tmp_path / "cache"
    assert registered_as("tiny", registry, cache) is registry["tiny"]
    assert registered_as(model_file(registry["tiny"], cache), registry, cache) is registry["tiny"]
    assert registered_as(str(cache / "models" / "conv" / "hf") + "/", registry, cache) is registry["conv"]
    for other in ("other", tmp_path / "tiny.gguf", "", None, 3):
        assert registered_as(other, registry, cache) is None, other


def replace_converted(model: RegisteredModel, converted: str) -> RegisteredModel:
    import dataclasses

    return dataclasses.replace(model, converted=converted)


@pytest.mark.parametrize("drafters", [("/abs/head",), ("models/../../etc",), ("",), ["models/x"]])
def test_a_registry_entry_with_drafters_outside_the_checkout_is_refused(drafters):
    with pytest.raises(ValueError, match="drafters must be a tuple of paths inside the checkout"):
        entry("bad", drafters)


def test_a_shipped_drafter_that_does_not_load_gives_way_to_the_free_drafters(target, tmp_path, monkeypatch, caplog):
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed: make setup")
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "nothing-we-know"}))
    config = SpeculativeConfig()
    monkeypatch.setattr(
        auto,
        "choose_drafters",
        lambda config, path: auto.DraftChoice(auto._as_method(config, "suffix_then_draft", str(broken)), "shipped"),
    )
    llm = LLM(str(target), dtype="float32", speculative_config=config)
    assert llm.draft_choice is not None and llm.speculative_config.method == "suffix"
    assert "did not load" in llm.draft_choice.reason and str(broken) in llm.draft_choice.reason
    assert "did not load" in caplog.text


def test_the_default_speculates_and_gives_the_target_alones_greedy_output(target, with_suffix):
    prompts = random_prompts(3, seed=8)
    default = LLM(str(target), dtype="float32")
    assert default.speculative_config.method == "suffix" and default.engine.drafter is not None
    assert default.draft_choice.reason.startswith("no drafter is registered")
    plain = LLM(str(target), dtype="float32", speculative_method="none")
    assert plain.speculative_config is None and plain.engine.drafter is None and plain.draft_choice is None
    expected = token_ids(plain.generate(prompts, GREEDY))
    assert token_ids(default.generate(prompts, GREEDY)) == expected
    assert token_ids(default.generate(prompts, GREEDY)) == expected  # the shared tree holds the first answers now


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(speculative_method="none", num_speculative_tokens=3), "num_speculative_tokens=3 with speculative_method"),
        (dict(speculative_method="none", speculative_model="D"), "speculative_model='D' with speculative_method"),
        (
            dict(speculative_config={"method": "auto", "model": "D"}),
            "speculative_method='auto' chooses the drafter itself",
        ),
    ],
)
def test_auto_and_none_refuse_what_they_would_ignore(tmp_path, keywords, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        LLM(str(tmp_path / "not-loaded"), **keywords)
