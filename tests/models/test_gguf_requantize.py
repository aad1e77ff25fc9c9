"""Float matrices quantized into GGUF types (models/gguf_requantize.py), against the `gguf`
package's own quantizer and dequantizer (llama.cpp's reference in Python):

- the packed tensor holds exactly the values gguf's Q8_0 / Q4_0 bytes dequantize to;
- a layer's product is that of those weights (up to the kernel's int8 activations);
- an EAGLE head run on the GGUF kernels (one C++ call for its decoder layer, with a cache)
  predicts what the same head with those dequantized weights predicts in float.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from helpers import save_random_head, save_tiny_model
from specdec.models.eagle import load_head
from specdec.models.gguf_layer import GGUFDecoderLayer
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_requantize import gguf_linear, quantize_into_gguf_kernels, quantize_matrix
from specdec.models.loader import load_pretrained

KINDS = ["Q8_0", "Q4_0"]


def gguf_round_trip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """weight as gguf's quantizer stores it and its dequantizer reads it back (float32)."""
    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(weight.float().numpy(), qtype)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_matrix_holds_what_gguf_dequantizes_its_bytes_to(kind):
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)) * 0.1  # 40: a padded group of 16
    layer = GGUFLinear([quantize_matrix(weight, kind)])
    expected = gguf_round_trip(weight, kind)
    assert torch.equal(layer.dequantized_weight(), expected)
    assert (expected - weight).abs().max() <= {"Q8_0": 0.01, "Q4_0": 0.15}[kind] * weight.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_a_layers_product_is_that_of_its_quantized_weights(kind):
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
        linear.bias.copy_(torch.randn(48, generator=g))
    layer = gguf_linear(linear, kind)
    x = torch.randn(3, 5, 64, generator=g)
    expected = x @ gguf_round_trip(linear.weight.detach(), kind).T + linear.bias.detach()
    got = layer(x)
    assert got.shape == (3, 5, 48)
    assert (got - expected).abs().max() <= 0.03 * expected.abs().max()  # int8 activations


def test_a_matrix_of_part_blocks_is_refused_and_such_a_layer_stays_float():
    with pytest.raises(ValueError, match="whole blocks of 32 inputs, got 40"):
        quantize_matrix(torch.zeros(16, 40), "Q8_0")
    with pytest.raises(ValueError, match="quantizes into"):
        quantize_matrix(torch.zeros(16, 64), "Q6_K")
    module = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 8))
    assert quantize_into_gguf_kernels(module, "Q8_0") == {"Q8_0": 1, "float": 1}
    assert isinstance(module[0], GGUFLinear) and isinstance(module[1], nn.Linear)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_head_on_the_gguf_kernels_predicts_what_its_dequantized_weights_do(tmp_path, arch, kind):
    """An EAGLE-3 head, its decoder layer one C++ call over its cache, fed one entry at a time
    (as drafting steps feed it): its predicted features are those of the float head whose every
    matrix is gguf's dequantization of the same bytes (the kernels quantize activations to int8:
    close, not equal)."""
    target_dir = save_tiny_model(tmp_path / "target", arch, seed=3, num_hidden_layers=3, tokenizer=False)
    head_dir = save_random_head(target_dir, tmp_path / "head", seed=4, feature_layers=(0, 1, 2))
    config = load_pretrained(target_dir, "float32", load_tokenizer=False).model.config
    quantized = load_head(head_dir, config, torch.float32)
    reference = load_head(head_dir, config, torch.float32)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(gguf_round_trip(module.weight, kind))
    assert quantize_into_gguf_kernels(quantized, kind) == {kind: 6, "float": 0}  # fuse, fc, qkv, o, gate_up, down
    assert isinstance(quantized.layers[0], GGUFDecoderLayer)

    g = torch.Generator().manual_seed(5)
    T, H = 6, config.hidden_size
    embeddings, features = torch.randn(1, T, H, generator=g), torch.randn(1, T, 3 * H, generator=g)
    positions = torch.arange(T)[None]  # [1, T]
    with torch.no_grad():
        expected = reference(embeddings, reference.fuse_features(features), positions)  # [1, T, H], causal
        cache = quantized.new_cache(1, 16).rows([0])
        got = torch.cat(
            [
                quantized(
                    embeddings[:, t : t + 1],
                    quantized.fuse_features(features[:, t : t + 1]),
                    positions[:, t : t + 1],
                    cache,
                )
                for t in range(T)
            ],
            dim=1,
        )  # [1, T, H]
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
