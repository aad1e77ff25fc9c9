"""speculative_method="early_exit": the target's own first layers draft; greedy output is the
target's own; the draft is exactly the target cut after those layers; bad depths are refused."""

from __future__ import annotations

import pytest
import torch

from helpers import random_prompts, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.drafters.early_exit import default_exit_layer
from specdec.models.loader import load_pretrained

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("early_exit") / "target", "llama", seed=8, init_std=0.3, num_hidden_layers=4
    )


def test_greedy_early_exit_equals_target_alone(target):
    prompts = random_prompts(4, seed=21)
    expected = token_ids(LLM(str(target), dtype="float32", speculative_method="none").generate(prompts, GREEDY))
    for layer in (1, 2, 3):
        for k in (1, 4):
            llm = LLM(
                str(target),
                speculative_method="early_exit",
                early_exit_layer=layer,
                num_speculative_tokens=k,
                dtype="float32",
                speculative_k_policy="fixed",
            )
            outputs = llm.generate(prompts, GREEDY)
            assert token_ids(outputs) == expected, f"layer {layer}, k={k}"
            assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


def test_the_draft_is_the_target_cut_after_its_first_layers(target):
    """first_layers(n) shares the target's weights and computes what transformers' model gives
    when its later layers are dropped (its hidden state after layer n, through the final norm
    and the output layer)."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(target, "float32").model
    view = model.first_layers(2)
    assert view.embed_tokens is model.embed_tokens and view.layers[1] is model.layers[1] and len(view.layers) == 2
    assert sum(p.numel() for p in view.parameters()) < sum(p.numel() for p in model.parameters())
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor(random_prompts(1, seed=22))
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states[2]  # after the embedding and 2 layers
        expected = reference.lm_head(reference.model.norm(hidden))
        got = view(ids, torch.arange(ids.shape[1])[None], None)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_default_depth_and_bad_depths(target):
    assert [default_exit_layer(n) for n in (2, 3, 4, 12, 30)] == [1, 2, 2, 6, 15]
    llm = LLM(str(target), speculative_method="early_exit", dtype="float32")
    assert len(llm.engine.drafter.model.layers) == 2
    for layer in (4, 9):
        with pytest.raises(ValueError, match=r"early_exit_layer must be in \[1, 3\] for this target of 4 layers"):
            LLM(str(target), speculative_method="early_exit", early_exit_layer=layer, dtype="float32")
    with pytest.raises(ValueError, match="early_exit_layer must be an integer >= 1"):
        LLM(str(target), speculative_method="early_exit", early_exit_layer=0)
    with pytest.raises(ValueError, match="early_exit_layer is for speculative_method='early_exit'"):
        LLM(str(target), speculative_method="ngram", early_exit_layer=2)
    with pytest.raises(ValueError, match="uses no draft model"):
        LLM(str(target), speculative_method="early_exit", speculative_model=str(target))


def test_generate_early_exit_on_the_command_line(target, capsys):
    from specdec.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                str(target),
                "--early-exit",
                "3",
                "--k-policy",
                "fixed",
                "-k",
                "3",
                "--prompt",
                "def f(x):",
                "--max-tokens",
                "12",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    assert "[early_exit k=3]" in capsys.readouterr().out
    assert main(["generate", "--model", str(target), "--early-exit", "--prompt", "x", "--max-tokens", "4"]) == 0
