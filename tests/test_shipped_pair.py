"""The code-model pair committed in models/: its size limits, its model cards, that transformers
reads it as specdec does, and that speculative decoding with it is exactly the target's greedy
output on held-out code, and mostly valid Python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_hf
from specdec import LLM, SamplingParams
from specdec.models.loader import load_pretrained
from specdec.tools.benchmark.prompts import held_out_code_prompts

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET, DRAFT = MODELS / "code-target", MODELS / "code-draft"
MB = 1_000_000


def test_pair_sizes_and_files():
    target = load_pretrained(TARGET, "float32", load_tokenizer=False).model.config
    draft = load_pretrained(DRAFT, "float32", load_tokenizer=False).model.config
    assert 20e6 <= target.num_parameters <= 40e6
    assert draft.num_parameters * 10 <= target.num_parameters
    weights = sorted(MODELS.glob("code-*/*.safetensors"))
    assert weights and all(f.stat().st_size <= 15 * MB for f in weights)
    assert sum(f.stat().st_size for f in MODELS.glob("code-*/*") if f.is_file()) <= 60 * MB
    for directory in (TARGET, DRAFT):
        assert not (directory / "checkpoint").exists()  # resumable training state stays out of the repo
        for name in (
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "training_log.json",
            "README.md",
        ):
            assert (directory / name).is_file(), f"{directory.name}/{name} is missing"


def test_model_cards_name_the_commands_that_made_the_pair():
    for directory, command in ((TARGET, "specdec train"), (DRAFT, "specdec distill")):
        card = (directory / "README.md").read_text()
        log = json.loads((directory / "training_log.json").read_text())
        assert log["finished"] and command in card and f"--seed {log['train_config']['seed']}" in card
        assert f"{log['seconds'] / 60:.1f} min" in card
    assert "--target models/code-target" in (DRAFT / "README.md").read_text()


def test_transformers_reads_the_target_as_specdec_does():
    prompt = held_out_code_prompts(1, max_chars=600)[0].text
    specdec_model = load_pretrained(TARGET, "float32")
    ids = specdec_model.tokenizer.encode(prompt)
    with torch.inference_mode():
        ours = specdec_model.model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]
        theirs = load_hf(TARGET)(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max() < 1e-3


@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_speculative_greedy_output_is_the_targets_on_held_out_code(draft_dtype):
    llm = LLM(
        str(TARGET),
        speculative_model=str(DRAFT),
        num_speculative_tokens=5,
        dtype="float32",
        draft_dtype=draft_dtype,
        speculative_k_policy="fixed",
    )  # judges the draft whatever its speed
    prompts = held_out_code_prompts(1, max_chars=600)[::4]
    params = SamplingParams(temperature=0, max_tokens=48)
    speculative = llm.generate([p.text for p in prompts], params)
    alone = llm.target_only().generate([p.text for p in prompts], params)
    for ours, reference in zip(speculative, alone):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
    accepted = sum(out.metrics.num_accepted_tokens for out in speculative)
    assert accepted > 0.3 * sum(len(out.outputs[0].token_ids) for out in speculative)  # the draft does help
    valid, whole = (
        sum(counts)
        for counts in zip(*(prompt.lines_that_parse(out.outputs[0].text) for prompt, out in zip(prompts, alone)))
    )
    assert whole >= len(prompts) and valid >= 0.8 * whole  # the target writes Python


def test_the_shipped_eagle_head_fits_its_target_and_drafts_exactly():
    """models/code-target-eagle: at most 20 MB, made for the shipped target, and greedy output
    with it is the target's own."""
    head = MODELS / "code-target-eagle"
    assert sum(f.stat().st_size for f in head.iterdir() if f.is_file()) <= 20 * MB
    assert (head / "README.md").is_file() and "specdec train-heads" in (head / "README.md").read_text()
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = 'def mean(values):\n    """Return the arithmetic mean of values."""\n'
    alone = LLM(str(TARGET), dtype="float32", speculative_method="none").generate(prompt, params)[0]
    eagle = LLM(
        str(TARGET),
        speculative_model=str(head),
        dtype="float32",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
    ).generate(prompt, params)[0]
    assert eagle.outputs[0].token_ids == alone.outputs[0].token_ids
    assert eagle.metrics.num_accepted_tokens > 0  # trained: some of its drafts are the target's


def test_the_smollm2_draft_is_small_enough():
    """models/smollm2-draft: at least 10x fewer parameters than SmolLM2-135M-Instruct's 134.5M,
    at most 60 MB, with its card; no training state in the repository."""
    draft_dir = MODELS / "smollm2-draft"
    draft = load_pretrained(draft_dir, "float32", load_tokenizer=False).model.config
    assert draft.num_parameters * 10 <= 134_515_008 and draft.output_vocab_size == 8192
    assert sum(f.stat().st_size for f in draft_dir.iterdir() if f.is_file()) <= 60 * MB
    assert not (draft_dir / "checkpoint").exists() and "specdec distill" in (draft_dir / "README.md").read_text()
