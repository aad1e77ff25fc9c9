"""Weight-only int8 / int4: each layer computes what its definition says, a row's result does
not depend on its batch, speculation is exact with respect to the quantized target, the bench
measures the quality cost, and bad choices are refused.

References: the quantization formulas written out here (symmetric int8 per output row;
asymmetric int4 per group of 32, W = (q - 8) s + z), float64 matmuls, the quantized target
alone (for greedy equality; the chi-square tests are in test_distribution.py), and
transformers' loss (for the bench's perplexity).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import load_hf, save_tiny_pair
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.models.quantized_linear import (
    INT4_GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    check_quantization,
    quantize_linears,
)
from specdec.tools.benchmark.machine import decode_weight_bytes
from specdec.tools.benchmark.quality import perplexity

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 9, 31, 7, 7], list(range(40, 53)), [3] * 30]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("quant"), target_seed=21, draft_seed=22, draft_arch="llama")


def random_linear(out_features: int, in_features: int, seed: int, bias: bool = True) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(
            torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)
        )
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    return linear


def test_int8_layer_follows_its_definition():
    linear = random_linear(96, 64, seed=1)
    layer = Int8Linear(linear)
    W = linear.weight.detach().double()
    scales = W.abs().amax(dim=1) / 127  # [N]
    stored = layer.scales.double()  # bfloat16, rounded up
    assert torch.all(stored >= scales) and torch.all(stored <= scales * (1 + 2**-6))
    expected_q = torch.round(W / stored[:, None]).clamp(-127, 127)
    assert torch.equal(layer.weight_int8.double(), expected_q)
    dequantized = layer.dequantized_weight().double()
    assert torch.all((dequantized - W).abs() <= stored[:, None] * 0.5 * (1 + 1e-6))  # half a step at most
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(2))
    expected = x.to(torch.bfloat16).double() @ dequantized.t() + linear.bias.double()  # [5, 3, 96]
    got = layer(x)
    assert got.shape == (5, 3, 96) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_int4_layer_follows_its_definition():
    linear = random_linear(48, 4 * INT4_GROUP_SIZE, seed=3, bias=False)
    layer = Int4Linear(linear)
    W = linear.weight.detach().double().view(48, 4, INT4_GROUP_SIZE)  # [N, groups, G]
    low, high = W.amin(-1, keepdim=True), W.amax(-1, keepdim=True)
    scales = (high - low) / 15
    stored = layer.scales_and_zeros.double()  # [groups, N, 2]: bfloat16 scale (rounded up), zero
    stored_scales, stored_zeros = stored[..., 0].t()[..., None], stored[..., 1].t()[..., None]  # [N, groups, 1]
    assert torch.all(stored_scales >= scales) and torch.all(stored_scales <= scales * (1 + 2**-6))
    zeros = (low + 8 * stored_scales).to(torch.bfloat16).double()
    assert torch.equal(stored_zeros, zeros)
    q = (torch.round((W - zeros) / stored_scales) + 8).clamp(0, 15)
    expected_weight = ((q - 8) * stored_scales + zeros).view(48, -1)
    dequantized = layer.dequantized_weight().double()
    assert (dequantized - expected_weight).abs().max() <= 1e-2 * expected_weight.abs().max()
    assert (dequantized - W.view(48, -1)).abs().max() <= stored_scales.max() * 0.6  # half a step (+ rounding)
    x = torch.randn(7, 4 * INT4_GROUP_SIZE, generator=torch.Generator().manual_seed(4))
    expected = x.to(torch.bfloat16).double() @ expected_weight.t()
    assert (layer(x).double() - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("layer_type", [Int8Linear, Int4Linear])
def test_a_rows_result_does_not_depend_on_its_batch(layer_type):
    """What makes speculation exact on a quantized target: a verify forward of k+1 rows and a
    padded batch give each row what a one-token step gives it, bit for bit."""
    layer = layer_type(random_linear(160, 128, seed=5, bias=layer_type is Int8Linear))
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(6))
    full = layer(x)
    for rows in (1, 2, 6, 9):
        assert torch.equal(layer(x[:rows]), full[:rows])


def test_int4_keeps_int8_where_the_kernel_does_not_take_the_shape():
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 100), nn.Linear(48, 32))  # 100 rows, 48 inputs: no
    assert quantize_linears(model, "int4") == {"int4": 1, "int8": 2}
    assert [type(m) for m in model] == [Int4Linear, Int8Linear, Int8Linear]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_speculation_equals_the_quantized_target_alone(dirs, quantization, method):
    target_alone = LLM(
        str(dirs["target"]), dtype="float32", compile="off", quantization=quantization, speculative_method="none"
    )
    expected = [o.outputs[0].token_ids for o in target_alone.generate(PROMPTS, GREEDY)]
    other = {"int8": "int4", "int4": "int8"}[quantization]  # the target as its own draft, quantized the other way
    drafter = (
        dict(speculative_model=str(dirs["target"]), draft_quantization=other, draft_dtype="float32")
        if method == "draft_model"
        else dict(speculative_method="ngram")
    )
    llm = LLM(
        str(dirs["target"]),
        dtype="float32",
        compile="off",
        quantization=quantization,
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        **drafter,
    )  # drafts judged every round
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    proposed = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert proposed > 0 and (method == "ngram" or 0 < accepted < proposed)
    assert not any(isinstance(m, nn.Linear) for m in llm.runner.model.modules())


def test_quantized_weights_are_fewer_bytes(dirs):
    plain = LLM(str(dirs["target"]), dtype="float32", compile="off", speculative_method="none").runner.model
    int8 = LLM(
        str(dirs["target"]), dtype="float32", compile="off", quantization="int8", speculative_method="none"
    ).runner.model
    int4 = LLM(
        str(dirs["target"]), dtype="float32", compile="off", quantization="int4", speculative_method="none"
    ).runner.model
    assert decode_weight_bytes(int4) < decode_weight_bytes(int8) < decode_weight_bytes(plain) / 3


def test_perplexity_matches_transformers_loss(dirs):
    """The bench's perplexity of the unquantized model: exp of transformers' mean loss over
    the same windows; the int8 model's is close to it."""
    llm = LLM(str(dirs["target"]), dtype="float32", compile="off", speculative_method="none")
    hf = load_hf(dirs["target"])
    ours = perplexity(llm.runner.model, llm, num_tokens=300)
    from specdec.tools.benchmark.prompts import held_out_sources

    ids = llm.tokenizer.encode(next(iter(held_out_sources()))[1])[:301]
    window, total, count = llm.max_model_len, 0.0, 0
    for start in range(0, 300, window):
        chunk = torch.tensor(ids[start : start + window + 1])[None]
        with torch.no_grad():
            loss = hf(chunk[:, :-1], labels=None).logits[0].log_softmax(-1)
        total -= float(loss.gather(1, chunk[0, 1:, None]).sum())
        count += chunk.shape[1] - 1
    assert ours == pytest.approx(math.exp(total / count), rel=1e-4)
    quantized = LLM(str(dirs["target"]), dtype="float32", compile="off", quantization="int8", speculative_method="none")
    assert perplexity(quantized.runner.model, quantized, num_tokens=300) == pytest.approx(ours, rel=0.05)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quantization="int3"), r"quantization must be one of None, 'auto', 'int8', 'int4'; got 'int3'"),
        (dict(quantization="INT8"), r"quantization must be one of None, 'auto', 'int8', 'int4'"),
        (
            dict(speculative_method="none", draft_quantization="int8"),
            r"draft_quantization='int8' with speculative_method='none'",
        ),
        (dict(speculative_method="ngram", draft_quantization="int4"), "configure a draft model"),
        (dict(speculative_model="DRAFT", draft_quantization="fp8"), r"draft_quantization must be one of None"),
    ],
)
def test_bad_quantization_is_refused(dirs, kwargs, message):
    if kwargs.get("speculative_model") == "DRAFT":
        kwargs["speculative_model"] = str(dirs["draft"])
    with pytest.raises(ValueError, match=message):
        LLM(str(dirs["target"]), **kwargs)


def test_quantization_on_a_device_without_the_kernel_is_refused():
    with pytest.raises(ValueError, match=r"quantization='int4' runs on the CPU kernels only.*use quantization=None"):
        check_quantization("int4", torch.device("cuda"))


def test_cli_quantization_flags(dirs, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(dirs["target"]),
            "--draft",
            str(dirs["draft"]),
            "--quantization",
            "int4",
            "--draft-quantization",
            "int8",
            "--dtype",
            "float32",
            "--prompt",
            "def f",
            "--max-tokens",
            "8",
            "--compile",
            "off",
            "--compare",
        ]
    )
    assert code == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(dirs["target"]), "--quantization", "int3", "--prompt", "x"])
    assert "invalid choice: 'int3' (choose from" in capsys.readouterr().err
    assert (
        main(["generate", "--model", str(dirs["target"]), "--ngram", "--draft-quantization", "int8", "--prompt", "x"])
        == 2
    )
    assert "--draft-quantization sets the draft model, and --ngram uses none" in capsys.readouterr().err
