"""LLM(speculative_config=...): speculation given in one, as vLLM takes it (a dict of
SpeculativeConfig's fields or vLLM's names for them, or a SpeculativeConfig), the same engine as
the flat speculative_* keywords, and exact like them."""

from __future__ import annotations

import pytest

from helpers import random_prompts, save_tiny_pair, token_ids
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("specconfig"), target_seed=41, draft_seed=42, draft_arch="llama")


@pytest.fixture(scope="module")
def target_alone(dirs):
    return token_ids(
        LLM(str(dirs["target"]), dtype="float32", speculative_method="none").generate(
            random_prompts(3, seed=43), GREEDY
        )
    )


@pytest.mark.parametrize(
    "given, flat",
    [
        ({"model": "draft", "num_speculative_tokens": 3}, {"speculative_model": "draft", "num_speculative_tokens": 3}),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
            {
                "speculative_method": "ngram",
                "num_speculative_tokens": 4,
                "ngram_prompt_lookup_min": 2,
                "ngram_prompt_lookup_max": 3,
            },
        ),
        (
            {"model": "draft", "method": "lookup_then_draft", "k_policy": "fixed", "draft_dtype": "float32"},
            {
                "speculative_model": "draft",
                "speculative_method": "lookup_then_draft",
                "speculative_k_policy": "fixed",
                "draft_dtype": "float32",
            },
        ),
    ],
)
def test_a_dict_builds_what_the_flat_keywords_build_and_stays_exact(dirs, target_alone, given, flat):
    def paths(options: dict) -> dict:
        return {key: str(dirs["target"]) if value == "draft" else value for key, value in options.items()}

    from_dict = LLM(str(dirs["target"]), dtype="float32", speculative_config=paths(given))
    from_flat = LLM(str(dirs["target"]), dtype="float32", **paths(flat))
    assert from_dict.speculative_config == from_flat.speculative_config is not None
    assert token_ids(from_dict.generate(random_prompts(3, seed=43), GREEDY)) == target_alone


def test_a_speculative_config_is_taken_as_it_is(dirs, target_alone):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, k_policy="fixed")
    llm = LLM(str(dirs["target"]), dtype="float32", speculative_config=config)
    assert llm.speculative_config is config
    assert token_ids(llm.generate(random_prompts(3, seed=43), GREEDY)) == target_alone


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"speculative_config": {"method": "ngram"}, "num_speculative_tokens": 3},
            "speculative_config and num_speculative_tokens both say how to speculate",
        ),
        (
            {"speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 1}},
            "speculative_config has no 'draft_tensor_parallel_size'; its keys are",
        ),
        ({"speculative_config": "ngram"}, "speculative_config must be a SpeculativeConfig or a dict"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": -1}}, "num_speculative_tokens must be"),
        (
            {"speculative_config": {"method": "none", "num_speculative_tokens": 3}},
            "num_speculative_tokens=3 with speculative_method='none', which turns speculation off",
        ),
    ],
)
def test_bad_speculative_configs_are_clear_errors(dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(dirs["target"]), dtype="float32", **kwargs)


def test_with_drafter_defaults_to_the_k_policy_llm_defaults_to(dirs):
    from specdec.drafters import DRAFTERS

    llm = LLM(str(dirs["target"]), dtype="float32", speculative_method="ngram", num_speculative_tokens=3)
    ngram = DRAFTERS["ngram"](SpeculativeConfig(method="ngram"), llm.target, llm.runner)
    same_target = llm.with_drafter(ngram, 3)
    assert llm.speculative_config.k_policy == "goodput"
    assert (same_target.engine.policy is None) == (llm.engine.policy is None) is False
    assert llm.with_drafter(ngram, 3, "fixed").engine.policy is None


def test_each_field_says_its_help_its_flag_and_the_keyword_llm_takes_it_by():
    """One vocabulary: a field's metadata names it for each interface; LLM's flat keywords are the same names."""
    from dataclasses import fields

    from specdec.config import keyword
    from specdec.llm import FLAT_NAMES

    assert {f.name: keyword(SpeculativeConfig, f.name) for f in fields(SpeculativeConfig)} == FLAT_NAMES
    for f in fields(SpeculativeConfig):
        assert f.metadata["help"] and f.metadata["shown"] and f.metadata["flags"][-1].startswith("--"), f.name


def test_a_refused_value_is_said_in_the_words_of_the_interface():
    from specdec.config import ConfigError, Wording

    with pytest.raises(ConfigError) as error:
        SpeculativeConfig(method="ngram", tree="auto")
    assert str(error.value) == (
        "speculative_tree='auto' needs a drafter that grows trees (draft_model, eagle, "
        "early_exit); speculative_method='ngram' drafts chains: drop speculative_tree"
    )
    assert error.value.fields == ("method", "tree") and isinstance(error.value, ValueError)
    upper = Wording(
        lambda owner, name: name.upper(),
        lambda owner, name, value: f"{name.upper()}:{value}",
        lambda owner, name, text: f"{name.upper()}:{text}",
    )
    assert error.value.in_words(upper) == (
        "TREE:auto needs a drafter that grows trees (draft_model, eagle, "
        "early_exit); METHOD:ngram drafts chains: drop TREE"
    )
    with pytest.raises(ConfigError, match=r"^top_p must be in \(0, 1\], got 2$"):
        SamplingParams(top_p=2)


def test_a_flat_keyword_set_to_none_where_none_means_something_is_given():
    """draft_quantization=None (dequantize a GGUF draft) is a setting, not "not given" ("auto" is)."""
    from specdec.llm import speculative_config

    assert speculative_config("draft_dir", "draft_model", draft_quantization=None).draft_quantization is None
    assert speculative_config("draft_dir", "draft_model", draft_quantization="auto").draft_quantization == "auto"
    assert speculative_config(None, None, draft_quantization=None).method == "auto"  # for a draft model it chooses
    with pytest.raises(ValueError, match="draft_quantization=None with speculative_method='none'"):
        speculative_config(None, "none", draft_quantization=None)
