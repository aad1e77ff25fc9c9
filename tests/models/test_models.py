"""The Llama family and the loader against transformers (the outside reference).

Every model here is a tiny random transformers model saved with save_pretrained: the
logits, the greedy output, the tokenizer and the EOS ids specdec reads from the directory
must agree with what transformers (and the `tokenizers` library) make of the same files.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer

from helpers import ARCHITECTURES, hf_config, load_hf, make_tokenizer
from specdec import LLM, SamplingParams
from specdec.models.loader import load_pretrained
from specdec.platform import Platform

VOCAB = 320
EOS = 1  # helpers.hf_config: bos 0, eos 1
PROMPT_LEN = 40  # longer than mistral's sliding window (16)
INIT_STD = 0.2  # large enough that logits are not flat and argmax has clear winners
ATOL = 1e-4
MAX_NEW = 24


# ----------------------------------------------------------------------------- helpers


def save_random_model(
    path: Path, arch: str, seed: int, max_shard_size: str | None = None, init_std: float = INIT_STD, **overrides
) -> Path:
    """helpers.save_tiny_model, but every parameter random: transformers initialises biases
    to 0 and norm weights to 1, which would hide a bias or a norm weight read wrongly."""
    from transformers import AutoModelForCausalLM

    config = hf_config(arch, VOCAB, initializer_range=init_std, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, init_std)
            elif "norm" in name:
                param.normal_(1.0, init_std)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    make_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def random_ids(seed: int, length: int) -> list[int]:
    """Random token ids, never BOS/EOS (so a prompt never ends a generation by itself)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


def specdec_logits(model, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """One full forward from a fresh cache, positions 0..T-1: [T, V] (or [B, T, V])."""
    ids = torch.as_tensor(ids)
    batched = ids.dim() == 2
    ids = ids if batched else ids[None]
    B, T = ids.shape
    with torch.inference_mode():
        logits = model(ids, torch.arange(T).expand(B, T), model.new_cache(B, T + 8))
    return logits if batched else logits[0]


def hf_logits(hf, ids: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    batched = ids.dim() == 2
    with torch.no_grad():
        logits = hf(ids if batched else ids[None]).logits.float()
    return logits if batched else logits[0]


def hf_generate(hf, prompt: list[int], max_new_tokens: int, eos_token_id=EOS) -> list[int]:
    """transformers' greedy generate, new tokens only, cut after the first EOS."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # an explicit mask: otherwise transformers masks prompt tokens equal to pad_token_id
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return truncate_at(out[0, len(prompt) :].tolist(), eos_token_id)


def hf_greedy_no_eos(hf, prompt: list[int], n: int) -> list[int]:
    """Plain argmax loop over transformers' forward, never stopping early."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt) :]


def truncate_at(tokens: list[int], eos) -> list[int]:
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def expected_finish(tokens: list[int], eos, max_tokens: int) -> str:
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    if tokens and tokens[-1] in eos:
        return "stop"
    assert len(tokens) == max_tokens
    return "length"


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


class SavedModels:
    """Tiny models saved once per module, with their transformers twin and a specdec load."""

    def __init__(self, factory):
        self.factory = factory
        self.saved: dict[str, tuple[Path, object, object]] = {}

    def get(self, name: str, arch: str | None = None, seed: int = 0, **kw):
        recipe = (arch or name, seed, copy.deepcopy(kw))
        if name not in self.saved:
            # a deep copy: transformers' config classes edit a rope_scaling dict in place
            path = save_random_model(self.factory.mktemp(name), arch or name, seed, **copy.deepcopy(kw))
            self.saved[name] = (recipe, (path, load_hf(path), load_pretrained(path, "float32").model))
        assert self.saved[name][0] == recipe, f"{name!r} asked for with two recipes"
        return self.saved[name][1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> SavedModels:
    return SavedModels(tmp_path_factory)


ARCH_SEEDS = {arch: 10 + i for i, arch in enumerate(ARCHITECTURES)}


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(models, arch):
    path, hf, model = models.get(arch, seed=ARCH_SEEDS[arch])
    assert model.dtype == torch.float32
    ids = random_ids(100 + ARCH_SEEDS[arch], PROMPT_LEN)
    ref = hf_logits(hf, ids)
    ours = specdec_logits(model, ids)
    assert ref.std() > 0.5, "logits too flat to tell implementations apart"
    assert max_diff(ours, ref) <= ATOL
    # batch of two different prompts, no padding
    batch = torch.tensor([ids, random_ids(200 + ARCH_SEEDS[arch], PROMPT_LEN)])
    assert max_diff(specdec_logits(model, batch), hf_logits(hf, batch)) <= ATOL


def test_architecture_switches_are_read(models):
    """The switches each architecture turns on reach specdec's model (so the logit tests
    above compare the features, not a plain Llama twice)."""
    cfg = {arch: models.get(arch, seed=ARCH_SEEDS[arch])[2].config for arch in ARCHITECTURES}
    assert cfg["mistral"].sliding_windows == (16, 16)
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 32
    assert cfg["llama3"].qkv_bias and cfg["llama3"].o_bias
    assert dict(cfg["llama3"].rope_scaling)["rope_type"] == "llama3"
    assert cfg["llama"].rope_scaling == () and not cfg["llama"].qkv_bias and not cfg["llama"].sliding_windows


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_then_incremental_decode_matches_full_forward(models, arch):
    path, hf, model = models.get(arch, seed=ARCH_SEEDS[arch])
    ids = random_ids(300 + ARCH_SEEDS[arch], PROMPT_LEN)
    full = specdec_logits(model, ids)
    assert max_diff(full, hf_logits(hf, ids)) <= ATOL
    cache = model.new_cache(1, PROMPT_LEN + 8)
    bounds = [0, 13, 14, 15, 21, 33, 34, PROMPT_LEN]  # a prefill, single tokens, verify-sized chunks
    chunks = []
    with torch.inference_mode():
        for start, end in zip(bounds, bounds[1:]):
            chunk = torch.tensor([ids[start:end]])
            chunks.append(model(chunk, torch.arange(start, end)[None], cache)[0])
    assert max_diff(torch.cat(chunks), full) <= ATOL


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_rejected_tokens_in_cache_are_overwritten(models, arch):
    """Feed 6 'draft' tokens past the prompt, then a different continuation at the same
    positions (the rejected drafts stay in the cache, past the row's length): the logits
    must equal a fresh forward over prompt + continuation."""
    path, hf, model = models.get(arch, seed=ARCH_SEEDS[arch])
    prompt, drafts, real = random_ids(400, 30), random_ids(401, 6), random_ids(402, 3)
    assert drafts[:3] != real
    cache = model.new_cache(1, 48)
    with torch.inference_mode():
        model(torch.tensor([prompt]), torch.arange(30)[None], cache)
        model(torch.tensor([drafts]), torch.arange(30, 36)[None], cache)
        got = model(torch.tensor([real]), torch.arange(30, 33)[None], cache)[0]
    ref = hf_logits(hf, prompt + real)[30:]
    assert max_diff(got, ref) <= ATOL


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_ragged_batch_rows_match_running_alone(models, arch):
    path, hf, model = models.get(arch, seed=ARCH_SEEDS[arch])
    s = ARCH_SEEDS[arch]
    a, b, pad = random_ids(500 + s, PROMPT_LEN), random_ids(501 + s, 23), random_ids(502 + s, PROMPT_LEN - 23)
    cache = model.new_cache(2, PROMPT_LEN + 8)
    with torch.inference_mode():
        # padded positions continue past each prompt's end (as the engine's prefill does)
        logits = model(torch.tensor([a, b + pad]), torch.arange(PROMPT_LEN).expand(2, PROMPT_LEN), cache)
    assert max_diff(logits[0], hf_logits(hf, a)) <= ATOL
    assert max_diff(logits[1, :23], hf_logits(hf, b)) <= ATOL

    # a decode step at different positions per row; row 1's padding (positions 24..39) is
    # stale cache that must be masked, position 23 is overwritten
    xa, xb = random_ids(503 + s, 3), random_ids(504 + s, 3)
    with torch.inference_mode():
        step = model(torch.tensor([xa, xb]), torch.tensor([[40, 41, 42], [23, 24, 25]]), cache)
    assert max_diff(step[0], hf_logits(hf, a + xa)[40:]) <= ATOL
    assert max_diff(step[1], hf_logits(hf, b + xb)[23:]) <= ATOL


# ----------------------------------------------------------------------------- greedy generation


def assert_generate_matches_transformers(
    path: Path, hf, prompts: list[list[int]], max_new: int = MAX_NEW, **llm_kw
) -> list[str]:
    llm = LLM(model=str(path), dtype="float32", speculative_method="none", **llm_kw)
    outputs = llm.generate(prompts, greedy(max_new))
    assert len(outputs) == len(prompts)
    finishes = []
    for prompt, out in zip(prompts, outputs):
        ref = hf_generate(hf, prompt, max_new)
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert got.finish_reason == expected_finish(ref, EOS, max_new)
        finishes.append(got.finish_reason)
    return finishes


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generate_matches_transformers(models, arch):
    path, hf, _ = models.get(arch, seed=ARCH_SEEDS[arch])
    s = ARCH_SEEDS[arch]
    # one prompt at a time, then all three as one ragged batch
    prompts = [random_ids(600 + s, PROMPT_LEN), random_ids(601 + s, 7), random_ids(602 + s, 19)]
    assert_generate_matches_transformers(path, hf, prompts[:1])
    assert_generate_matches_transformers(path, hf, prompts)


def test_greedy_generate_stops_at_eos_like_transformers(models):
    """Find a prompt whose greedy continuation hits EOS (id 1) before max_tokens: both
    transformers and specdec must stop there, with finish_reason 'stop'."""
    path, hf, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    prompt = None
    for seed in range(700, 760):
        candidate = random_ids(seed, 9)
        ref = hf_generate(hf, candidate, 40)
        if ref[-1] == EOS and len(ref) < 40:
            prompt = candidate
            break
    assert prompt is not None, "no prompt reaches EOS; change the seeds"
    finishes = assert_generate_matches_transformers(path, hf, [prompt, random_ids(799, 25)], max_new=40)
    assert finishes[0] == "stop"


# ----------------------------------------------------------------------------- real-checkpoint shapes


def test_sharded_checkpoint_loads_and_matches(models):
    path, hf, model = models.get("sharded", arch="qwen2", seed=21, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and all((path / s).is_file() for s in shards)
    assert not (path / "model.safetensors").exists()
    ids = random_ids(800, PROMPT_LEN)
    assert max_diff(specdec_logits(model, ids), hf_logits(hf, ids)) <= ATOL
    assert_generate_matches_transformers(path, hf, [ids, random_ids(801, 11)])


def test_tied_embeddings_load_and_match(models):
    path, hf, model = models.get("tied", arch="llama", seed=22, tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = random_ids(810, PROMPT_LEN)
    assert max_diff(specdec_logits(model, ids), hf_logits(hf, ids)) <= ATOL
    assert_generate_matches_transformers(path, hf, [ids, random_ids(811, 5)])


def test_tied_checkpoint_that_also_stores_lm_head(models, tmp_path):
    """Some tied checkpoints store lm_head.weight too (a copy of the embedding): still loads."""
    from safetensors.torch import load_file, save_file

    src, hf, _ = models.get("tied", arch="llama", seed=22, tie_word_embeddings=True)
    path = tmp_path / "tied_with_head"
    shutil.copytree(src, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = load_pretrained(path, "float32").model
    ids = random_ids(812, 20)
    assert max_diff(specdec_logits(model, ids), hf_logits(hf, ids)) <= ATOL


def _edit_checkpoint(src: Path, path: Path, how: str) -> None:
    """A copy of src changed the way real checkpoints differ from what transformers saves."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    if how == "tied_config_own_head":  # tie_word_embeddings true, yet a head of its own stored
        tensors = load_file(str(path / "model.safetensors"))
        generator = torch.Generator().manual_seed(5)
        tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=generator)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif how == "mistral_bias_flags":  # flags transformers' Mistral ignores
        config.update(attention_bias=True, mlp_bias=True)
    elif how == "llama3_no_original_context":  # transformers v5 takes max_position_embeddings
        config["rope_parameters"].pop("original_max_position_embeddings")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how, arch, overrides",
    [
        ("tied_config_own_head", "llama", {"tie_word_embeddings": True}),
        ("mistral_bias_flags", "mistral", {}),
        ("llama3_no_original_context", "llama3", {}),
    ],
)
def test_checkpoints_transformers_reads_its_own_way(models, tmp_path, how, arch, overrides):
    """transformers (loading the same edited directory) is the reference."""
    src, _, _ = models.get(how, arch=arch, seed=40 + len(how), **overrides)
    path = tmp_path / how
    _edit_checkpoint(src, path, how)
    hf = load_hf(path)
    model = load_pretrained(path, "float32").model
    ids = random_ids(870 + len(how), PROMPT_LEN)
    assert max_diff(specdec_logits(model, ids), hf_logits(hf, ids)) <= ATOL


def v4_style(config: dict, legacy_type_key: bool = False) -> dict:
    """A transformers-v5 config.json rewritten the way v4 saved it (and many real checkpoints
    still are): rope_theta at the top, rope_scaling instead of rope_parameters, no layer_types."""
    config = dict(config)
    params = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    if rope_type != "default":
        config["rope_scaling"] = {("type" if legacy_type_key else "rope_type"): rope_type, **params}
    config.pop("layer_types", None)
    return config


CONFIG_VARIANTS = {
    # name: (arch, save overrides, rewrite config.json v4-style, use the legacy "type" key)
    "llama_linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, False, False),
    "llama_linear_rope_v4": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, True, True),
    "llama3_v4": ("llama3", {}, True, False),
    # wavelengths on both sides of and between the two cut-offs, so the smooth blend is used
    "llama3_blend": (
        "llama3",
        {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        },
        False,
        False,
    ),
    "mistral_v4": ("mistral", {}, True, False),
    "qwen2_sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        False,
        False,
    ),
    "qwen2_sliding_v4": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        True,
        False,
    ),
    "qwen3_v4": ("qwen3", {}, True, False),
}


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_config_variants_match_transformers(models, tmp_path, variant):
    """Rope scaling, per-layer sliding windows and v4-style config files: the transformers
    model saved from the v5 config is the reference for both spellings."""
    arch, overrides, rewrite, legacy = CONFIG_VARIANTS[variant]
    base = variant.removesuffix("_v4")
    src, hf, model = models.get(base, arch=arch, seed=ARCH_SEEDS.get(base, 30 + len(base)), **overrides)
    path = src
    if rewrite:
        path = tmp_path / variant
        shutil.copytree(src, path)
        config = v4_style(json.loads((src / "config.json").read_text()), legacy)
        assert "rope_parameters" not in config and "layer_types" not in config
        (path / "config.json").write_text(json.dumps(config))
        model = load_pretrained(path, "float32").model
    if "sliding" in variant:
        assert model.config.sliding_windows == (None, 16)
    ids = random_ids(850 + len(variant), PROMPT_LEN)
    assert max_diff(specdec_logits(model, ids), hf_logits(hf, ids)) <= ATOL


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_roughly_agrees(models, dtype):
    path, hf, _ = models.get("llama3", seed=ARCH_SEEDS["llama3"])
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    model = load_pretrained(path, name).model
    assert model.dtype == dtype
    assert all(p.dtype == dtype for p in model.parameters())
    ids = random_ids(900, PROMPT_LEN)
    ref = hf_logits(hf, ids)
    ours = specdec_logits(model, ids)
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    assert max_diff(ours, ref) < 0.1 * ref.abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"argmax agrees on only {agree:.0%} of positions"

    llm = LLM(model=str(path), dtype=name, speculative_method="none")
    assert llm.target.model.dtype == dtype
    prompts = [random_ids(901, 17), random_ids(902, 6)]
    outs = llm.generate(prompts, greedy(12))
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert 1 <= len(tokens) <= 12 and all(0 <= t < VOCAB for t in tokens)
        assert out.outputs[0].finish_reason in ("stop", "length")
        # the first token is the argmax of the prompt's last logits: compare with float32
        assert tokens[0] == int(hf_logits(hf, prompt)[-1].argmax())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_steps_agree_with_float32(models, dtype):
    """Decode steps and verify-sized chunks (attention in float32 on the CPU) against
    transformers in float32: as close as the half-precision prefill is."""
    path, hf, _ = models.get("llama3", seed=ARCH_SEEDS["llama3"])
    model = load_pretrained(path, {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]).model
    ids = random_ids(903, PROMPT_LEN)
    ref = hf_logits(hf, ids)
    cache = model.new_cache(1, PROMPT_LEN + 8)
    bounds = [0, 20] + list(range(21, 31)) + [36, PROMPT_LEN]  # a prefill, one-token steps, verify-sized chunks
    chunks = []
    with torch.inference_mode():
        for start, end in zip(bounds, bounds[1:]):
            chunks.append(model(torch.tensor([ids[start:end]]), torch.arange(start, end)[None], cache)[0])
    ours = torch.cat(chunks)
    assert max_diff(ours, ref) < 0.1 * ref.abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"argmax agrees on only {agree:.0%} of positions"


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_auto_dtype_follows_the_config(models, tmp_path, key):
    src, _, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    path = tmp_path / "bf16"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    config[key] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    native_bf16 = Platform("cpu", "AVX512", native_bf16=True, native_fp16=False)  # where bf16 is emulated, see
    assert (
        LLM(model=str(path), platform=native_bf16, speculative_method="none").target.model.dtype == torch.bfloat16
    )  # test_runner.py
    assert LLM(model=str(path), dtype="float32", speculative_method="none").target.model.dtype == torch.float32
    assert (
        LLM(model=str(src), speculative_method="none").target.model.dtype == torch.float32
    )  # the saved config says float32


# ----------------------------------------------------------------------------- tokenizer


TEXT_PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(3):"


def test_text_prompt_encodes_like_tokenizers_and_output_decodes(models):
    path, hf, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    reference = RustTokenizer.from_file(str(path / "tokenizer.json"))
    expected_ids = reference.encode(TEXT_PROMPT).ids
    assert expected_ids[0] == 0  # the post-processor's <s>
    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    assert llm.tokenizer.encode(TEXT_PROMPT) == expected_ids
    assert llm.tokenizer.decode(expected_ids) == reference.decode(expected_ids) == TEXT_PROMPT

    out = llm.generate(TEXT_PROMPT, greedy(16))[0]
    assert out.prompt == TEXT_PROMPT
    assert out.prompt_token_ids == expected_ids
    completion = out.outputs[0]
    assert completion.token_ids == hf_generate(hf, expected_ids, 16)
    assert completion.text == reference.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.text  # 16 random tokens are not all special

    # a list of texts gives one output per text, in order
    outs = llm.generate([TEXT_PROMPT, "class Point:"], greedy(4))
    assert [o.prompt_token_ids for o in outs] == [expected_ids, reference.encode("class Point:").ids]


def test_output_text_reads_as_it_does_after_the_prompt_with_a_sentencepiece_decoder():
    """Llama 2 / Mistral style: the decoder strips the first token's leading space, so text
    decoded alone loses the space between prompt and output; decode_after keeps it. The
    reference: the tokenizers library decoding prompt and output together."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from specdec.models.tokenizer import Tokenizer

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.train_from_iterator(
        [TEXT_PROMPT * 20 + " for i in range(10): print(i, add(i, i))"],
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    tokenizer = Tokenizer(backend)
    ids = backend.encode("for i in range(10): print(i, add(i, i))").ids
    lost_a_space = 0
    for cut in range(1, len(ids)):
        whole, before = backend.decode(ids), backend.decode(ids[:cut])
        assert before + tokenizer.decode_after(ids[:cut], ids[cut:]) == whole, cut
        lost_a_space += before + backend.decode(ids[cut:]) != whole
    assert lost_a_space > 0  # decoding the output alone would have been wrong


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "return a + b"},
    {"role": "user", "content": "and a class?"},
]


def with_chat_template(models, tmp_path, how: str) -> Path:
    src, _, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    path = tmp_path / f"chat_{how}"
    shutil.copytree(src, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if how == "string":
        config["chat_template"] = CHAT_TEMPLATE
    elif how == "list":
        config["chat_template"] = [
            {"name": "tool_use", "template": "WRONG {{ messages }}"},
            {"name": "default", "template": CHAT_TEMPLATE},
        ]
    elif how == "jinja_file":
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("how", ["string", "list", "jinja_file"])
def test_chat_template_renders(models, tmp_path, how):
    path = with_chat_template(models, tmp_path, how)
    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    rendered = llm.tokenizer.apply_chat_template(MESSAGES)
    expected = (
        "<s><|system|>\nYou write Python.</s>\n<|user|>\ndef add(a, b):</s>\n"
        "<|assistant|>\nreturn a + b</s>\n<|user|>\nand a class?</s>\n<|assistant|>\n"
    )
    assert rendered == expected
    assert llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected.removesuffix(
        "<|assistant|>\n"
    )
    if how == "string":  # transformers renders the same template identically
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(path)
        assert hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    with pytest.raises(ValueError, match="unknown role tool"):
        llm.tokenizer.apply_chat_template(MESSAGES + [{"role": "tool", "content": "x"}])


FEATURE_TEMPLATE = (  # what templates written for transformers use beyond plain Jinja
    "{% for message in messages %}{% if message['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message | tojson }}{% endif %}\n{% endfor %}"
    "{{ strftime_now('%Y') | length }}"
)


@pytest.mark.parametrize("where", ["config", "jinja_file_over_config"])
def test_chat_template_features_and_precedence_match_transformers(models, tmp_path, where):
    """{% break %}, tojson (no HTML escaping, keys in order, non-ASCII kept), {% generation %},
    strftime_now; and chat_template.jinja taking precedence over tokenizer_config.json's."""
    from transformers import AutoTokenizer

    path = with_chat_template(models, tmp_path, "string")
    config = json.loads((path / "tokenizer_config.json").read_text())
    if where == "config":
        config["chat_template"] = FEATURE_TEMPLATE
    else:
        (path / "chat_template.jinja").write_text(FEATURE_TEMPLATE)  # the config keeps CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [
        {"role": "user", "content": "hi <b> & é"},
        {"role": "assistant", "content": "ok"},
        {"role": "stop", "content": ""},
        {"role": "user", "content": "never shown"},
    ]
    ours = LLM(model=str(path), dtype="float32", speculative_method="none").tokenizer.apply_chat_template(messages)
    theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs and '"content": "hi <b> & é"' in ours and "never shown" not in ours


def test_named_chat_templates_without_a_default_are_an_error(models, tmp_path):
    path = with_chat_template(models, tmp_path, "list")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "A"}, {"name": "rag", "template": "B"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="none named 'default'"):
        LLM(model=str(path), dtype="float32", speculative_method="none")


def test_chat_generates_from_the_rendered_template(models, tmp_path):
    path = with_chat_template(models, tmp_path, "string")
    _, hf, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    [out] = llm.chat(MESSAGES, greedy(10))
    reference = RustTokenizer.from_file(str(path / "tokenizer.json"))
    ids = reference.encode(llm.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1  # the template's <s>, not a second one
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_generate(hf, ids, 10)


def test_chat_takes_a_list_of_conversations_as_vllm_does(models, tmp_path):
    """One RequestOutput per conversation, in order, each as the conversation alone gives it
    and as transformers' apply_chat_template renders it."""
    from transformers import AutoTokenizer

    path = with_chat_template(models, tmp_path, "string")
    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    conversations = [MESSAGES, [{"role": "user", "content": "print(1)"}], MESSAGES[:1]]
    outputs = llm.chat(conversations, greedy(6))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(outputs) == 3
    for conversation, output in zip(conversations, outputs):
        rendered = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert output.prompt_token_ids == hf_tokenizer.encode(rendered, add_special_tokens=False)
        assert output.outputs[0].token_ids == llm.chat(conversation, greedy(6))[0].outputs[0].token_ids


def test_no_chat_template_is_a_clear_error(models):
    path, _, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    with pytest.raises(ValueError, match="chat template"):
        llm.tokenizer.apply_chat_template(MESSAGES)


# ----------------------------------------------------------------------------- EOS ids


@pytest.fixture(scope="module")
def eos_case(models):
    """A prompt and its greedy continuation (never stopping), and two tokens X, Y that first
    appear in it at positions >= 3, X before Y, with no EOS (id 1) before Y."""
    path, hf, _ = models.get("llama", seed=ARCH_SEEDS["llama"])
    for seed in range(1000, 1050):
        prompt = random_ids(seed, 12)
        free = hf_greedy_no_eos(hf, prompt, 16)
        firsts = [t for i, t in enumerate(free) if i >= 3 and free.index(t) == i and t != EOS]
        if len(firsts) >= 2 and EOS not in free[: free.index(firsts[1]) + 1]:
            return path, hf, prompt, free, firsts[0], firsts[1]
    raise AssertionError("no suitable prompt; change the seeds")


EOS_CASES = {
    # name: (generation_config.json eos (absent if "none"), config.json eos (absent if "none"))
    "gen_int": ("X", EOS),
    "gen_list": (["Y", "X"], EOS),
    "gen_list_config_int": (["Y"], "X"),
    "config_list_only": ("none", [EOS, "Y", "X"]),
    "config_int_only": ("none", "Y"),
    "gen_int_config_list": ("Y", [EOS, "X"]),
    "no_eos_anywhere": ("none", "none"),
}


@pytest.mark.parametrize("case", list(EOS_CASES))
def test_eos_ids_from_generation_config_and_config(eos_case, tmp_path, case):
    src, hf, prompt, free, x, y = eos_case
    path = tmp_path / case
    shutil.copytree(src, path)
    name = {"X": x, "Y": y}

    def resolve(value):
        if isinstance(value, list):
            return [name.get(v, v) for v in value]
        return name.get(value, value)

    gen_value, config_value = (resolve(v) for v in EOS_CASES[case])
    config = json.loads((path / "config.json").read_text())
    config.pop("eos_token_id", None)
    if config_value != "none":
        config["eos_token_id"] = config_value
    (path / "config.json").write_text(json.dumps(config))
    gen_file = path / "generation_config.json"
    if gen_value == "none":
        gen_file.unlink()
    else:
        gen = json.loads(gen_file.read_text())
        gen["eos_token_id"] = gen_value
        gen_file.write_text(json.dumps(gen))

    expected_ids = set()
    for value in (gen_value, config_value):
        if value != "none":
            expected_ids |= set(value) if isinstance(value, list) else {value}

    llm = LLM(model=str(path), dtype="float32", speculative_method="none")
    assert set(llm.target.eos_token_ids) == expected_ids
    out = llm.generate(prompt, greedy(16))[0].outputs[0]
    expected = truncate_at(free, expected_ids)
    assert out.token_ids == expected
    assert out.finish_reason == ("stop" if len(expected) < 16 else "length")
    if expected_ids:
        assert out.token_ids[-1] in expected_ids and len(expected) < 16
        assert out.token_ids == hf_generate(hf, prompt, 16, eos_token_id=sorted(expected_ids))
    else:
        assert out.token_ids == free


def test_chat_template_kwargs_are_the_templates_variables_as_transformers_passes_them():
    """vLLM's chat_template_kwargs: more variables for the template (transformers' extra keyword
    arguments to apply_chat_template render the same); the request's own names are refused."""
    from transformers import PreTrainedTokenizerFast

    from helpers import make_tokenizer
    from specdec.models.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    ours = Tokenizer(make_tokenizer(320), chat_template=template)
    theirs = PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(320))
    theirs.chat_template = template
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({"enable_thinking": True}, {"enable_thinking": False}, {}):
        want = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, template_kwargs=kwargs) == want
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        ours.apply_chat_template(messages, template_kwargs={"messages": []})


def test_continue_final_message_and_documents_render_as_transformers_renders_them():
    """continue_final_message: the text ends where the last message's content does (transformers'
    cut); documents reach the template as its variable; with add_generation_prompt it is refused."""
    from transformers import PreTrainedTokenizerFast

    from helpers import make_tokenizer
    from specdec.models.tokenizer import Tokenizer

    template = (
        "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ours = Tokenizer(make_tokenizer(320), chat_template=template)
    theirs = PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(320))
    theirs.chat_template = template
    messages = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "def add(a, b):"}]
    documents = [{"title": "math", "text": "a + b"}]
    want = theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True, documents=documents)
    got = ours.apply_chat_template(messages, False, None, {"documents": documents}, continue_final_message=True)
    assert got == want and got.endswith("<assistant>def add(a, b):") and got.startswith("[math]")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ours.apply_chat_template(messages, True, continue_final_message=True)
