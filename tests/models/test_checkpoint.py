"""Writing a model directory: transformers loads what specdec saves, with the same logits;
and prompt lookup's matching rules."""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.ngram import lookup
from specdec.models.checkpoint import from_hf, save_pretrained, to_hf
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.loader import load_pretrained


def random_model(tied: bool, seed: int) -> LlamaModel:
    config = ModelConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaModel(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_saved_directory_loads_in_transformers_and_specdec(tmp_path):
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        model = random_model(tied, seed=3 + tied)
        path = save_pretrained(model, tmp_path / f"tied{tied}", dtype=torch.float32)
        ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(5))
        positions = torch.arange(17).expand(2, 17)
        with torch.inference_mode():
            ours = model(ids, positions, model.new_cache(2, 32))
            reloaded = load_pretrained(path, "float32", load_tokenizer=False).model
            again = reloaded(ids, positions, reloaded.new_cache(2, 32))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            theirs = hf(ids).logits
        assert (ours - theirs).abs().max() <= 1e-4
        assert torch.equal(ours, again)


def test_a_model_packed_for_onednn_is_not_saved_without_its_weights(tmp_path):
    """An eager ModelRunner packs bf16 linears on the CPU: their weights leave the state dict,
    so saving such a model is refused (it would write a directory with no linear weights)."""
    import pytest

    from specdec.models.cpu_linear import can_pack
    from specdec.worker import ModelRunner

    path = save_pretrained(random_model(False, seed=5), tmp_path / "saved", dtype=torch.bfloat16)
    packed = load_pretrained(path, "bfloat16", load_tokenizer=False)
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no oneDNN bf16: nothing is packed")
    ModelRunner(packed.model, compile="off").eager_model()
    with pytest.raises(ValueError, match="before a ModelRunner"):
        save_pretrained(packed.model, tmp_path / "again", dtype=torch.bfloat16)
    assert not (tmp_path / "again").exists()
    unpacked = load_pretrained(path, "bfloat16", load_tokenizer=False)
    save_pretrained(unpacked.model, tmp_path / "again", dtype=torch.bfloat16)
    assert load_pretrained(tmp_path / "again", "float32", load_tokenizer=False).model.config == unpacked.model.config


def test_fused_names_round_trip():
    model = random_model(False, seed=6)
    hf_state = to_hf(model)
    assert "model.layers.0.self_attn.k_proj.weight" in hf_state and "model.layers.1.mlp.up_proj.weight" in hf_state
    back = from_hf(hf_state)
    for name, tensor in model.state_dict().items():
        if name != "inv_freq":
            assert torch.equal(back[name], tensor), name


def test_prompt_lookup_rules():
    ctx = np.array
    assert lookup(ctx([5, 1, 2, 9, 4, 1, 2]), 3, 1, 4).tolist() == [9, 4, 1]  # latest match of "1 2"
    assert lookup(ctx([1, 2, 7, 1, 2, 8, 1, 2]), 1, 2, 2).tolist() == [8]  # the latest of two earlier matches
    assert lookup(ctx([1, 2, 3, 4]), 3, 1, 4).tolist() == []  # nothing repeats
    assert lookup(ctx([1, 2, 3, 1, 2]), 5, 1, 4).tolist() == [3, 1, 2, 3, 1]  # overlapping copy
    assert lookup(ctx([7, 7, 7, 7]), 3, 1, 4).tolist() == [7, 7, 7]
    assert lookup(ctx([3, 8, 1, 2, 6, 1, 2]), 2, 2, 2).tolist() == [6, 1]
    assert lookup(ctx([3, 8, 1, 2, 6, 1, 2]), 2, 3, 3).tolist() == []  # "6 1 2" never occurred before
