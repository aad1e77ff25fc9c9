"""The table of methods (methods.py) is what the house reads: every method in it has a factory
that makes its drafter (drafters/ or spec/), the drafter grows trees exactly where the table says
so (config's checks read the table, the engine the drafter), and config's method lists are the
table's."""

from __future__ import annotations

import pytest

from helpers import save_random_head
from specdec import LLM, config
from specdec.llm import ALL_DRAFTERS
from specdec.methods import METHODS


def test_every_method_has_a_factory_and_config_reads_the_table():
    assert set(ALL_DRAFTERS) == set(METHODS)
    assert config.SPECULATIVE_METHODS == tuple(METHODS)
    assert set(config.TREE_METHODS) == {"draft_model", "eagle", "early_exit"}
    assert set(config.NEEDS_DRAFT_MODEL) == {"draft_model", "lookup_then_draft", "eagle", "staged", "suffix_then_draft"}
    assert set(config.SUFFIX_METHODS) == {"suffix", "suffix_then_draft", "auto"}
    assert config.DEFAULT_NGRAM_MIN["lookup_then_draft"] == 2 and config.DEFAULT_NGRAM_MIN["auto"] is None


@pytest.mark.parametrize("method", [name for name in METHODS if name != "auto"])
def test_each_methods_drafter_grows_trees_where_the_table_says(tiny_pair, tmp_path, method):
    model = {
        "draft_model": str(tiny_pair["draft"]),
        "lookup_then_draft": str(tiny_pair["draft"]),
        "suffix_then_draft": str(tiny_pair["draft"]),
        "eagle": None,
        "staged": ["[ngram]", str(tiny_pair["draft"])],
    }.get(method)
    if method == "eagle":
        model = str(save_random_head(tiny_pair["target"], tmp_path / "head", seed=1))
    llm = LLM(str(tiny_pair["target"]), dtype="float32", speculative_method=method, speculative_model=model)
    drafter = llm.engine.drafter
    assert drafter is not None and drafter.grows_trees == METHODS[method].grows_trees
