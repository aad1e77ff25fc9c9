"""GGUF's quantized tensors held quantized (models/gguf_quants.py, kernels/qmatmul.cpp,
models/gguf_linear.py, models/gguf_model.py), against the `gguf` package's own
dequantization (llama.cpp's reference in Python) and plain float products.

- Every type's split into codes and scales holds exactly the values gguf dequantizes to.
- The kernel computes x W^T with x quantized to int8 per block of 32 (as llama.cpp does): it
  must equal the float64 product of those quantized activations and W (up to float32
  summation), and each row must be the same whether run alone or in a batch (so speculation,
  which verifies several rows at once, stays exact with respect to the model as it runs).
- The AVX2 kernel (what an AVX2-only CPU runs) against the AVX-512 one, in a process held to
  AVX2: tests/models/test_kernel_kinds.py.
- A whole model loaded quantized matches the dequantized model closely, holds no float copy of
  a quantized matrix, and decodes speculatively exactly as it decodes alone.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from gguf_files import encode, tiny_hf_model, write_gguf
from specdec import LLM, SamplingParams
from specdec.kernels import qmatmul
from specdec.models.gguf_linear import GGUFEmbedding, GGUFLinear, dequantize
from specdec.models.gguf_quants import LAYOUTS, dequantize_split, pack, split_blocks
from specdec.models.loader import load_pretrained

TYPES = sorted(LAYOUTS)


def quantized_matrix(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A [rows, cols] matrix stored as kind: [rows, row bytes] uint8 (gguf_files.encode)."""
    rng = np.random.default_rng(seed)
    return encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind, rng)


def reference(kind: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).copy())


@pytest.mark.parametrize("kind", TYPES)
def test_split_holds_exactly_the_values_gguf_dequantizes_to(kind):
    data = quantized_matrix(kind, 8, 512, seed=1)
    layout = LAYOUTS[kind]
    parts = split_blocks(kind, data.reshape(-1, layout.block_bytes))
    values = dequantize_split(kind, parts).reshape(8, 512)
    assert np.array_equal(values, reference(kind, data).numpy())


@pytest.mark.parametrize("kind", TYPES)
def test_packed_rows_dequantize_to_the_files_values(kind):
    rows = 40  # not a multiple of the 16-row group: the padding is cut off
    data = quantized_matrix(kind, rows, 256, seed=2)
    packed = pack(kind, data, rows, 256)
    ids = torch.tensor([0, 17, 39, 5, 5])
    assert torch.equal(dequantize(packed, ids), reference(kind, data)[ids])


def kernel_product(packed, x: torch.Tensor) -> torch.Tensor:
    return GGUFLinear([packed])(x)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 codes times a scale per block (256 inputs where K allows,
    else 32), in float64."""
    xq, dx, _ = qmatmul().quantize_activations(x.float().contiguous())
    M, K = x.shape
    block = 256 if K % 256 == 0 else 32
    assert dx.shape == (M, K // block)
    return (xq.double().view(M, K // block, block) * dx.double()[..., None]).view(M, K)


@pytest.mark.parametrize("kind", TYPES)
def test_kernel_equals_the_product_of_quantized_activations(kind):
    rows, cols = 48, 512
    data = quantized_matrix(kind, rows, cols, seed=3)
    packed = pack(kind, data, rows, cols)
    weight = reference(kind, data).double()
    generator = torch.Generator().manual_seed(4)
    for M in (1, 3, 8, 13):  # a decode step, verify widths, and past the kernel's row tile
        x = torch.randn(M, cols, generator=generator)
        got = kernel_product(packed, x).double()
        expected = quantized_activations(x) @ weight.T
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (kind, M)
        exact = x.double() @ weight.T  # int8 activations: about 1% of the output's scale
        assert (got - exact).abs().max() <= 0.03 * exact.abs().max(), (kind, M)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_row_gets_the_same_result_alone_and_in_a_batch(kind):
    data = quantized_matrix(kind, 64, 512, seed=5)
    packed = pack(kind, data, 64, 512)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(6))
    batch = kernel_product(packed, x)
    for row in range(11):
        assert torch.equal(kernel_product(packed, x[row : row + 1])[0], batch[row])


@pytest.mark.parametrize("kind", TYPES)
def test_a_layer_of_some_rows_gives_those_columns_bit_for_bit(kind):
    """GGUFLinear.rows (an EAGLE head's output layer over part of its target's vocabulary): the
    same bytes regrouped, so its outputs are exactly those columns of the whole layer's."""
    data = quantized_matrix(kind, 70, 512, seed=8)
    layer = GGUFLinear([pack(kind, data, 70, 512)], bias=torch.randn(70))
    ids = torch.tensor([69, 0, 17, 33, 34, 5, 16, 15, 48, 49, 50, 51, 52, 53, 54, 55, 56, 2, 64])  # 19: a padded group
    part = layer.rows(ids)
    assert part.out_features == len(ids) and torch.equal(part.dequantized_weight(), reference(kind, data)[ids])
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(9))
    for rows in (x[:1], x):
        assert torch.equal(part(rows), layer(rows)[:, ids])


def test_fused_parts_of_different_types_stack_by_rows():
    parts = [("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 24)]
    datas = [quantized_matrix(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(parts)]
    layer = GGUFLinear([pack(kind, data, rows, 256) for (kind, rows), data in zip(parts, datas)], bias=torch.randn(72))
    weight = torch.cat([reference(kind, data) for (kind, _), data in zip(parts, datas)])
    assert torch.equal(layer.dequantized_weight(), weight)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(7))
    expected = (quantized_activations(x.view(6, 256)) @ weight.double().T).float().view(2, 3, 72) + layer.bias
    assert torch.allclose(layer(x), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_fused_norm_and_gate_compute_what_the_ops_they_replace_do(kind):
    """fuse_input: the layer applies RMSNorm (weight, eps) and an MLP's gate, silu(gate) * up,
    to its input while quantizing it; against those ops in float64, then the product."""
    g = torch.Generator().manual_seed(12)
    data = quantized_matrix(kind, 48, 512, seed=13)
    weight = reference(kind, data).double()
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.nn.Parameter(torch.rand(512, generator=g) + 0.5), 1e-5
    normed_layer = GGUFLinear([pack(kind, data, 48, 512)])
    normed_layer.fuse_input(norm=norm)
    x = torch.randn(5, 512, generator=g) * 3
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    gated_layer = GGUFLinear([pack(kind, data, 48, 512)])
    gated_layer.fuse_input(gated=True)
    gate_up = torch.randn(5, 1024, generator=g)
    gated = torch.nn.functional.silu(gate_up[:, :512].double()) * gate_up[:, 512:].double()
    for layer, inputs, activations in ((normed_layer, x, normed), (gated_layer, gate_up, gated)):
        got = layer(inputs).double()
        assert got.shape == (5, 48)
        expected = quantized_activations(activations.float()) @ weight.T  # an activation code may round the other way
        assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
        exact = activations @ weight.T
        assert (got - exact).abs().max() <= 0.03 * exact.abs().max()


# --- whole models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    """A tiny Qwen2 model (vocabulary 300: not a multiple of 16) in the types a Q4_K_M file mixes:
    Q4_K matrices, Q6_K for v and down projections and the output layer, F32 norms and biases."""
    types = {f"blk.{i}.{part}.weight": "Q6_K" for i in range(2) for part in ("attn_v", "ffn_down")}
    types["output.weight"] = "Q6_K"
    return write_gguf(
        tmp_path_factory.mktemp("mixed") / "model.gguf", tiny_hf_model("qwen2", tie=False), "Q4_K", tensor_types=types
    )


def test_a_quantized_file_loads_with_no_float_matrix(mixed_file):
    model = load_pretrained(mixed_file, dtype="float32", load_tokenizer=False, keep_quantized=True).model
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 2 * 4 + 1
    assert [p.kind for p in model.layers[0].self_attn.qkv_proj.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert all(t.dtype == torch.float32 for t in model.parameters())  # norms, in the model's dtype
    floats = sum(t.numel() for t in model.parameters()) + model.layers[0].self_attn.qkv_proj.bias.numel() * 2
    assert floats < 0.01 * sum(p.rows * p.cols for m in linears for p in m.parts)


def test_the_quantized_model_matches_the_dequantized_one(mixed_file):
    quantized = load_pretrained(mixed_file, dtype="float32", load_tokenizer=False, keep_quantized=True).model
    dense = load_pretrained(mixed_file, dtype="float32", load_tokenizer=False).model
    for q_layer, d_layer in (
        (quantized.layers[1].mlp.down_proj, dense.layers[1].mlp.down_proj),
        (quantized.lm_head, dense.lm_head),
    ):
        assert torch.equal(q_layer.dequantized_weight(), d_layer.weight)
    ids = torch.randint(2, 300, (1, 24), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        got, expected = quantized(ids, torch.arange(24)[None], None), dense(ids, torch.arange(24)[None], None)
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()  # int8 activations
    assert torch.equal(quantized.embed_tokens(ids), dense.embed_tokens(ids))


def test_speculation_is_exact_with_respect_to_the_quantized_model(mixed_file):
    alone = LLM(model=str(mixed_file), dtype="float32", speculative_method="none")
    assert isinstance(alone.target.model.lm_head, GGUFLinear)
    prompts = [
        {"prompt_token_ids": torch.randint(2, 300, (8,), generator=torch.Generator().manual_seed(s)).tolist() * 3}
        for s in (11, 12)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, params)]
    for options in (
        {"speculative_method": "ngram"},
        {"speculative_model": str(mixed_file)},
        {"speculative_method": "early_exit", "early_exit_layer": 1},
    ):
        spec = LLM(
            model=str(mixed_file), dtype="float32", num_speculative_tokens=4, speculative_k_policy="fixed", **options
        )
        outputs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected, options
        if "speculative_method" not in options or options["speculative_method"] == "ngram":  # drafts that agree
            assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0, options


def test_a_wide_gguf_draft_runs_requantized_into_q4_0_and_the_output_stays_the_targets(mixed_file, tmp_path):
    """draft_quantization "auto" for a GGUF target: a draft file of Q8_0 matrices (8.5 bits a
    weight) runs with its linear layers in Q4_0 (fewer bytes a step); one of Q4_K (4.5) as it is; None
    dequantizes. Greedy output is the target's alone every way, and each draft computes what the
    file's weights do, rounded (on this random model's flat logits the rounding flips most
    argmaxes, so few drafts are accepted: the real pair's are, docs/runner.md)."""
    model = tiny_hf_model("qwen2", tie=False)  # the target's weights: drafts that agree
    files = {kind: write_gguf(tmp_path / f"draft-{kind}.gguf", model, kind) for kind in ("Q8_0", "Q4_K")}
    prompts = [
        {"prompt_token_ids": torch.randint(2, 300, (8,), generator=torch.Generator().manual_seed(s)).tolist() * 3}
        for s in (13, 14)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(model=str(mixed_file), dtype="float32", speculative_method="none").generate(prompts, params)
    ]
    for file_kind, quantization, runs_as in (("Q8_0", "auto", "Q4_0"), ("Q4_K", "auto", "Q4_K"), ("Q8_0", None, None)):
        spec = LLM(
            model=str(mixed_file),
            dtype="float32",
            speculative_model=str(files[file_kind]),
            draft_quantization=quantization,
            num_speculative_tokens=4,
            speculative_k_policy="fixed",
        )
        draft = spec.engine.drafter.runner.model
        kinds = {part.kind for m in draft.modules() if isinstance(m, GGUFLinear) for part in m.parts}
        assert kinds == ({runs_as} if runs_as else set()), (file_kind, quantization, kinds)
        outputs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected, (file_kind, quantization)
        dense = load_pretrained(files[file_kind], dtype="float32", load_tokenizer=False).model
        ids = torch.tensor([prompts[0]["prompt_token_ids"]])  # [1, T]
        with torch.no_grad():
            got, want = (m(ids, torch.arange(ids.shape[1])[None], None) for m in (draft, dense))
        assert torch.corrcoef(torch.stack([got.flatten().float(), want.flatten()]))[0, 1] > 0.95, file_kind


@pytest.mark.parametrize("small", [True, False])
def test_a_float_draft_directory_runs_in_q4_0_unless_it_is_small(mixed_file, tmp_path, monkeypatch, small):
    """draft_quantization "auto" for a GGUF target: a draft from a model directory (float weights,
    16 or 32 bits a weight, as `smollm2`'s converted one) runs with its linear layers in Q4_0, but
    one of at most SMALL_DRAFT_PARAMETERS stays float (it runs in float32: the shipped code draft).
    Greedy output is the target's alone either way."""
    monkeypatch.setattr("specdec.drafters.draft_model.SMALL_DRAFT_PARAMETERS", 10**9 if small else 0)
    model = tiny_hf_model("qwen2", tie=False)  # the target's weights
    model.save_pretrained(tmp_path / "draft")
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (8,), generator=torch.Generator().manual_seed(15)).tolist()}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(model=str(mixed_file), dtype="float32", speculative_method="none").generate(prompts, params)
    ]
    spec = LLM(
        model=str(mixed_file),
        dtype="float32",
        speculative_model=str(tmp_path / "draft"),
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        skip_tokenizer_init=True,
    )
    draft = spec.engine.drafter.runner.model
    kinds = {part.kind for m in draft.modules() if isinstance(m, GGUFLinear) for part in m.parts}
    assert kinds == (set() if small else {"Q4_0"})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_forward_gives_bit_for_bit_what_decode_steps_give(mixed_file, dtype):
    """The target verifies k + 1 tokens in one forward where plain decoding takes k + 1 steps.
    Greedy speculation is exact with respect to the model as it runs only if a token's logits
    depend neither on how many tokens share its forward nor on the other rows of a ragged batch
    (whose longer row makes this row's forward read keys it must not see): the quantized
    kernel and the attention kernel compute each row alone."""
    model = load_pretrained(mixed_file, dtype=dtype, load_tokenizer=False, keep_quantized=True).model
    g = torch.Generator().manual_seed(21)
    a, b = torch.randint(2, 300, (30,), generator=g).tolist(), torch.randint(2, 300, (17,), generator=g).tolist()
    xa, xb = torch.randint(2, 300, (6,), generator=g).tolist(), torch.randint(2, 300, (6,), generator=g).tolist()
    cache = model.new_cache(2, 40)
    with torch.inference_mode():
        model(torch.tensor([a, b + a[17:]]), torch.arange(30).expand(2, 30), cache)  # row 1 padded
        steps = torch.stack(
            [
                model(torch.tensor([[xa[i]], [xb[i]]]), torch.tensor([[30 + i], [17 + i]]), cache)[:, 0]
                for i in range(6)
            ],
            dim=1,
        )  # [2, 6, vocab]
        verify = model(torch.tensor([xa, xb]), torch.stack([torch.arange(30, 36), torch.arange(17, 23)]), cache)
        alone = model(torch.tensor([xb[:4]]), torch.arange(17, 21)[None], cache.rows([1]))  # row 1 by itself
    assert torch.equal(verify, steps)
    assert torch.equal(alone[0], steps[1, :4])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_call_layer_computes_what_the_layers_ops_do(mixed_file, dtype, monkeypatch):
    """kernels/layer.cpp (a decode step or verify forward of a whole decoder layer in one call)
    against the same layer's PyTorch ops, on a prefill and then forwards over the cache: the
    same function, rounded differently (RoPE and the residual adds in float32)."""
    from specdec.models import gguf_layer

    model = load_pretrained(mixed_file, dtype=dtype, load_tokenizer=False, keep_quantized=True).model
    assert all(isinstance(layer, gguf_layer.GGUFDecoderLayer) for layer in model.layers)
    g = torch.Generator().manual_seed(31)
    prompt, steps = torch.randint(2, 300, (2, 20), generator=g), torch.randint(2, 300, (2, 5), generator=g)

    def run() -> torch.Tensor:
        cache = model.new_cache(2, 32)
        with torch.inference_mode():
            model(prompt, torch.arange(20).expand(2, 20), cache)
            return torch.cat(
                [
                    model(steps[:, :1], torch.tensor([[20], [20]]), cache),
                    model(steps[:, 1:], torch.arange(21, 25).expand(2, 4), cache),
                ],
                dim=1,
            ).float()

    fused = run()
    monkeypatch.setattr(gguf_layer.GGUFDecoderLayer, "forward", _layer_ops)
    ops = run()
    tolerance = (
        1e-3 if dtype == "float32" else 0.05
    )  # an int8 activation code may round the other way; bfloat16 between ops
    assert (fused - ops).abs().max() <= tolerance * ops.abs().max()


def _layer_ops(self, x, cos, signed_sin, mask, positions, cache, num_keys):
    """llama.DecoderLayer.forward: the layer as PyTorch ops."""
    x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, mask, positions, cache, num_keys)
    return x + self.mlp(self.post_attention_layernorm(x))


def test_quantization_none_dequantizes_a_gguf_file(mixed_file):
    llm = LLM(model=str(mixed_file), dtype="float32", quantization=None, speculative_method="none")
    assert isinstance(llm.target.model.lm_head, torch.nn.Linear)


def test_a_second_load_reads_the_packed_weights_from_the_cache(mixed_file, tmp_path, monkeypatch):
    from specdec.models import gguf_cache

    monkeypatch.setenv("SPECDEC_PACKED_CACHE", str(tmp_path / "packed"))
    first = load_pretrained(mixed_file, dtype="float32", load_tokenizer=False, keep_quantized=True).model
    data_path, index_path, _ = gguf_cache.entry(mixed_file)
    assert data_path.is_file() and index_path.is_file()
    calls = []
    monkeypatch.setattr("specdec.models.gguf._read", lambda *a, **k: calls.append(a))  # the GGUF file is not read
    second = load_pretrained(mixed_file, dtype="float32", load_tokenizer=True, keep_quantized=True)
    assert not calls and second.tokenizer is not None
    ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        assert torch.equal(first(ids, torch.arange(12)[None], None), second.model(ids, torch.arange(12)[None], None))
    # the matrices every step streams sit in one block of memory, read from the cache file; the
    # embedding, which has an output layer of its own and is only gathered from, stays mapped
    block = second.model.layers[0].mlp.down_proj.parts[0].codes.untyped_storage()
    assert second.model.lm_head.parts[0].codes.untyped_storage().data_ptr() == block.data_ptr()
    assert second.model.layers[1].self_attn.qkv_proj.parts[0].sc.untyped_storage().data_ptr() == block.data_ptr()
    embedding = second.model.embed_tokens.table_codes.untyped_storage()
    assert embedding.data_ptr() != block.data_ptr() and embedding.nbytes() < data_path.stat().st_size
    monkeypatch.undo()


def test_a_changed_file_or_a_damaged_entry_is_packed_again(tmp_path, monkeypatch):
    from specdec.models import gguf_cache

    monkeypatch.setenv("SPECDEC_PACKED_CACHE", str(tmp_path / "packed"))
    path = write_gguf(tmp_path / "model.gguf", tiny_hf_model("llama", seed=1), "Q8_0")
    load_pretrained(path, dtype="float32", load_tokenizer=False, keep_quantized=True)
    first_key = gguf_cache.entry(path)[2]
    write_gguf(path, tiny_hf_model("llama", seed=2), "Q8_0")  # another model under the same name
    os.utime(path, ns=(1, 1))
    model = load_pretrained(path, dtype="float32", load_tokenizer=False, keep_quantized=True).model
    data_path, index_path, key = gguf_cache.entry(path)
    assert key != first_key and sorted(p.name for p in (tmp_path / "packed").iterdir()) == sorted(
        [data_path.name, index_path.name]
    )  # the older entry is gone
    dense = load_pretrained(path, dtype="float32", load_tokenizer=False).model
    assert torch.equal(model.lm_head.dequantized_weight(), dense.lm_head.weight)
    index_path.write_text(index_path.read_text()[:100])  # cut short
    again = load_pretrained(path, dtype="float32", load_tokenizer=False, keep_quantized=True).model
    assert torch.equal(again.lm_head.dequantized_weight(), dense.lm_head.weight)
