"""speculative_method="eagle": a one-layer head over the target's own features drafts; greedy
output is the target's own, token for token; the head reads exactly the target's features of
the tokens it follows; a head made for another target, or whose head.json gives a size past its
bound, is refused."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from helpers import load_hf, random_prompts, save_random_head, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.drafters.eagle import EagleDrafter
from specdec.models.eagle import HEAD_CONFIG, HeadLoadError, load_head

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = save_tiny_model(root / "target", "llama", seed=3, init_std=0.3)
    deeper = save_tiny_model(root / "target4", "llama", seed=3, init_std=0.3, num_hidden_layers=4)
    return {
        "target": target,
        "head": save_random_head(target, root / "head", seed=5),
        "target4": deeper,
        "eagle3": save_random_head(deeper, root / "eagle3", seed=6, feature_layers=(0, 1, 2), output_vocab=200),
    }


@pytest.fixture(scope="module")
def plain(dirs):
    return LLM(str(dirs["target"]), dtype="float32", speculative_method="none")


def eagle(dirs, k: int, head: str = "head", target: str = "target", **kwargs) -> LLM:
    kwargs.setdefault("speculative_k_policy", "fixed")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("speculative_method", "eagle")
    return LLM(
        str(dirs[target]),
        speculative_model=str(dirs[head]),
        num_speculative_tokens=k,
        **kwargs,
    )


def test_greedy_eagle_equals_target_alone(dirs, plain):
    prompts = random_prompts(4, seed=11)
    expected = token_ids(plain.generate(prompts, GREEDY))
    for k in (1, 2, 4, 7):
        llm = eagle(dirs, k)
        assert token_ids(llm.generate(prompts[:1], GREEDY)) == expected[:1], f"k={k} batch 1"
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == expected, f"k={k} ragged batch"
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    queued = eagle(dirs, 3, max_num_seqs=2).generate(prompts, GREEDY)  # rows leave, slots are reused
    assert token_ids(queued) == expected
    chosen = eagle(dirs, 4, speculative_k_policy="goodput").generate(prompts, GREEDY)  # k = 0 rounds too
    assert token_ids(chosen) == expected


def eagle3(dirs, k: int, **kwargs) -> LLM:
    return eagle(dirs, k, head="eagle3", target="target4", **kwargs)


def test_greedy_eagle3_equals_target_alone(dirs):
    """An EAGLE-3 head (reading three of its target's four layers, scoring 200 tokens) drafts
    chains and trees; the output is the target's own."""
    prompts = random_prompts(4, seed=21)
    expected = token_ids(
        LLM(str(dirs["target4"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY)
    )
    for k in (1, 3, 6):
        outputs = eagle3(dirs, k).generate(prompts, GREEDY)
        assert token_ids(outputs) == expected, f"k={k}"
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    tree = eagle3(dirs, 6, speculative_tree="3,2,1").generate(prompts, GREEDY)
    assert token_ids(tree) == expected
    chosen = eagle3(dirs, 4, speculative_k_policy="goodput").generate(prompts, GREEDY)
    assert token_ids(chosen) == expected


def test_prompt_lookup_with_an_eagle3_head_behind_it_keeps_the_targets_output(dirs):
    """speculative_method="lookup_then_draft" with a head's directory: prompt lookup drafts the
    rows it matches, the head the others, catching up on the target's features of the rounds it
    sat out; both draft in the same run, and the greedy output is the target's, batched or not."""
    prompts = [p * 3 for p in random_prompts(3, seed=31)]  # repeated text: lookup finds matches
    expected = token_ids(
        LLM(str(dirs["target4"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY)
    )
    llm = eagle3(dirs, 4, speculative_method="lookup_then_draft")
    drafter = llm.engine.drafter
    assert isinstance(drafter.drafter, EagleDrafter) and drafter.needs_target_hidden
    counts = {"lookup": 0, "head": 0}

    def counted(part, name):
        def propose(batch, ks, sampling):
            draft = type(part).propose(part, batch, ks, sampling)
            counts[name] += int((draft.num_tokens > 0).sum())
            return draft

        return propose

    drafter.lookup.propose = counted(drafter.lookup, "lookup")
    drafter.drafter.propose = counted(drafter.drafter, "head")
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert token_ids(llm.generate(prompts[:1], GREEDY)) == expected[:1]
    assert counts["lookup"] > 0 and counts["head"] > 0, counts


@pytest.mark.parametrize("form, kind", [("int8", "Q8_0"), ("int4", "Q4_0")])
def test_a_quantized_head_drafts_and_keeps_the_targets_output(dirs, form, kind):
    """draft_quantization int8 / int4: the head's linear layers in GGUF's Q8_0 / Q4_0 on the GGUF
    kernels, its decoder layer one C++ call (its target's rows stay as they are); the output is
    still the target's own."""
    from specdec.models.gguf_layer import GGUFDecoderLayer
    from specdec.models.gguf_linear import GGUFLinear

    prompts = random_prompts(3, seed=23)
    expected = token_ids(
        LLM(str(dirs["target4"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY)
    )
    llm = eagle3(dirs, 3, draft_quantization=form)
    head = llm.engine.drafter.head  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
    assert isinstance(head.layers[0], GGUFDecoderLayer)
    assert isinstance(head.fuse, GGUFLinear) and head.fuse.parts[0].kind == kind
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == expected
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


def test_an_eagle3_head_reads_the_fused_outputs_of_its_target_layers(dirs, monkeypatch):
    """The features an EAGLE-3 head is fed are fuse([h_0 ; h_1 ; h_2]) of the target's layers 0, 1
    and 2 (transformers' hidden states after those layers) at the positions fed."""
    fed: dict[int, list[tuple[int, torch.Tensor]]] = {}
    original = EagleDrafter._waiting_entries

    def recording(self, seq):
        start, features, tokens = original(self, seq)
        fed.setdefault(seq.request_id, []).append((start, features.clone()))
        return start, features, tokens

    monkeypatch.setattr(EagleDrafter, "_waiting_entries", recording)
    prompts = random_prompts(2, seed=22)
    llm = eagle3(dirs, 3)
    outputs = llm.generate(prompts, GREEDY)
    head, reference = llm.engine.drafter.head, load_hf(dirs["target4"])
    for prompt, output in zip(prompts, outputs):
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            states = reference(torch.tensor([sequence]), output_hidden_states=True).hidden_states  # each [1, L, H]
            fused = head.fuse(torch.cat([states[1][0], states[2][0], states[3][0]], dim=-1))  # [L, 3H] -> [L, H]
        for start, features in fed[output.request_id]:
            # float32 through three layers and the fuse, the engine's products against transformers':
            # 2.1e-5 apart at most on an AVX2-only AMD EPYC (a wrong layer is O(1) apart)
            torch.testing.assert_close(features, fused[start : start + len(features)], atol=5e-5, rtol=1e-4)


def test_the_head_reads_the_targets_features_of_the_tokens_it_follows(dirs, monkeypatch):
    """Every entry fed to the head as real is (f_p, token p+1) with f_p the target's hidden
    state at p over the final sequence (computed here by transformers), every position of the
    sequence but the last is fed exactly once per sequence over its rounds, and drafting steps
    run at the positions after."""
    fed: dict[int, list[tuple[int, torch.Tensor, list[int]]]] = {}
    original = EagleDrafter._waiting_entries

    def recording(self, seq):
        start, features, tokens = original(self, seq)
        fed.setdefault(seq.request_id, []).append((start, features.clone(), list(tokens)))
        return start, features, tokens

    monkeypatch.setattr(EagleDrafter, "_waiting_entries", recording)
    prompts = random_prompts(3, seed=12)
    outputs = eagle(dirs, 3).generate(prompts, GREEDY)
    reference = load_hf(dirs["target"])
    for prompt, output in zip(prompts, outputs):
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            hidden = reference(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]  # [L, H]
        entries = fed[output.request_id]
        covered = []
        for start, features, tokens in entries:
            n = len(tokens)
            assert tokens == sequence[start + 1 : start + 1 + n]
            torch.testing.assert_close(features, hidden[start : start + n], atol=2e-5, rtol=1e-4)
            covered += range(start, start + n)
        # the last round's features wait for a proposal that never comes: all but those are fed
        assert covered == list(range(len(covered))) and len(covered) >= len(prompt) - 1


def test_a_head_for_another_target_is_refused(dirs, tmp_path):
    other = save_tiny_model(tmp_path / "other", "llama", seed=4, hidden_size=32, num_attention_heads=2)
    with pytest.raises(HeadLoadError, match="trained for another target.*hidden_size 64 .the target: 32."):
        LLM(str(other), speculative_model=str(dirs["head"]), speculative_method="eagle", dtype="float32")
    qwen = save_tiny_model(tmp_path / "qwen", "qwen2", seed=4)  # same sizes, another layer type (q/k/v biases)
    with pytest.raises(HeadLoadError, match="qkv_bias False .the target: True."):
        LLM(str(qwen), speculative_model=str(dirs["head"]), speculative_method="eagle", dtype="float32")


def test_what_is_not_a_head_is_refused_by_name(dirs, tmp_path):
    with pytest.raises(HeadLoadError, match="no head.json: it is not an EAGLE head"):
        LLM(str(dirs["target"]), speculative_model=str(dirs["target"]), speculative_method="eagle", dtype="float32")
    with pytest.raises(HeadLoadError, match="is not a directory"):
        LLM(str(dirs["target"]), speculative_model=str(tmp_path / "missing"), speculative_method="eagle")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / HEAD_CONFIG).write_text("{not json")
    with pytest.raises(HeadLoadError, match="not valid JSON"):
        LLM(str(dirs["target"]), speculative_model=str(broken), speculative_method="eagle", dtype="float32")
    (broken / HEAD_CONFIG).write_text((dirs["head"] / HEAD_CONFIG).read_text())
    (broken / "head.safetensors").write_bytes((dirs["head"] / "head.safetensors").read_bytes()[:100])
    with pytest.raises(HeadLoadError, match="not a readable safetensors file"):
        LLM(str(dirs["target"]), speculative_model=str(broken), speculative_method="eagle", dtype="float32")
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(str(dirs["target"]), speculative_method="eagle")
    with pytest.raises(ValueError, match="draft_quantization must be"):
        LLM(
            str(dirs["target"]),
            speculative_model=str(dirs["head"]),
            speculative_method="eagle",
            draft_quantization="int3",
            dtype="float32",
        )
    assert json.loads((dirs["head"] / HEAD_CONFIG).read_text())["format"] == "specdec-eagle-head"


# a size in head.json past its bound (errors.CONFIG_BOUNDS, as a model's config.json): refused by
# name, value and bound before anything is allocated (the field, a value past it, config.json's
# name for it, the bound)
HEAD_SIZES_PAST_THEIR_BOUNDS = [
    ("num_layers", 10**9, "num_hidden_layers", 1024),
    ("vocab_size", 10**12, "vocab_size", 2**24),
    ("hidden_size", 2**30, "hidden_size", 2**17),
    ("intermediate_size", 2**40, "intermediate_size", 2**20),
    ("num_kv_heads", 2048, "num_key_value_heads", 1024),
    ("output_vocab_size", 2**25, "output_vocab_size", 2**24),
    ("max_position_embeddings", 10**12, "max_position_embeddings", 2**24),
]


def edited_head(dirs, tmp_path, **model) -> str:
    """A copy of the tiny head with those fields of head.json's model replaced."""
    head = tmp_path / "edited"
    head.mkdir()
    (head / "head.safetensors").write_bytes((dirs["head"] / "head.safetensors").read_bytes())
    config = json.loads((dirs["head"] / HEAD_CONFIG).read_text())
    config["model"].update(model)
    (head / HEAD_CONFIG).write_text(json.dumps(config))
    return str(head)


@pytest.mark.parametrize("field, value, named, bound", HEAD_SIZES_PAST_THEIR_BOUNDS)
def test_a_head_size_past_its_bound_is_refused_by_name(dirs, tmp_path, field, value, named, bound):
    head = edited_head(dirs, tmp_path, **{field: value})
    said = f"{field} ({named})" if field != named else field
    start = time.perf_counter()
    with pytest.raises(HeadLoadError, match=re.escape(f"head.json: {said} is {value}, more than {bound}")):
        LLM(str(dirs["target"]), speculative_model=head, speculative_method="eagle", dtype="float32")
    assert time.perf_counter() - start < 10.0  # the target loads; nothing of the head's size is made


@pytest.mark.parametrize("model", [{"hidden_size": "64"}, {"num_layers": 0}, {"sliding_windows": [2**40]}])
def test_a_head_size_not_an_integer_or_a_window_past_its_bound_is_refused(dirs, plain, tmp_path, model):
    head = edited_head(dirs, tmp_path, **model)
    field = next(iter(model))
    with pytest.raises(HeadLoadError, match=f"head.json: {field}"):
        load_head(head, plain.target.model.config, torch.float32)


def test_a_head_directory_is_recognised_as_eagle(dirs, plain, capsys):
    """speculative_model= a head's directory (no method) drafts with it, in the API and in
    `specdec generate --draft HEAD`."""
    from specdec.cli import main

    prompts = random_prompts(2, seed=13)
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["head"]),
        num_speculative_tokens=3,
        dtype="float32",
        speculative_k_policy="fixed",
    )
    assert isinstance(llm.engine.drafter, EagleDrafter)
    assert token_ids(llm.generate(prompts, GREEDY)) == token_ids(plain.generate(prompts, GREEDY))
    assert (
        main(
            [
                "generate",
                "--model",
                str(dirs["target"]),
                "--draft",
                str(dirs["head"]),
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
    assert "[eagle k=3]" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_target_hands_its_features_to_the_head(dirs, plain):
    """compile="on": the verify graphs return the hidden states too, and the output is the same."""
    prompts = random_prompts(3, seed=14)
    llm = eagle(dirs, 3, compile="on")
    outputs = llm.generate(prompts, GREEDY)
    assert llm.runner.return_hidden and llm.runner.query_buckets  # ran compiled, hidden states included
    assert token_ids(outputs) == token_ids(plain.generate(prompts, GREEDY))


def test_a_bfloat16_head_runs_prepacked_where_the_cpu_has_bfloat16(dirs):
    """On a CPU with native bfloat16 the head's linear layers are oneDNN-packed (as the target's
    eager ones are) and draft what the unpacked head drafts."""
    from specdec.models.cpu_linear import PackedLinear, can_pack

    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no native bfloat16: heads run unpacked")
    llm = eagle(dirs, 3, dtype="bfloat16")
    head = llm.engine.drafter.head
    assert isinstance(head.fc, PackedLinear) and isinstance(head.layers[0].mlp.down_proj, PackedLinear)
    prompts = random_prompts(2, seed=15)
    outputs = llm.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    unpacked = load_head(dirs["head"], llm.target.model.config, torch.bfloat16)
    g = torch.Generator().manual_seed(16)
    embeddings, features = (torch.randn(2, 5, 64, generator=g).to(torch.bfloat16) for _ in range(2))  # [B, T, H]
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        got, expected = (h(embeddings, features, positions).float() for h in (head, unpacked))
    torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)
    llm3 = eagle3(dirs, 3, dtype="bfloat16")  # an EAGLE-3 head's fuse layer too, fed the target's bf16 layers
    assert isinstance(llm3.engine.drafter.head.fuse, PackedLinear)
    outputs = llm3.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


@pytest.mark.slow
def test_an_eagle3_head_on_the_real_gguf_target_keeps_its_greedy_output(tmp_path):
    """On Qwen2.5-Coder-1.5B (Q4_K_M, run quantized), an EAGLE-3 head over three of its layers,
    scoring 2,048 tokens through those rows of its quantized output layer: greedy output equal
    to the target alone's (the head is untrained: it is its wiring that is tested)."""
    from specdec.models import registry
    from specdec.models.eagle import EagleHead, eagle3_feature_layers, head_config, save_head

    entry = registry.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    if not registry.is_fetched(entry):
        pytest.skip(f"{entry.name} is absent: `specdec fetch {entry.name}` (or `make qwen`) fetches it")
    plain = LLM(entry.name, speculative_method="none")
    config = plain.target.model.config
    torch.manual_seed(0)
    head = EagleHead(head_config(config, 2048, intermediate_size=256), eagle3_feature_layers(config.num_layers))
    head.output_token_ids.copy_(torch.randperm(config.vocab_size)[:2048].sort().values)
    save_head(head, tmp_path / "head", torch.bfloat16, target=entry.name)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompt = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    expected = token_ids(plain.chat(prompt, greedy))
    drafted = LLM(entry.name, speculative_model=str(tmp_path / "head"), num_speculative_tokens=3)
    assert token_ids(drafted.chat(prompt, greedy)) == expected


def test_a_new_version_of_the_head_swaps_in_between_rounds_and_keeps_the_output(dirs, tmp_path):
    """A server learning what it serves swaps an adapted head in between two steps, with requests
    running: the output stays the target's, and from then on the new head drafts exactly as a
    drafter loaded with it from the start does."""
    llm = eagle3(dirs, 3)
    drafter = llm.engine.drafter
    assert isinstance(drafter, EagleDrafter) and drafter.adaptable() is drafter
    newer = save_random_head(dirs["target4"], tmp_path / "v1", seed=9, feature_layers=(0, 1, 2), output_vocab=200)
    prompts = random_prompts(3, seed=13)
    plain4 = LLM(str(dirs["target4"]), dtype="float32", speculative_method="none")
    expected = token_ids(plain4.generate(prompts, GREEDY))
    seqs = [seq for prompt in prompts for seq in llm._new_sequences(prompt, GREEDY)]
    with torch.inference_mode():  # LLM.generate's loop, with the swap between two of its steps
        llm.engine.prepare(seqs)
        llm.engine.add_sequences(seqs)
        for step in range(1000):
            if step == 3:  # the requests mid-answer
                drafter.swap_head(drafter.load_version(newer))
            if not llm.engine.has_unfinished_requests():
                break
            llm.engine.step()
    assert drafter.head is not None and [seq.output_token_ids for seq in seqs] == expected
    prompt = random_prompts(1, seed=14)
    swapped = llm.generate(prompt, GREEDY)[0]
    from_start = LLM(
        str(dirs["target4"]),
        speculative_model=str(newer),
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
        dtype="float32",
    ).generate(prompt, GREEDY)[0]
    assert swapped.outputs[0].token_ids == from_start.outputs[0].token_ids
    assert swapped.metrics.accepted_by_position == from_start.metrics.accepted_by_position
    assert swapped.metrics.num_accepted_tokens == from_start.metrics.num_accepted_tokens


def test_a_version_that_cannot_take_the_heads_place_is_refused_by_name(dirs, tmp_path):
    drafter = eagle3(dirs, 3).engine.drafter
    in_use = drafter.head
    layers = save_random_head(dirs["target4"], tmp_path / "layers", seed=1, feature_layers=(0, 1, 3), output_vocab=200)
    with pytest.raises(HeadLoadError, match=r"reads the target's layers \[0, 1, 3\], the head in use \[0, 1, 2\]"):
        drafter.load_version(layers)
    vocab = save_random_head(dirs["target4"], tmp_path / "vocab", seed=1, feature_layers=(0, 1, 2), output_vocab=100)
    with pytest.raises(HeadLoadError, match="has another shape: output_vocab_size 100 .the head in use: 200."):
        drafter.load_version(vocab)
    damaged = save_random_head(dirs["target4"], tmp_path / "damaged", seed=1, feature_layers=(0, 1, 2))
    (damaged / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadLoadError, match="head.safetensors"):
        drafter.load_version(damaged)
    with pytest.raises(HeadLoadError, match="not an EAGLE head"):
        drafter.load_version(tmp_path)
    assert drafter.head is in_use
