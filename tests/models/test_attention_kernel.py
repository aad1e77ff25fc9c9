"""specdec's attention kernel (kernels/attention.cpp) against PyTorch's attention in float64,
and each query's result alone against the same query in a batch, a longer forward and a longer
cache: bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.kernels import ops


def reference(q, keys, values, mask):
    """PyTorch's attention in float64: q [B, T, H, D], keys/values [B, S, Hkv, D], mask [B, 1, T, S]."""
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, keys, values))
    out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)  # [B, T, H, D]


def random_case(seed: int, B=2, T=5, H=6, Hkv=2, D=32, S=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    keys, values = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7  # any pattern: a tree's, a window's
    mask[..., 0] = True  # every query sees a key
    return q, keys, values, mask


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
# (14, 2): 7 query heads a group, weighed 4 and then 3 at once
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1), (14, 2)])
@pytest.mark.parametrize("head_dim", [32, 40, 8])  # 40: the shipped draft's; a head size need not be a multiple of 16
def test_attention_matches_pytorch_in_float64(dtype, tolerance, heads, head_dim):
    q, keys, values, mask = random_case(1, H=heads[0], Hkv=heads[1], D=head_dim, dtype=dtype)
    got = ops().attend(q, keys, values, mask, q.shape[-1] ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - reference(q, keys, values, mask)).abs().max() <= tolerance


def test_no_mask_reads_every_key_and_a_shared_mask_broadcasts():
    q, keys, values, _ = random_case(2, D=64)
    every = torch.ones(1, 1, q.shape[1], keys.shape[1], dtype=torch.bool)
    scale = q.shape[-1] ** -0.5
    assert torch.equal(ops().attend(q, keys, values, None, scale), ops().attend(q, keys, values, every, scale))
    assert (ops().attend(q, keys, values, None, scale).double() - reference(q, keys, values, every)).abs().max() < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 40])
def test_a_query_alone_gets_what_it_gets_in_a_batch(dtype, head_dim):
    """Bit for bit: alone, among more queries, beside another batch row, over a cache with more
    (hidden) keys after its own, and with keys it cannot see left out altogether."""
    q, keys, values, mask = random_case(3, S=300, D=head_dim, dtype=dtype)
    scale = head_dim**-0.5
    batch = ops().attend(q, keys, values, mask, scale)
    for b in range(2):
        for t in range(q.shape[1]):
            alone = ops().attend(
                q[b : b + 1, t : t + 1], keys[b : b + 1], values[b : b + 1], mask[b : b + 1, :, t : t + 1], scale
            )
            assert torch.equal(alone, batch[b : b + 1, t : t + 1])
            last = int(mask[b, 0, t].nonzero().max()) + 1  # the cache cut after the query's last key
            cut = ops().attend(
                q[b : b + 1, t : t + 1],
                keys[b : b + 1, :last],
                values[b : b + 1, :last],
                mask[b : b + 1, :, t : t + 1, :last].contiguous(),
                scale,
            )
            assert torch.equal(cut, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_over_scattered_keys_gets_what_it_gets_over_them_in_a_row(dtype):
    """Bit for bit: a query that sees some keys among others it cannot see (a tree's node, whose
    ancestors the verify forward wrote wherever their columns were) gets what it gets over the
    same keys alone, side by side with nothing masked (the same token in a chain, or a decode
    step). The softmax's sum once put a key in the lane of its column, not of its rank."""
    q, keys, values, mask = random_case(5, S=300, D=64, dtype=dtype)
    scale = 64**-0.5
    scattered = ops().attend(q, keys, values, mask, scale)
    for b in range(2):
        for t in range(q.shape[1]):
            seen = mask[b, 0, t].nonzero()[:, 0]  # [n] the keys it sees, in order
            in_a_row = ops().attend(
                q[b : b + 1, t : t + 1], keys[b : b + 1, seen], values[b : b + 1, seen], None, scale
            )
            assert torch.equal(in_a_row, scattered[b : b + 1, t : t + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_mask_gets_the_bits_of_its_keys_alone_and_scattered(dtype):
    """A verify's causal mask (query t sees the first ctx + t + 1 keys; more are cached after
    them), at Qwen2.5-1.5B's heads: bit for bit what each query gets over its keys alone with no
    mask, and over the same keys in order among decoys it cannot see (a tree's node). The kernel
    takes a shorter path where a query sees a prefix of the keys (the first two) than for any
    other mask (the last)."""
    g = torch.Generator().manual_seed(6)
    B, T, H, Hkv, D, ctx, S = 1, 7, 12, 2, 128, 40, 60
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    keys, values = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
    mask = (torch.arange(S)[None, :] <= ctx + torch.arange(T)[:, None])[None, None]  # [1, 1, T, S]
    scale = D**-0.5
    causal = ops().attend(q, keys, values, mask, scale)
    for t in range(T):
        seen = ctx + t + 1
        alone = ops().attend(q[:, t : t + 1], keys[:, :seen], values[:, :seen], None, scale)
        assert torch.equal(alone, causal[:, t : t + 1])
        decoys = [torch.randn(B, seen, Hkv, D, generator=g).to(dtype) for _ in range(2)]
        # [B, seen, 2, Hkv, D] -> [B, 2 seen, Hkv, D]: key i at position 2i, a decoy at 2i + 1
        spread_keys, spread_values = (
            torch.stack([real[:, :seen], decoy], dim=2).reshape(B, 2 * seen, Hkv, D)
            for real, decoy in zip((keys, values), decoys)
        )
        every_other = torch.zeros(1, 1, 1, 2 * seen, dtype=torch.bool)
        every_other[..., 0::2] = True
        scattered = ops().attend(q[:, t : t + 1], spread_keys, spread_values, every_other, scale)
        assert torch.equal(scattered, causal[:, t : t + 1])


def test_bad_shapes_are_named():
    q, keys, values, mask = random_case(4)
    with pytest.raises(RuntimeError, match="mask: bool"):
        ops().attend(q, keys, values, mask[:, :, :2], 1.0)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        ops().attend(q[:, :, :5], keys, values, mask, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_rows_get_the_bits_of_each_row_alone(dtype):
    """Rows of 5, 1 and 9 queries packed into one run [1, 15] (attend_packed: a ragged verify or
    prefill with no padding), each reading its own blocks of a shared pool up to its own key count,
    under one causal mask: every query's output equals its row run alone (attend_paged) bit for
    bit, and the row's keys past its count are never read (NaN there changes nothing)."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, max_blocks = 6, 2, 64, 4
    pool_keys, pool_values = (torch.randn(1 + 3 * max_blocks, 16, Hkv, D, generator=g).to(dtype) for _ in range(2))
    blocks = (1 + torch.randperm(3 * max_blocks, generator=g)).view(3, max_blocks)  # [3, 4]: scattered blocks
    lengths, firsts = [5, 1, 9], [20, 47, 3]  # each row's queries and its first query's position
    num_keys = [f + n for f, n in zip(firsts, lengths)]  # [25, 48, 12]
    for row, keys_of_row in enumerate(num_keys):  # what no query may read: past each row's keys
        for p in range(keys_of_row, max_blocks * 16):
            pool_keys[blocks[row, p // 16], p % 16] = float("nan")
    positions = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, lengths)])  # [15]
    S = max(num_keys)
    mask = (torch.arange(S) <= positions[:, None])[None, None]  # [1, 1, 15, S] causal by position
    q = torch.randn(1, len(positions), H, D, generator=g).to(dtype)
    starts = torch.tensor([0, 5, 6, 15])
    scale = D**-0.5
    flat = ops().attend_packed(
        q, pool_keys, pool_values, blocks, starts, torch.tensor(num_keys), mask, S, scale
    )  # [1, 15, H, D]
    assert not flat.isnan().any()
    for row in range(3):
        first, last = int(starts[row]), int(starts[row + 1])
        alone = ops().attend_paged(
            q[:, first:last],
            pool_keys,
            pool_values,
            blocks[row : row + 1],
            mask[:, :, first:last, : num_keys[row]].contiguous(),
            num_keys[row],
            scale,
        )
        assert torch.equal(flat[:, first:last], alone), f"row {row}"


def test_flat_rows_out_of_range_are_named():
    q = torch.randn(1, 4, 2, 16)
    keys = torch.randn(3, 16, 2, 16)
    blocks = torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="row_starts must end"):
        ops().attend_packed(q, keys, keys, blocks, torch.tensor([0, 1, 3]), torch.tensor([2, 3]), None, 3, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops().attend_packed(q, keys, keys, blocks, torch.tensor([0, 3, 4]), torch.tensor([2, 9]), None, 3, 1.0)
