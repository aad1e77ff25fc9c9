"""Bad input gets a clear error that names the problem, and leaves nothing half-done.

Model directories are broken one way at a time (copies of a good tiny checkpoint saved with
transformers); requests are broken one field at a time, and after each error the same LLM
must still generate exactly what it generated before.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import TEXT, make_tokenizer, save_tiny_model

from specdec import LLM, ModelLoadError, SamplingParams

VOCAB = 320
MAX_POSITIONS = 256  # helpers.hf_config
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("good"), "llama", seed=0, init_std=0.2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    path = save_tiny_model(tmp_path_factory.mktemp("sharded"), "llama", seed=1, init_std=0.2, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    """A draft with the target's tokenizer (helpers' BPE, same vocabulary), other weights."""
    return save_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=7, init_std=0.2)


@pytest.fixture
def workdir(tmp_path_factory) -> Path:
    """A fresh directory whose path holds none of the words the messages are checked for
    (tmp_path is named after the test: 'test_missing_...', 'test_corrupt_...')."""
    return tmp_path_factory.mktemp("case")


def broken_copy(src: Path, workdir: Path, name: str = "model") -> Path:
    path = workdir / name
    shutil.copytree(src, path)
    return path


def edit_config(path: Path, **changes) -> None:
    """Set (or, with value ..., delete) fields of config.json."""
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def load_error(path: Path, error=ModelLoadError, **kw) -> str:
    with pytest.raises(error) as info:
        LLM(model=str(path), **kw)
    return str(info.value)


def random_ids(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


# ----------------------------------------------------------------------------- directory and config


def test_unmodified_copy_loads(good, workdir):
    """The control: a plain copy of the directory every test below breaks loads and runs."""
    out = LLM(model=str(broken_copy(good, workdir))).generate(random_ids(1, 5), SamplingParams(temperature=0,
                                                                                                max_tokens=3))
    assert 1 <= len(out[0].outputs[0].token_ids) <= 3


def test_missing_directory(workdir):
    path = workdir / "no_such_model"
    message = load_error(path)
    assert str(path) in message and "does not exist" in message


def test_path_is_a_file(workdir):
    path = workdir / "model.safetensors"
    path.write_bytes(b"not a directory")
    assert str(path) in load_error(path)


def test_missing_config_json(good, workdir):
    path = broken_copy(good, workdir)
    (path / "config.json").unlink()
    message = load_error(path)
    assert "config.json" in message and "missing" in message


def test_config_not_json(good, workdir):
    path = broken_copy(good, workdir)
    (path / "config.json").write_text('{"hidden_size": 64, "vocab_size": ')
    message = load_error(path)
    assert "config.json" in message and "JSON" in message


def test_config_not_an_object(good, workdir):
    path = broken_copy(good, workdir)
    (path / "config.json").write_text("[1, 2, 3]")
    assert "config.json" in load_error(path)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                                   "intermediate_size"])
def test_config_missing_required_field(good, workdir, field):
    path = broken_copy(good, workdir)
    edit_config(path, **{field: ...})
    message = load_error(path)
    assert field in message and "config.json" in message


def test_config_field_set_to_null(good, workdir):
    path = broken_copy(good, workdir)
    edit_config(path, hidden_size=None)
    assert "hidden_size" in load_error(path)


def test_unsupported_architecture_lists_supported(good, workdir):
    path = broken_copy(good, workdir)
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = load_error(path)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in SUPPORTED), message


def test_unsupported_model_type_without_architectures(good, workdir):
    path = broken_copy(good, workdir)
    edit_config(path, architectures=..., model_type="gpt_neox")
    message = load_error(path)
    assert "gpt_neox" in message and all(name in message for name in SUPPORTED), message


def test_model_type_alone_is_enough(good, workdir):
    """No 'architectures', but a supported model_type: loads (the control for the above)."""
    path = broken_copy(good, workdir)
    edit_config(path, architectures=..., model_type="llama")
    LLM(model=str(path))


@pytest.mark.parametrize("changes, names", [
    ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
    # transformers v5 style (rope_parameters) and v4 style (rope_theta + rope_scaling)
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ["yarn"]),
    ({"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["dynamic"]),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, ["llama3", "low_freq_factor"]),
    ({"rope_parameters": ..., "rope_scaling": {"rope_type": "linear"}}, ["linear", "factor"]),
])
def test_unsupported_or_incomplete_features(good, workdir, changes, names):
    path = broken_copy(good, workdir)
    edit_config(path, **changes)
    message = load_error(path)
    assert all(name in message for name in names), message


def test_heads_not_a_multiple_of_kv_heads(good, workdir):
    path = broken_copy(good, workdir)
    edit_config(path, num_key_value_heads=3)
    message = load_error(path)
    assert "num_key_value_heads" in message and "config.json" in message


@pytest.mark.parametrize("changes, names", [  # loaded before as if fine, then failed at the first forward
    ({"rms_norm_eps": None}, None),  # null means the default, as in transformers
    ({"rms_norm_eps": -1.0}, ["rms_norm_eps"]),
    ({"num_attention_heads": 0}, ["num_attention_heads"]),
    ({"vocab_size": -5}, ["vocab_size"]),
    ({"num_key_value_heads": -2}, ["num_key_value_heads"]),
    ({"hidden_size": "64"}, ["hidden_size"]),
    ({"rope_theta": None, "rope_parameters": ...}, None),  # the default theta
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, ["rope_theta"]),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4,
      "layer_types": ["sliding_attention"]}, ["layer_types", "2"]),
    ({"dtype": "float64", "torch_dtype": ...}, ["float64", "config.json"]),
    # these were TypeErrors from deep in the loader (found probing)
    ({"dtype": ["float32"], "torch_dtype": ...}, ["['float32']", "config.json"]),
    ({"architectures": 5}, ["'architectures' must be a list", "5"]),
    ({"rope_scaling": [8.0]}, ["rope_scaling must be an object", "[8.0]"]),
    ({"rope_parameters": "linear"}, ["rope_parameters must be an object", "'linear'"]),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 4, "use_sliding_window": True,
      "max_window_layers": None}, ["max_window_layers", "None"]),
])
def test_config_values_are_checked_at_load(good, workdir, changes, names):
    path = broken_copy(good, workdir)
    edit_config(path, **changes)
    if names is None:
        out = LLM(model=str(path)).generate(random_ids(3, 5), SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    else:
        message = load_error(path)
        assert all(name in message for name in names) and "config.json" in message, message


@pytest.mark.parametrize("device, message", [("gpu", "device must be"), ("cuda:x", "device must be"),
                                             ("cuda", "CUDA is not available|CUDA devices")])
def test_bad_device_is_a_clear_error(good, device, message):
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"  # one past the last
    with pytest.raises(ValueError, match=message):
        LLM(model=str(good), device=device)


def test_unknown_dtype(good):
    with pytest.raises(ValueError, match="int8") as info:
        LLM(model=str(good), dtype="int8")
    assert "bfloat16" in str(info.value)  # says what is supported


# ----------------------------------------------------------------------------- weights


def test_no_weights(good, workdir):
    path = broken_copy(good, workdir)
    (path / "model.safetensors").unlink()
    message = load_error(path)
    assert "model.safetensors" in message and str(path) in message


def test_pickle_checkpoint_is_not_loaded(good, workdir):
    from safetensors.torch import load_file

    path = broken_copy(good, workdir)
    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    message = load_error(path)
    assert "pytorch_model.bin" in message and "pickle" in message and "safetensors" in message


def test_corrupt_safetensors(good, workdir):
    path = broken_copy(good, workdir)
    g = torch.Generator().manual_seed(3)
    (path / "model.safetensors").write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g).tolist()))
    message = load_error(path)
    assert "model.safetensors" in message and "corrupt" in message


def test_corrupt_safetensors_header(good, workdir):
    """A plausible header length followed by bytes that are not a JSON header."""
    path = broken_copy(good, workdir)
    g = torch.Generator().manual_seed(4)
    junk = bytes(torch.randint(0, 256, (500,), generator=g).tolist())
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 200) + junk)
    assert "model.safetensors" in load_error(path)


def test_truncated_safetensors(good, workdir):
    path = broken_copy(good, workdir)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    message = load_error(path)
    assert "model.safetensors" in message and "truncated" in message


def test_truncated_shard(sharded, workdir):
    path = broken_copy(sharded, workdir)
    shard = sorted(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[:len(data) - 100])
    assert shard in load_error(path)


def test_shard_listed_in_index_is_missing(sharded, workdir):
    path = broken_copy(sharded, workdir)
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) >= 3
    (path / shards[1]).unlink()
    message = load_error(path)
    assert shards[1] in message and "missing" in message


def test_index_without_weight_map(sharded, workdir):
    path = broken_copy(sharded, workdir)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    message = load_error(path)
    assert "model.safetensors.index.json" in message and "weight_map" in message


def test_index_naming_no_file(sharded, workdir):
    path = broken_copy(sharded, workdir)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = None
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "weight_map" in load_error(path)


def test_index_not_json(sharded, workdir):
    path = broken_copy(sharded, workdir)
    (path / "model.safetensors.index.json").write_text("{")
    assert "model.safetensors.index.json" in load_error(path)


def rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


WRONG_SHAPES = {
    # name: {checkpoint tensor (under model.layers.): wrong shape}; every one must be reported,
    # by its name in the checkpoint, with the shape it has
    "up_proj_rows": {"1.mlp.up_proj.weight": (100, 64)},
    "k_proj_columns": {"0.self_attn.k_proj.weight": (32, 60)},
    "k_proj_rows": {"0.self_attn.k_proj.weight": (16, 64)},
    # wrong pieces whose sizes happen to add up to the right total
    "gate_and_up_sum_right": {"0.mlp.gate_proj.weight": (120, 64), "0.mlp.up_proj.weight": (136, 64)},
    "q_and_v_sum_right": {"0.self_attn.q_proj.weight": (48, 64), "0.self_attn.v_proj.weight": (48, 64)},
    "norm_weight": {"1.post_attention_layernorm.weight": (65,)},
}


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_tensor_of_wrong_shape(good, workdir, case):
    path = broken_copy(good, workdir)
    g = torch.Generator().manual_seed(5)

    def edit(tensors):
        for name, shape in WRONG_SHAPES[case].items():
            assert f"model.layers.{name}" in tensors
            tensors[f"model.layers.{name}"] = torch.randn(shape, generator=g)

    rewrite_weights(path, edit)
    message = load_error(path)
    named = [(name, shape) for name, shape in WRONG_SHAPES[case].items()
             if f"layers.{name}" in message and str(tuple(shape)) in message]
    assert named, f"the message names no wrong tensor with its shape: {message}"


def test_config_disagrees_with_weights(good, workdir):
    """The same problem from the other side: config.json says intermediate_size 96."""
    path = broken_copy(good, workdir)
    edit_config(path, intermediate_size=96)
    message = load_error(path)
    assert "mlp" in message and ("(128, 64)" in message or "(64, 128)" in message), message


@pytest.mark.parametrize("missing", ["0.self_attn.k_proj.weight", "1.mlp.up_proj.weight", "0.input_layernorm.weight"])
def test_missing_tensor_is_named(good, workdir, missing):
    path = broken_copy(good, workdir)
    rewrite_weights(path, lambda tensors: tensors.pop(f"model.layers.{missing}"))
    message = load_error(path)
    assert f"layers.{missing}" in message and "missing" in message, message


def test_unexpected_tensor_is_named(good, workdir):
    path = broken_copy(good, workdir)

    def edit(tensors):
        tensors["model.layers.0.self_attn.extra.weight"] = torch.randn(4, 4)

    rewrite_weights(path, edit)
    assert "layers.0.self_attn.extra.weight" in load_error(path)


# ----------------------------------------------------------------------------- tokenizer and generation config


def test_missing_tokenizer_json_unless_skipped(good, workdir):
    path = broken_copy(good, workdir)
    (path / "tokenizer.json").unlink()
    message = load_error(path)
    assert "tokenizer.json" in message and "skip_tokenizer_init" in message

    llm = LLM(model=str(path), skip_tokenizer_init=True)
    reference = LLM(model=str(good))
    prompt, params = random_ids(20, 9), SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == reference.generate(prompt, params)[0].outputs[0].token_ids
    assert out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("def add(a, b):", params)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == out.token_ids


def test_corrupt_tokenizer_json(good, workdir):
    path = broken_copy(good, workdir)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert "tokenizer" in load_error(path)


def test_corrupt_tokenizer_config_names_the_file(good, workdir):
    path = broken_copy(good, workdir)
    (path / "tokenizer_config.json").write_text("{bos_token: <s>}")
    assert "tokenizer_config.json" in load_error(path)


def test_corrupt_generation_config(good, workdir):
    path = broken_copy(good, workdir)
    (path / "generation_config.json").write_text("{")
    message = load_error(path)
    assert "generation_config.json" in message and "JSON" in message


def test_a_tokenizer_larger_than_the_vocabulary(good, workdir):
    """A tokenizer whose ids run past vocab_size is not the model's: said at load, not as an
    out-of-range prompt when the user gave text."""
    path = broken_copy(good, workdir)
    make_tokenizer(VOCAB + 40, TEXT * 3 + "".join(chr(c) for c in range(0x400, 0x500))).save(str(path / "tokenizer.json"))
    message = load_error(path)
    assert f"tokenizer.json has token ids up to {VOCAB + 39}, beyond config.json's vocab_size {VOCAB}" in message


@pytest.mark.parametrize("file, value", [("generation_config.json", True), ("generation_config.json", "</s>"),
                                         ("generation_config.json", [1, VOCAB]), ("config.json", -1),
                                         ("generation_config.json", [1, True])])  # True == 1: not skipped as seen
def test_eos_ids_that_are_not_token_ids(good, workdir, file, value):
    path = broken_copy(good, workdir)
    data = json.loads((path / file).read_text()) if (path / file).is_file() else {}
    (path / file).write_text(json.dumps({**data, "eos_token_id": value}))
    message = load_error(path)
    assert file in message and f"eos_token_id must be token ids in [0, {VOCAB})" in message


# ----------------------------------------------------------------------------- draft vocabulary


def save_with_other_tokenizer(path: Path, vocab_size: int, text: str, tokenizer_size: int, seed: int = 9) -> Path:
    """A tiny model whose BPE (tokenizer_size tokens) is trained on `text`."""
    save_tiny_model(path, "llama", seed=seed, vocab_size=vocab_size, init_std=0.2, tokenizer=True)
    tok = make_tokenizer(tokenizer_size, text)
    assert tok.get_vocab_size() == tokenizer_size
    tok.save(str(path / "tokenizer.json"))
    return path


OTHER_TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
              "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. ") * 8


def test_draft_with_the_same_tokenizer_loads(good, draft):
    """The control: a draft sharing the target's tokenizer is accepted and changes nothing."""
    params = SamplingParams(temperature=0, max_tokens=10)
    prompt = random_ids(30, 12)
    target_only = LLM(model=str(good)).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(model=str(good), speculative_model=str(draft), num_speculative_tokens=3)
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == target_only


@pytest.mark.parametrize("how", ["smaller_vocab", "same_size_other_text", "other_size_no_tokenizers"])
def test_draft_with_a_different_vocabulary(good, workdir, how):
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(good / "tokenizer.json")).get_vocab_size()
    if how == "smaller_vocab":  # the same text, fewer merges: a prefix of the target's vocabulary
        other = save_with_other_tokenizer(workdir / "draft", 300, TEXT, tokenizer_size=290)
    elif how == "same_size_other_text":  # as many tokens, but they mean other things
        other = save_with_other_tokenizer(workdir / "draft", VOCAB, OTHER_TEXT, tokenizer_size=size)
    else:  # no tokenizers to compare: the embedding sizes differ
        other = save_with_other_tokenizer(workdir / "draft", 300, OTHER_TEXT, tokenizer_size=size)
    skip = how == "other_size_no_tokenizers"
    message = load_error(good, speculative_model=str(other), num_speculative_tokens=3, skip_tokenizer_init=skip)
    assert "vocab" in message and str(other) in message


# ----------------------------------------------------------------------------- requests




@pytest.fixture(scope="module")
def llms(good, draft):
    """A target-only LLM, a draft-model LLM and a prompt-lookup LLM, with the greedy outputs
    each gave for a few prompts before any bad request."""
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [random_ids(40, 14), random_ids(41, 5), "def add(a, b):"]
    made = {
        "target": LLM(model=str(good)),
        "draft_model": LLM(model=str(good), speculative_model=str(draft), num_speculative_tokens=4),
        "ngram": LLM(model=str(good), speculative_model="[ngram]", num_speculative_tokens=3),
    }
    reference = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params)] for name, llm in made.items()}
    assert reference["draft_model"] == reference["ngram"] == reference["target"]  # greedy speculation is exact
    return made, prompts, params, reference["target"]


def assert_still_works(llms, name: str) -> None:
    made, prompts, params, reference = llms
    outs = made[name].generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.outputs[0].token_ids for o in made[name].generate(prompts[:1], params)] == reference[:1]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("min_p", 2),
    ("min_p", -0.1),
    ("top_k", 2**63),
    ("seed", 2**64),
    ("seed", -2**63 - 1),
    ("seed", 1.5),
    ("stop_token_ids", "7"),
    ("stop_token_ids", [3, -1]),
])
def test_invalid_sampling_values(llms, field, value):
    made, prompts, _, _ = llms
    with pytest.raises(ValueError, match=field):
        made["target"].generate(prompts[0], SamplingParams(**{field: value}))
    assert_still_works(llms, "target")


@pytest.mark.parametrize("name", ["target", "draft_model"])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(llms, name):
    """1e-300 rounds to 0 in float32: the most likely token is still kept, so sampling at
    that top_p is greedy."""
    made, prompts, params, reference = llms
    tiny = SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=params.max_tokens, seed=3)
    assert [o.outputs[0].token_ids for o in made[name].generate(prompts, tiny)] == reference


def test_valid_edge_sampling_values_are_accepted():
    """The boundaries the checks above must not reject."""
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=0, max_tokens=1, seed=-2**63)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=2**63 - 1, min_p=1, max_tokens=10_000, seed=2**64 - 1)
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)  # one id, as one stop string is allowed


@pytest.mark.parametrize("name", ["target", "draft_model"])
@pytest.mark.parametrize("temperature", [1e-38, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(llms, name, temperature):
    """logits / 1e-38 overflows float32; below 1e-5 (vLLM's threshold) sampling is greedy."""
    made, prompts, params, reference = llms
    tiny = SamplingParams(temperature=temperature, max_tokens=params.max_tokens)
    assert [o.outputs[0].token_ids for o in made[name].generate(prompts, tiny)] == reference


@pytest.mark.parametrize("name", ["target", "draft_model"])
@pytest.mark.parametrize("bad", ["", [""], ["def f():", ""], [[]], {"prompt_token_ids": []}, [],
                                 [random_ids(50, 6), []]])
def test_empty_prompt(llms, name, bad):
    made, _, params, _ = llms
    with pytest.raises(ValueError, match="prompt"):
        made[name].generate(bad, params)
    assert_still_works(llms, name)


@pytest.mark.parametrize("name", ["target", "draft_model", "ngram"])
def test_prompt_plus_max_tokens_exceeds_context(llms, name):
    made, _, _, _ = llms
    prompt = random_ids(60, MAX_POSITIONS - 6)
    with pytest.raises(ValueError, match=str(MAX_POSITIONS)) as info:
        made[name].generate(prompt, SamplingParams(temperature=0, max_tokens=7))
    assert "max_tokens" in str(info.value)
    with pytest.raises(ValueError, match=str(MAX_POSITIONS)):
        made[name].generate([random_ids(61, 4), random_ids(62, MAX_POSITIONS + 1)], SamplingParams(max_tokens=1))
    assert_still_works(llms, name)
    # exactly at the context length is allowed
    out = made[name].generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 6


@pytest.mark.parametrize("name", ["target", "draft_model"])
@pytest.mark.parametrize("bad", [[5, VOCAB], [-1, 5], [5, 2.5], [5, "7"], [[3, 4], [VOCAB + 100]]])
def test_token_ids_out_of_vocabulary(llms, name, bad):
    made, _, params, _ = llms
    with pytest.raises(ValueError, match=str(VOCAB)):
        made[name].generate(bad, params)
    assert_still_works(llms, name)


def test_a_prompt_that_is_not_utf8_is_a_clear_error(llms):
    made, _, params, _ = llms
    with pytest.raises(ValueError, match="not valid UTF-8"):
        made["target"].generate("caf\udce9", params)  # how b"caf\xe9" arrives in sys.argv
    assert_still_works(llms, "target")


def test_every_prompt_form_gives_the_same_tokens(llms):
    """Token ids as a list or a tuple, alone, in a list or in a dict; text alone, in a list or
    tuple, or in a dict."""
    made, prompts, params, reference = llms
    ids, text = prompts[0], prompts[2]
    for form in (ids, tuple(ids), [ids], [tuple(ids)], {"prompt_token_ids": ids}, [{"prompt_token_ids": tuple(ids)}]):
        assert [o.outputs[0].token_ids for o in made["target"].generate(form, params)] == reference[:1], form
    for form in (text, [text], (text,), {"prompt": text}):
        assert [o.outputs[0].token_ids for o in made["target"].generate(form, params)] == reference[2:], form


def test_sampling_params_list_of_wrong_length(llms):
    made, prompts, params, _ = llms
    with pytest.raises(ValueError, match="SamplingParams"):
        made["target"].generate(prompts, [params, params])
    assert_still_works(llms, "target")


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_negative_num_speculative_tokens(good, draft, method):
    model = str(draft) if method == "draft_model" else "[ngram]"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(good), speculative_model=model, num_speculative_tokens=-1)
    LLM(model=str(good), speculative_model=model, num_speculative_tokens=0)  # k = 0 is plain decoding


def test_unknown_speculative_method(good):
    with pytest.raises(ValueError, match="medusa") as info:
        LLM(model=str(good), speculative_method="medusa")
    assert "draft_model" in str(info.value) and "ngram" in str(info.value)


def test_draft_model_method_needs_a_model(good):
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(model=str(good), speculative_method="draft_model")


def test_a_draft_model_with_a_method_that_uses_none_is_refused(good, draft):
    with pytest.raises(ValueError, match="uses no draft model"):
        LLM(model=str(good), speculative_model=str(draft), speculative_method="ngram")
    with pytest.raises(ValueError, match=r"\[ngram\]"):
        LLM(model=str(good), speculative_model="[ngram]", speculative_method="lookup_then_draft")
    LLM(model=str(good), speculative_model="[ngram]", speculative_method="ngram")  # the same thing twice is fine


def test_missing_draft_directory_names_it(good, workdir):
    missing = workdir / "no_draft_here"
    message = load_error(good, speculative_model=str(missing))
    assert str(missing) in message


@pytest.mark.parametrize("name", ["target", "draft_model", "ngram"])
def test_many_bad_requests_then_good_ones(llms, name):
    """Bad requests in a row, some mixed into batches with good prompts: the LLM's output
    afterwards equals what it gave before any of them."""
    made, prompts, params, _ = llms
    llm = made[name]
    for bad_batch in ([prompts[0], [VOCAB]], [prompts[1], ""], [prompts[0], random_ids(70, MAX_POSITIONS)]):
        with pytest.raises(ValueError):
            llm.generate(bad_batch, params)
    assert_still_works(llms, name)
