"""Bad input gets a clear error that names the problem, and leaves nothing half-done.

Model directories are broken one way at a time (copies of a good tiny checkpoint saved with
transformers), each a row of one table, BROKEN: how the copy is broken and what the error must
say; requests are broken one field at a time, and after each error the same LLM must still
generate exactly what it generated before.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------- the table of broken models


@dataclass(frozen=True)
class AnyOf:
    """One of these groups of fragments must all be in the message."""

    groups: tuple[tuple[str, ...], ...]


LOADS = None  # a case's says for a control: the copy loads, and generates


@dataclass(frozen=True)
class Broken:
    """One way to break a model directory, and what the ModelLoadError must say.

    breaks(path, good) breaks what is at path (a copy of the `copy` fixture's directory, or
    nothing) in place; it may return names for the fragments ("{shard}"), besides "{path}".
    says: fragments the message holds (str, with the names put in, or AnyOf); LOADS: it loads
    and generates. as_draft: load the good target with path as its draft model, these options
    added, instead of path as the model."""

    id: str
    breaks: Callable[[Path, Path], dict | None]
    says: tuple | None
    copy: str | None = "good"  # "good", "sharded", or None: path starts absent
    name: str = "model"  # path's name in a fresh directory
    as_draft: dict | None = None


def nothing(path: Path, good: Path) -> None:
    pass


def config(**changes) -> Callable:
    return lambda path, good: edit_config(path, **changes)


def remove(name: str) -> Callable:
    return lambda path, good: (path / name).unlink()


def write(name: str, text: str) -> Callable:
    def breaks(path: Path, good: Path) -> None:
        (path / name).write_text(text)

    return breaks


def random_bytes(seed: int, size: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (size,), generator=g).tolist())


def rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def weights(edit) -> Callable:
    return lambda path, good: rewrite_weights(path, edit)


def write_file_at_path(path: Path, good: Path) -> None:
    path.write_bytes(b"not a directory")


def pickle_checkpoint(path: Path, good: Path) -> None:
    from safetensors.torch import load_file

    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def corrupt_safetensors(path: Path, good: Path) -> None:
    (path / "model.safetensors").write_bytes(random_bytes(3, 4096))


def corrupt_safetensors_header(path: Path, good: Path) -> None:
    """A plausible header length followed by bytes that are not a JSON header."""
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 200) + random_bytes(4, 500))


def truncate_safetensors(path: Path, good: Path) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def shards(path: Path) -> list[str]:
    return sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))


def truncate_last_shard(path: Path, good: Path) -> dict:
    shard = shards(path)[-1]
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[: len(data) - 100])
    return {"shard": shard}


def remove_a_shard(path: Path, good: Path) -> dict:
    listed = shards(path)
    assert len(listed) >= 3
    (path / listed[1]).unlink()
    return {"shard": listed[1]}


def index_naming_no_file(path: Path, good: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = None
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


WRONG_SHAPES = {
    # name: {checkpoint tensor (under model.layers.): wrong shape}; one of them must be reported,
    # by its name in the checkpoint, with the shape it has
    "up_proj_rows": {"1.mlp.up_proj.weight": (100, 64)},
    "k_proj_columns": {"0.self_attn.k_proj.weight": (32, 60)},
    "k_proj_rows": {"0.self_attn.k_proj.weight": (16, 64)},
    # wrong pieces whose sizes happen to add up to the right total
    "gate_and_up_sum_right": {"0.mlp.gate_proj.weight": (120, 64), "0.mlp.up_proj.weight": (136, 64)},
    "q_and_v_sum_right": {"0.self_attn.q_proj.weight": (48, 64), "0.self_attn.v_proj.weight": (48, 64)},
    "norm_weight": {"1.post_attention_layernorm.weight": (65,)},
}


def wrong_shapes(shapes: dict) -> Callable:
    def edit(tensors):
        g = torch.Generator().manual_seed(5)
        for name, shape in shapes.items():
            assert f"model.layers.{name}" in tensors
            tensors[f"model.layers.{name}"] = torch.randn(shape, generator=g)

    return weights(edit)


def add_tensor(tensors) -> None:
    tensors["model.layers.0.self_attn.extra.weight"] = torch.randn(4, 4)


def larger_tokenizer(path: Path, good: Path) -> None:
    chars = "".join(chr(c) for c in range(0x400, 0x500))
    make_tokenizer(VOCAB + 40, TEXT * 3 + chars).save(str(path / "tokenizer.json"))


def eos_ids(file: str, value) -> Callable:
    def breaks(path: Path, good: Path) -> None:
        data = json.loads((path / file).read_text()) if (path / file).is_file() else {}
        (path / file).write_text(json.dumps({**data, "eos_token_id": value}))

    return breaks


def save_with_other_tokenizer(path: Path, vocab_size: int, text: str, tokenizer_size: int, seed: int = 9) -> Path:
    """A tiny model whose BPE (tokenizer_size tokens) is trained on `text`."""
    save_tiny_model(path, "llama", seed=seed, vocab_size=vocab_size, init_std=0.2, tokenizer=True)
    tok = make_tokenizer(tokenizer_size, text)
    assert tok.get_vocab_size() == tokenizer_size
    tok.save(str(path / "tokenizer.json"))
    return path


OTHER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
) * 8


def other_tokenizer(vocab_size: int | None, text: str, tokenizer_size: int | None) -> Callable:
    """A draft at path whose tokenizer is not the target's; None: as many as the target's tokens."""

    def breaks(path: Path, good: Path) -> None:
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(good / "tokenizer.json")).get_vocab_size()
        save_with_other_tokenizer(path, vocab_size or size, text, tokenizer_size=tokenizer_size or size)

    return breaks


CONFIG_CHECKED_AT_LOAD = [  # (id, changes, what the message names; LOADS: it loads): these loaded before as if
    # fine, then failed at the first forward
    ("rms_norm_eps_null", {"rms_norm_eps": None}, LOADS),  # null means the default, as in transformers
    ("rms_norm_eps_negative", {"rms_norm_eps": -1.0}, ("rms_norm_eps",)),
    ("no_attention_heads", {"num_attention_heads": 0}, ("num_attention_heads",)),
    ("vocab_size_negative", {"vocab_size": -5}, ("vocab_size",)),
    ("kv_heads_negative", {"num_key_value_heads": -2}, ("num_key_value_heads",)),
    ("hidden_size_a_string", {"hidden_size": "64"}, ("hidden_size",)),
    ("rope_theta_null", {"rope_theta": None, "rope_parameters": ...}, LOADS),  # the default theta
    ("rope_theta_negative", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, ("rope_theta",)),
    (
        "layer_types_too_short",
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": 4,
            "layer_types": ["sliding_attention"],
        },
        ("layer_types", "2"),
    ),
    ("dtype_float64", {"dtype": "float64", "torch_dtype": ...}, ("float64", "config.json")),
    # these were TypeErrors from deep in the loader (found probing)
    ("dtype_a_list", {"dtype": ["float32"], "torch_dtype": ...}, ("['float32']", "config.json")),
    ("architectures_a_number", {"architectures": 5}, ("'architectures' must be a list", "5")),
    ("rope_scaling_a_list", {"rope_scaling": [8.0]}, ("rope_scaling must be an object", "[8.0]")),
    ("rope_parameters_a_string", {"rope_parameters": "linear"}, ("rope_parameters must be an object", "'linear'")),
    (
        "max_window_layers_null",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "sliding_window": 4,
            "use_sliding_window": True,
            "max_window_layers": None,
        },
        ("max_window_layers", "None"),
    ),
]

UNSUPPORTED_FEATURES = [  # (id, changes, what the message names)
    ("hidden_act_gelu", {"hidden_act": "gelu"}, ("hidden_act", "gelu")),
    # transformers v5 style (rope_parameters) and v4 style (rope_theta + rope_scaling)
    ("rope_yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ("yarn",)),
    (
        "rope_dynamic_v4_style",
        {"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        ("dynamic",),
    ),
    (
        "rope_llama3_incomplete",
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
        ("llama3", "low_freq_factor"),
    ),
    (
        "rope_linear_without_factor",
        {"rope_parameters": ..., "rope_scaling": {"rope_type": "linear"}},
        ("linear", "factor"),
    ),
]

REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
MISSING_TENSORS = ("0.self_attn.k_proj.weight", "1.mlp.up_proj.weight", "0.input_layernorm.weight")
EOS_IDS = [
    ("eos_true", "generation_config.json", True),
    ("eos_a_string", "generation_config.json", "</s>"),
    ("eos_past_the_vocabulary", "generation_config.json", [1, VOCAB]),
    ("eos_negative", "config.json", -1),
    ("eos_true_beside_1", "generation_config.json", [1, True]),
]  # True == 1: not skipped as seen

BROKEN = [
    # directory and config
    Broken("unmodified_copy", nothing, LOADS),  # the control: a plain copy of what the others break
    Broken("missing_directory", nothing, ("{path}", "does not exist"), copy=None, name="no_such_model"),
    Broken("path_is_a_file", write_file_at_path, ("{path}",), copy=None, name="model.safetensors"),
    Broken("missing_config_json", remove("config.json"), ("config.json", "missing")),
    Broken("config_not_json", write("config.json", '{"hidden_size": 64, "vocab_size": '), ("config.json", "JSON")),
    Broken("config_not_an_object", write("config.json", "[1, 2, 3]"), ("config.json",)),
    *[Broken(f"config_without_{field}", config(**{field: ...}), (field, "config.json")) for field in REQUIRED_FIELDS],
    Broken("config_field_null", config(hidden_size=None), ("hidden_size",)),
    Broken(
        "unsupported_architecture_lists_supported",
        config(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
        ("GPT2LMHeadModel", *SUPPORTED),
    ),
    Broken(
        "unsupported_model_type_without_architectures",
        config(architectures=..., model_type="gpt_neox"),
        ("gpt_neox", *SUPPORTED),
    ),
    Broken("model_type_alone_is_enough", config(architectures=..., model_type="llama"), LOADS),  # the control
    *[Broken(f"unsupported_{id_}", config(**changes), names) for id_, changes, names in UNSUPPORTED_FEATURES],
    Broken("heads_not_a_multiple_of_kv_heads", config(num_key_value_heads=3), ("num_key_value_heads", "config.json")),
    *[
        Broken(f"config_{id_}", config(**changes), names if names is LOADS else (*names, "config.json"))
        for id_, changes, names in CONFIG_CHECKED_AT_LOAD
    ],
    # weights
    Broken("no_weights", remove("model.safetensors"), ("model.safetensors", "{path}")),
    Broken("pickle_checkpoint_is_not_loaded", pickle_checkpoint, ("pytorch_model.bin", "pickle", "safetensors")),
    Broken("corrupt_safetensors", corrupt_safetensors, ("model.safetensors", "corrupt")),
    Broken("corrupt_safetensors_header", corrupt_safetensors_header, ("model.safetensors",)),
    Broken("truncated_safetensors", truncate_safetensors, ("model.safetensors", "truncated")),
    Broken("truncated_shard", truncate_last_shard, ("{shard}",), copy="sharded"),
    Broken("shard_listed_in_index_is_missing", remove_a_shard, ("{shard}", "missing"), copy="sharded"),
    Broken(
        "index_without_weight_map",
        write("model.safetensors.index.json", json.dumps({"metadata": {}})),
        ("model.safetensors.index.json", "weight_map"),
        copy="sharded",
    ),
    Broken("index_naming_no_file", index_naming_no_file, ("weight_map",), copy="sharded"),
    Broken(
        "index_not_json", write("model.safetensors.index.json", "{"), ("model.safetensors.index.json",), copy="sharded"
    ),
    *[
        Broken(
            f"wrong_shape_{id_}",
            wrong_shapes(shapes),
            (AnyOf(tuple((f"layers.{name}", str(tuple(shape))) for name, shape in shapes.items())),),
        )
        for id_, shapes in WRONG_SHAPES.items()
    ],
    # config.json's layer count against the checkpoint's tensors, checked before a model is built
    Broken(
        "config_claims_a_thousand_layers",
        config(num_hidden_layers=1000),
        ("num_hidden_layers is 1000", "2 layers (0 to 1)", "config.json"),
    ),
    Broken("config_claims_fewer_layers", config(num_hidden_layers=1), ("num_hidden_layers is 1", "2 layers (0 to 1)")),
    Broken(
        "checkpoint_missing_a_whole_layer",
        weights(lambda tensors: [tensors.pop(name) for name in list(tensors) if name.startswith("model.layers.0.")]),
        ("num_hidden_layers is 2", "layers 1"),
    ),
    # the same problem from the other side: config.json says intermediate_size 96
    Broken(
        "config_disagrees_with_weights", config(intermediate_size=96), ("mlp", AnyOf((("(128, 64)",), ("(64, 128)",))))
    ),
    *[
        Broken(
            f"missing_tensor_{name}",
            weights(lambda tensors, name=name: tensors.pop(f"model.layers.{name}")),
            (f"layers.{name}", "missing"),
        )
        for name in MISSING_TENSORS
    ],
    Broken("unexpected_tensor", weights(add_tensor), ("layers.0.self_attn.extra.weight",)),
    # tokenizer and generation config
    Broken("missing_tokenizer_json", remove("tokenizer.json"), ("tokenizer.json", "skip_tokenizer_init")),
    Broken("corrupt_tokenizer_json", write("tokenizer.json", '{"version": "1.0", "model": '), ("tokenizer",)),
    Broken("corrupt_tokenizer_config", write("tokenizer_config.json", "{bos_token: <s>}"), ("tokenizer_config.json",)),
    Broken("corrupt_generation_config", write("generation_config.json", "{"), ("generation_config.json", "JSON")),
    # a tokenizer whose ids run past vocab_size is not the model's: said at load, not as an
    # out-of-range prompt when the user gave text
    Broken(
        "tokenizer_larger_than_the_vocabulary",
        larger_tokenizer,
        (f"tokenizer.json has token ids up to {VOCAB + 39}, beyond config.json's vocab_size {VOCAB}",),
    ),
    *[
        Broken(id_, eos_ids(file, value), (file, f"eos_token_id must be token ids in [0, {VOCAB})"))
        for id_, file, value in EOS_IDS
    ],
    # a draft model (at path) whose vocabulary is not the target's: with both tokenizers it loads
    # and drafts through text (drafters/cross_tokenizer.py); without them it cannot
    Broken(
        "draft_smaller_vocab",
        other_tokenizer(300, TEXT, 290),
        LOADS,
        copy=None,
        name="draft",
        as_draft={"num_speculative_tokens": 3},
    ),  # the same text, fewer merges: a prefix of the target's
    Broken(
        "draft_same_size_other_text",
        other_tokenizer(VOCAB, OTHER_TEXT, None),
        LOADS,
        copy=None,
        name="draft",
        as_draft={"num_speculative_tokens": 3},
    ),  # as many tokens, but they mean other things
    Broken(
        "draft_other_size_no_tokenizers",
        other_tokenizer(300, OTHER_TEXT, None),
        ("vocab", "{path}"),
        copy=None,
        name="draft",
        as_draft={"num_speculative_tokens": 3, "skip_tokenizer_init": True},
    ),  # the embeddings
    Broken("missing_draft_directory", nothing, ("{path}",), copy=None, name="no_draft_here", as_draft={}),
]


def says(message: str, fragment, names: dict[str, str]) -> bool:
    if isinstance(fragment, AnyOf):
        return any(all(says(message, part, names) for part in group) for group in fragment.groups)
    for name, value in names.items():
        fragment = fragment.replace("{" + name + "}", value)
    return fragment in message


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in BROKEN])
def test_a_broken_model_is_a_clear_error(case, good, workdir, request):
    path = workdir / case.name
    if case.copy is not None:
        shutil.copytree(request.getfixturevalue(case.copy), path)
    names = {"path": str(path), **(case.breaks(path, good) or {})}
    model, options = (
        (good, {"speculative_model": str(path), **case.as_draft}) if case.as_draft is not None else (path, {})
    )
    if case.says is LOADS:
        out = LLM(model=str(model), **options).generate(random_ids(3, 5), SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        return
    message = load_error(model, **options)
    assert all(says(message, fragment, names) for fragment in case.says), message


def test_a_config_claiming_a_million_layers_fails_at_once(good, workdir):
    """Refused by its bound before anything is built (it used to build for minutes; a billion
    layers exhausted the memory listing them)."""
    path = workdir / "model"
    shutil.copytree(good, path)
    for layers in (10**6, 10**9):
        edit_config(path, num_hidden_layers=layers)
        start = time.perf_counter()
        message = load_error(path)
        assert time.perf_counter() - start < 2.0
        assert f"num_hidden_layers is {layers}, more than 1024" in message


# each size of config.json past its bound: refused by name, value and bound before anything is
# allocated (the field, a value past the bound, the bound)
SIZES_PAST_THEIR_BOUNDS = [
    ("num_hidden_layers", 10**9, 1024),
    ("num_attention_heads", 2**20, 1024),
    ("num_key_value_heads", 2048, 1024),
    ("head_dim", 2**20, 2**13),
    ("hidden_size", 2**30, 2**17),
    ("intermediate_size", 2**40, 2**20),
    ("vocab_size", 2**31, 2**24),
    ("output_vocab_size", 2**25, 2**24),
    ("max_position_embeddings", 10**12, 2**24),
]


@pytest.mark.parametrize("field, value, bound", SIZES_PAST_THEIR_BOUNDS)
def test_a_size_past_its_bound_is_refused_by_name(good, workdir, field, value, bound):
    path = workdir / "model"
    shutil.copytree(good, path)
    edit_config(path, **{field: value})
    message = load_error(path)
    assert f"config.json: {field} is {value}, more than {bound}" in message


def test_a_sliding_window_past_its_bound_is_refused(good, workdir):
    path = workdir / "model"
    shutil.copytree(good, path)
    edit_config(path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=2**40)
    assert f"sliding_window is {2**40}, more than {2**24}" in load_error(path)


def test_sizes_at_their_bounds_pass_the_bound_check():
    """The bounds refuse only what is past them: a config at every bound is not refused by one."""
    from specdec.models.errors import CONFIG_BOUNDS
    from specdec.models.loader import model_config_from_hf

    at_bounds = {"architectures": ["LlamaForCausalLM"], **CONFIG_BOUNDS}
    at_bounds.pop("sliding_window")
    at_bounds.update(num_attention_heads=16, num_key_value_heads=16, head_dim=2**13, hidden_size=2**17)
    config = model_config_from_hf(at_bounds, Path("config.json"))
    assert (config.num_layers, config.vocab_size, config.max_position_embeddings) == (1024, 2**24, 2**24)


def test_the_table_names_each_case_once():
    assert len({case.id for case in BROKEN}) == len(BROKEN)


# ----------------------------------------------------------------------------- what is not a broken copy


@pytest.mark.parametrize(
    "device, message",
    [("gpu", "device must be"), ("cuda:x", "device must be"), ("cuda", "CUDA is not available|CUDA devices")],
)
def test_bad_device_is_a_clear_error(good, device, message):
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"  # one past the last
    with pytest.raises(ValueError, match=message):
        LLM(model=str(good), device=device, speculative_method="none")


def test_unknown_dtype(good):
    with pytest.raises(ValueError, match="int8") as info:
        LLM(model=str(good), dtype="int8", speculative_method="none")
    assert "bfloat16" in str(info.value)  # says what is supported


def test_without_tokenizer_json_skip_tokenizer_init_generates_the_same_tokens(good, workdir):
    """A model without tokenizer.json is refused (the table's missing_tokenizer_json) unless
    skip_tokenizer_init: then token ids in, the same token ids out, and text is refused."""
    path = workdir / "model"
    shutil.copytree(good, path)
    (path / "tokenizer.json").unlink()
    llm = LLM(model=str(path), skip_tokenizer_init=True, speculative_method="none")
    reference = LLM(model=str(good), speculative_method="none")
    prompt, params = random_ids(20, 9), SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == reference.generate(prompt, params)[0].outputs[0].token_ids
    assert out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("def add(a, b):", params)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == out.token_ids


def test_draft_with_the_same_tokenizer_loads(good, draft):
    """The control: a draft sharing the target's tokenizer is accepted and changes nothing."""
    params = SamplingParams(temperature=0, max_tokens=10)
    prompt = random_ids(30, 12)
    target_only = LLM(model=str(good), speculative_method="none").generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(model=str(good), speculative_model=str(draft), num_speculative_tokens=3)
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == target_only


# ----------------------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def llms(good, draft):
    """A target-only LLM, a draft-model LLM and a prompt-lookup LLM, with the greedy outputs
    each gave for a few prompts before any bad request."""
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [random_ids(40, 14), random_ids(41, 5), "def add(a, b):"]
    made = {
        "target": LLM(model=str(good), speculative_method="none"),
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


@pytest.mark.parametrize(
    "field, value",
    [
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
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("stop_token_ids", "7"),
        ("stop_token_ids", [3, -1]),
    ],
)
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
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=0, max_tokens=1, seed=-(2**63))
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
@pytest.mark.parametrize(
    "bad", ["", [""], ["def f():", ""], [[]], {"prompt_token_ids": []}, [], [random_ids(50, 6), []]]
)
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


# the same bounds on a GGUF file's metadata, checked before any tensor is read: (the transformers
# config attribute written as the key, the key, config.json's name, the value written)
GGUF_SIZES = [
    ("num_hidden_layers", "llama.block_count", "num_hidden_layers", 10**9),
    ("intermediate_size", "llama.feed_forward_length", "intermediate_size", 2**21),
    ("max_position_embeddings", "llama.context_length", "max_position_embeddings", 2**30),
    ("hidden_size", "llama.embedding_length", "hidden_size", 2**18),
    ("head_dim", "llama.attention.key_length", "head_dim", 0),
]


@pytest.mark.parametrize("attribute, key, field, value", GGUF_SIZES)
def test_a_gguf_size_past_its_bound_is_refused_by_its_key(workdir, attribute, key, field, value, monkeypatch):
    from gguf_files import tiny_hf_model, write_gguf
    from specdec.models import gguf

    def no_tensor_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the metadata's sizes were checked")

    model = tiny_hf_model(seed=3)
    setattr(model.config, attribute, value)  # what write_gguf writes as the key; the tensors stay 2 layers'
    path = write_gguf(workdir / "model.gguf", model, tokenizer=make_tokenizer(300))
    monkeypatch.setattr(gguf, "_hf_tensors", no_tensor_read)
    message = load_error(path)
    assert f"metadata {key} ({field})" in message and str(path) in message
    bound = {"num_hidden_layers": 1024, "intermediate_size": 2**20, "max_position_embeddings": 2**24}
    bound = {**bound, "hidden_size": 2**17}.get(field)
    assert (f"is {value}, more than {bound}" if bound else f"must be a positive integer, got {value}") in message
