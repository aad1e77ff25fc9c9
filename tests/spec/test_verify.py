"""The fast rejection sampler against a slow reference written from the paper, the edge cases
that have broken other engines, and the output distribution of rejection sampling alone.

Reference: Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023 (Algorithm 2). For draft
tokens x_1..x_n drawn from q_1..q_n, keep x_i while u_i < p_i(x_i) / q_i(x_i) (written
u_i * q_i(x_i) < p_i(x_i)); at the first rejection j emit a token drawn from
norm(max(0, p_j - q_j)) (from p_j if that is all zero); if all n are kept emit a bonus token
drawn from p_{n+1}. Here p = target_probs, q = draft_probs.
"""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from specdec.spec import verify
from specdec.spec.verify import rejection_sample
from specdec.tools.benchmark.chi_square import chi_square_p_value

# ---------------------------------------------------------------------------------------------
# The slow reference: a plain loop per row and per position.
# ---------------------------------------------------------------------------------------------


def inverse_cdf(weights: list[float], u: float) -> int:
    """The first index whose running float64 sum exceeds u * total (weights need not sum to 1);
    if rounding leaves none, the last index of positive weight."""
    total = 0.0
    for w in weights:
        total += w
    running = 0.0
    for index, w in enumerate(weights):
        running += w
        if running > u * total:
            return index
    return max(i for i, w in enumerate(weights) if w > 0)


def argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def reference_rejection_sample(draft_token_ids, num_draft, draft_probs, target_probs, generators, greedy=None):
    """Same contract as specdec.spec.verify.rejection_sample, one row and one position at a time.

    Randomness, per row, from that row's generator: u = rand(n + 1) in float64 for the row's n
    proposed drafts; u[i] decides draft position i, u[n] draws the recovered or bonus token."""
    B, k = draft_token_ids.shape
    V = target_probs.shape[-1]
    output = [[-1] * (k + 1) for _ in range(B)]
    num_accepted = [0] * B
    for b in range(B):
        n = int(num_draft[b])
        u = torch.rand(n + 1, dtype=torch.float64, generator=generators[b]).tolist()
        p = target_probs[b].double().tolist()  # [k+1][V], the float32 values exactly
        q = None if draft_probs is None else draft_probs[b].double().tolist()  # [k][V]
        is_greedy = greedy is not None and bool(greedy[b])
        final = None
        for i in range(n):
            x = int(draft_token_ids[b, i])
            if is_greedy:
                keep = x == argmax(p[i])
            else:
                q_x = 1.0 if q is None else q[i][x]  # None: a point mass on x
                keep = u[i] * q_x < p[i][x]
            if keep:
                output[b][i] = x
                num_accepted[b] += 1
                continue
            if is_greedy:
                final = argmax(p[i])
            else:
                q_i = [1.0 if v == x else 0.0 for v in range(V)] if q is None else q[i]
                residual = [max(0.0, p[i][v] - q_i[v]) for v in range(V)]
                if sum(residual) <= 0:
                    residual = p[i]
                final = inverse_cdf(residual, u[n])
            break
        if final is None:  # all n kept: the bonus token from p_{n+1}
            final = argmax(p[n]) if is_greedy else inverse_cdf(p[n], u[n])
        output[b][num_accepted[b]] = final
    return torch.tensor(output, dtype=torch.long), torch.tensor(num_accepted, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Random batches.
# ---------------------------------------------------------------------------------------------


def random_probs(shape, g: torch.Generator, zero_fraction: float) -> torch.Tensor:
    """Float32 distributions of random sharpness with exact zeros (as top-k / top-p leave)."""
    scale = torch.rand(shape[:-1], generator=g)[..., None] * 4 + 0.2
    logits = torch.randn(shape, generator=g) * scale
    drop = torch.rand(shape, generator=g) < zero_fraction
    drop.scatter_(-1, logits.argmax(-1, keepdim=True), False)  # at least one token stays
    return torch.softmax(logits.masked_fill(drop, float("-inf")), dim=-1)


def generators_for(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def random_batch(seed: int, B: int, k: int, V: int, with_draft_probs: bool, greedy_fraction: float):
    g = torch.Generator().manual_seed(seed)
    zero_fraction = float(torch.rand((), generator=g)) * 0.6
    target_probs = random_probs((B, k + 1, V), g, zero_fraction)
    if with_draft_probs:
        other = random_probs((B, k, V), g, zero_fraction)
        # mix q towards p so that long accepted runs (and bonus tokens) happen; weight 1 = q == p
        weight = torch.rand(B, k, 1, generator=g)
        weight = torch.where(torch.rand(B, k, 1, generator=g) < 0.25, 1.0, weight)
        draft_probs = weight * target_probs[:, :k] + (1 - weight) * other
        draft_probs = torch.where(weight == 1.0, target_probs[:, :k], draft_probs).contiguous()
        draft_token_ids = torch.multinomial(draft_probs.view(B * k, V), 1, generator=g).view(B, k)
    else:
        draft_probs = None
        # a deterministic drafter proposes anything: often the target's likely tokens, sometimes
        # an arbitrary token (maybe of target probability 0)
        likely = torch.multinomial(target_probs[:, :k].reshape(B * k, V), 1, generator=g).view(B, k)
        arbitrary = torch.randint(0, V, (B, k), generator=g)
        draft_token_ids = torch.where(torch.rand(B, k, generator=g) < 0.8, likely, arbitrary)
    greedy = torch.rand(B, generator=g) < greedy_fraction
    # greedy rows: draft the argmax most of the time so that prefixes match
    argmax_tokens = target_probs[:, :k].argmax(-1)
    use_argmax = greedy[:, None] & (torch.rand(B, k, generator=g) < 0.7)
    draft_token_ids = torch.where(use_argmax, argmax_tokens, draft_token_ids)
    num_draft = torch.randint(0, k + 1, (B,), generator=g)
    num_draft[0], num_draft[-1] = 0, k  # ragged, always with an empty row and a full row
    draft_token_ids = torch.where(torch.arange(k)[None, :] < num_draft[:, None], draft_token_ids, -1)
    row_seeds = [seed * 1000 + b for b in range(B)]
    return dict(
        draft_token_ids=draft_token_ids,
        num_draft=num_draft,
        draft_probs=draft_probs,
        target_probs=target_probs,
        row_seeds=row_seeds,
        greedy=greedy if greedy_fraction > 0 else None,
    )


def run_both(batch):
    """The fast and the reference sampler on the same inputs, each with its own identically
    seeded generators; also checks both consumed exactly the same random numbers."""
    fast_generators, ref_generators = generators_for(batch["row_seeds"]), generators_for(batch["row_seeds"])
    args = (batch["draft_token_ids"], batch["num_draft"], batch["draft_probs"], batch["target_probs"])
    fast_output, fast_accepted = rejection_sample(*args, fast_generators, batch["greedy"])
    ref_output, ref_accepted = reference_rejection_sample(*args, ref_generators, batch["greedy"])
    after_fast = [torch.rand(1, dtype=torch.float64, generator=g).item() for g in fast_generators]
    after_ref = [torch.rand(1, dtype=torch.float64, generator=g).item() for g in ref_generators]
    assert after_fast == after_ref, "the fast sampler drew a different number of uniforms per row"
    return fast_output, fast_accepted, ref_output, ref_accepted


def check_output_shape(output, num_accepted, num_draft, k):
    B = output.shape[0]
    assert output.shape == (B, k + 1) and output.dtype == torch.long
    assert num_accepted.shape == (B,)
    assert bool((num_accepted >= 0).all()) and bool((num_accepted <= num_draft).all())
    for b in range(B):
        n = int(num_accepted[b])
        assert bool((output[b, : n + 1] >= 0).all()), f"row {b}: a -1 inside the emitted tokens"
        assert bool((output[b, n + 1 :] == -1).all()), f"row {b}: not padded with -1 after {n + 1} tokens"


CASES = [  # (seed, B, k, V, with_draft_probs, greedy_fraction)
    (
        seed,
        1 + (seed * 7) % 16,
        1 + seed % 8,
        (2, 7, 33, 1000)[(seed // 8) % 4],
        (seed // 32) % 2 == 0,
        (0.0, 0.3, 1.0)[(seed // 3) % 3],
    )
    for seed in range(1, 97)
]


@pytest.mark.parametrize("seed,B,k,V,with_draft_probs,greedy_fraction", CASES)
def test_fast_matches_reference(seed, B, k, V, with_draft_probs, greedy_fraction):
    batch = random_batch(seed, B, k, V, with_draft_probs, greedy_fraction)
    fast_output, fast_accepted, ref_output, ref_accepted = run_both(batch)
    check_output_shape(fast_output, fast_accepted, batch["num_draft"], k)
    assert torch.equal(fast_accepted, ref_accepted)
    assert torch.equal(fast_output, ref_output)


def test_reference_cases_cover_every_path():
    """The random cases above really reach accepted runs, rejections and full acceptance, with
    and without draft_probs, in greedy and sampled rows."""
    seen = set()
    for seed, B, k, V, with_draft_probs, greedy_fraction in CASES:
        batch = random_batch(seed, B, k, V, with_draft_probs, greedy_fraction)
        _, accepted, _, _ = run_both(batch)
        greedy = batch["greedy"] if batch["greedy"] is not None else torch.zeros(B, dtype=torch.bool)
        for b in range(B):
            n, a = int(batch["num_draft"][b]), int(accepted[b])
            kind = ("greedy" if greedy[b] else "sampled", with_draft_probs)
            if n > 0:
                seen.add(kind + ("rejected" if a < n else "all accepted",))
            if a >= 2:
                seen.add(kind + ("run of 2+",))
    for kind in (("greedy", True), ("greedy", False), ("sampled", True), ("sampled", False)):
        for path in ("rejected", "all accepted", "run of 2+"):
            assert kind + (path,) in seen, f"no {path} among {kind} rows"


def test_k_zero_samples_from_p():
    """k = 0: one token from p, no uniforms wasted on acceptance tests."""
    g = torch.Generator().manual_seed(11)
    B, V = 12, 9
    target_probs = random_probs((B, 1, V), g, 0.4)
    batch = dict(
        draft_token_ids=torch.zeros(B, 0, dtype=torch.long),
        num_draft=torch.zeros(B, dtype=torch.long),
        draft_probs=None,
        target_probs=target_probs,
        row_seeds=list(range(100, 100 + B)),
        greedy=None,
    )
    fast_output, fast_accepted, ref_output, ref_accepted = run_both(batch)
    assert fast_output.shape == (B, 1)
    assert torch.equal(fast_output, ref_output) and not bool(fast_accepted.any())
    assert bool((target_probs[torch.arange(B), 0, fast_output[:, 0]] > 0).all())


# ---------------------------------------------------------------------------------------------
# Edge cases.
# ---------------------------------------------------------------------------------------------


def fixed_uniforms(value: float):
    """A stand-in for specdec.sampling.uniforms that returns `value` for every draw."""

    def draw(generators, counts, device):
        return torch.full((len(generators), max(counts)), value, dtype=torch.float64, device=device)

    return draw


def one_row(p_rows, q_rows, draft_tokens):
    """A batch of one row: target_probs [1, k+1, V], draft_probs [1, k, V] | None."""
    target_probs = torch.tensor([p_rows], dtype=torch.float32)
    draft_probs = None if q_rows is None else torch.tensor([q_rows], dtype=torch.float32)
    draft = torch.tensor([draft_tokens], dtype=torch.long)
    return draft, torch.tensor([len(draft_tokens)]), draft_probs, target_probs


def test_draft_token_with_q_zero_is_accepted_iff_p_positive():
    """q(x) = 0 (the drafter could not have drawn x, say a padded vocabulary): u * 0 < p(x)
    holds for every u exactly when p(x) > 0; no division, no NaN."""
    B = 2000
    p = torch.tensor([0.0, 0.3, 0.7, 0.0])
    q = torch.tensor([0.3, 0.0, 0.7, 0.0])
    target_probs = p.expand(B, 2, 4).clone()
    draft_probs = q.expand(B, 1, 4).clone()
    generators = generators_for(range(B))
    accepted_x1 = rejection_sample(
        torch.full((B, 1), 1), torch.ones(B, dtype=torch.long), draft_probs, target_probs, generators
    )[1]
    assert bool((accepted_x1 == 1).all()), "q(x) = 0 < p(x): must always be accepted"
    output, accepted_x3 = rejection_sample(
        torch.full((B, 1), 3), torch.ones(B, dtype=torch.long), draft_probs, target_probs, generators
    )
    assert not bool(accepted_x3.any()), "q(x) = p(x) = 0: must never be accepted"
    assert set(output[:, 0].tolist()) <= {1}, "residual max(0, p - q) is a point mass on token 1"
    for value in (0.0, 1 - 2.0**-53):  # the extremes of a float64 uniform in [0, 1)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(verify, "uniforms", fixed_uniforms(value))
            assert (
                int(
                    rejection_sample(
                        torch.tensor([[1]]), torch.tensor([1]), draft_probs[:1], target_probs[:1], generators[:1]
                    )[1]
                )
                == 1
            )


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_p_zero_is_never_accepted_even_with_u_zero(with_draft_probs):
    """A uniform of exactly 0 must not accept a token of target probability 0 (u * q < p is
    0 < 0, false), while any token of positive p is accepted at u = 0; and the recovered /
    bonus token at u = 0 is the first token of positive mass, never a zero-probability one."""
    V = 6
    p = [0.0, 0.0, 0.25, 0.0, 0.75, 0.0]
    q = [0.1, 0.4, 0.0, 0.3, 0.2, 0.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "uniforms", fixed_uniforms(0.0))
        for x in range(V):
            draft, num_draft, draft_probs, target_probs = one_row([p, p], [q] if with_draft_probs else None, [x])
            output, accepted = rejection_sample(draft, num_draft, draft_probs, target_probs, generators_for([0]))
            assert int(accepted[0]) == (1 if p[x] > 0 else 0), f"token {x} (p = {p[x]})"
            if p[x] > 0:  # accepted; the bonus from p at u = 0 is its first positive token
                assert output[0].tolist() == [x, 2]
            else:  # recovered from max(0, p - q) = [0, 0, .25, 0, .55, 0], or from p without x = p
                assert output[0].tolist() == [2, -1]
    with pytest.MonkeyPatch.context() as mp:  # the largest float64 uniform below 1: last positive token
        mp.setattr(verify, "uniforms", fixed_uniforms(1 - 2.0**-53))
        draft, num_draft, draft_probs, target_probs = one_row([p, p], [q] if with_draft_probs else None, [0])
        output, accepted = rejection_sample(draft, num_draft, draft_probs, target_probs, generators_for([0]))
        assert output[0].tolist() == [4, -1]


def test_p_zero_never_accepted_over_many_draws():
    """The same with real generators over many rows: p(x) = 0 is never kept, whatever q."""
    B, V = 5000, 5
    g = torch.Generator().manual_seed(3)
    target_probs = random_probs((B, 3, V), g, 0.0)
    target_probs[:, :, 2] = 0
    target_probs = target_probs / target_probs.sum(-1, keepdim=True)
    draft_probs = random_probs((B, 2, V), g, 0.0)
    draft = torch.full((B, 2), 2)
    for probs in (draft_probs, None):
        output, accepted = rejection_sample(draft, torch.full((B,), 2), probs, target_probs, generators_for(range(B)))
        assert not bool(accepted.any())
        assert not bool((output[:, 0] == 2).any()), "recovered a token of target probability 0"


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_residual_summing_to_zero_falls_back_to_p(with_draft_probs):
    """When max(0, p - q) is all zero (p == q exactly, and the drafted token had p = q = 0, or
    p <= q everywhere), the recovered token is drawn from p: checked against the reference and,
    over many rows, against p itself."""
    B, V = 20000, 6
    p = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    if with_draft_probs:
        q = p.clone()  # p == q exactly; token 1 has p = q = 0
        draft_probs = q.expand(B, 1, V).contiguous()
        draft_token = 1
    else:
        draft_probs = None  # point mass on 4; p is scaled so that p <= one_hot(4) everywhere
        p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.0])
        draft_token = 4
    target_probs = p.expand(B, 2, V).contiguous()
    batch = dict(
        draft_token_ids=torch.full((B, 1), draft_token),
        num_draft=torch.ones(B, dtype=torch.long),
        draft_probs=draft_probs,
        target_probs=target_probs,
        row_seeds=list(range(7, 7 + B)),
        greedy=None,
    )
    fast_output, fast_accepted, ref_output, ref_accepted = run_both(batch)
    assert torch.equal(fast_output, ref_output) and torch.equal(fast_accepted, ref_accepted)
    rejected = fast_accepted == 0
    assert int(rejected.sum()) > B // 3
    recovered = fast_output[rejected, 0]
    assert bool((p[recovered] > 0).all()), "recovered a token outside the support of p"
    if with_draft_probs:
        assert_follows(recovered, p)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_padding_past_num_draft_does_not_matter(with_draft_probs):
    """Entries past num_draft (-1, 0, or any token) change nothing, and draft_probs there are
    never read."""
    B, k, V = 64, 5, 11
    batch = random_batch(123, B, k, V, with_draft_probs, 0.3)
    outputs = []
    for fill in (-1, 0, V - 1, "random"):
        draft = batch["draft_token_ids"].clone()
        pad = torch.arange(k)[None, :] >= batch["num_draft"][:, None]
        draft[pad] = torch.randint(0, V, (int(pad.sum()),)) if fill == "random" else fill
        draft_probs = batch["draft_probs"]
        if draft_probs is not None and fill != -1:
            draft_probs = draft_probs.clone()
            draft_probs[pad] = torch.softmax(torch.randn(int(pad.sum()), V), -1)
        outputs.append(
            rejection_sample(
                draft,
                batch["num_draft"],
                draft_probs,
                batch["target_probs"],
                generators_for(batch["row_seeds"]),
                batch["greedy"],
            )
        )
    for output, accepted in outputs[1:]:
        assert torch.equal(output, outputs[0][0]) and torch.equal(accepted, outputs[0][1])
    check_output_shape(outputs[0][0], outputs[0][1], batch["num_draft"], k)


def test_output_padding_and_accepted_prefix():
    """Emitted tokens are the accepted drafts, in order, then one more; -1 after that."""
    batch = random_batch(77, 48, 6, 20, True, 0.0)
    output, accepted = rejection_sample(
        batch["draft_token_ids"],
        batch["num_draft"],
        batch["draft_probs"],
        batch["target_probs"],
        generators_for(batch["row_seeds"]),
    )
    check_output_shape(output, accepted, batch["num_draft"], 6)
    for b in range(48):
        n = int(accepted[b])
        assert output[b, :n].tolist() == batch["draft_token_ids"][b, :n].tolist()
        if n < int(batch["num_draft"][b]):  # rejected: the recovered token is never the rejected draft
            x = int(batch["draft_token_ids"][b, n])
            p_n, q_n = batch["target_probs"][b, n], batch["draft_probs"][b, n]
            if float(p_n[x]) <= float(q_n[x]) and float((p_n - q_n).clamp(min=0).sum()) > 0:
                assert int(output[b, n]) != x
    assert len(set(accepted.tolist())) > 2


def test_greedy_rows_use_no_randomness():
    """Greedy rows: prefix matching against argmax, then argmax; the same for any generator."""
    batch = random_batch(5, 32, 4, 50, True, 1.0)
    results = [
        rejection_sample(
            batch["draft_token_ids"],
            batch["num_draft"],
            batch["draft_probs"],
            batch["target_probs"],
            generators_for([seed + b for b in range(32)]),
            batch["greedy"],
        )
        for seed in (0, 999)
    ]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    argmax_tokens = batch["target_probs"].argmax(-1)
    for b in range(32):
        n = int(results[0][1][b])
        assert results[0][0][b, : n + 1].tolist() == argmax_tokens[b, : n + 1].tolist()


# ---------------------------------------------------------------------------------------------
# The output distribution of rejection sampling alone.
# ---------------------------------------------------------------------------------------------


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, what: str = "") -> None:
    p_value = chi_square_p_value(samples, probs)
    assert p_value > 1e-3, f"{what}: chi-square p-value {p_value:.2e} over {len(samples)} draws"


V_SMALL = 8
N_DRAWS = 120_000


@pytest.fixture(scope="module")
def p_and_q():
    """Fixed random target and draft distributions over 8 tokens, each with a zero the other
    lacks: q(5) = 0 < p(5) and p(6) = 0 < q(6)."""
    g = torch.Generator().manual_seed(2023)
    p = torch.softmax(torch.randn(V_SMALL, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V_SMALL, generator=g) * 1.5, -1)
    p[6], q[5] = 0, 0
    return p / p.sum(), q / q.sum()


def test_rejection_sampling_follows_p_with_draft_probs(p_and_q):
    p, q = p_and_q
    B, k = N_DRAWS, 2
    g = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q, B * k, replacement=True, generator=g).view(B, k)  # x_i ~ q, independent
    target_probs = p.expand(B, k + 1, V_SMALL)
    draft_probs = q.expand(B, k, V_SMALL)
    output, accepted = rejection_sample(
        draft, torch.full((B,), k), draft_probs, target_probs, generators_for(range(10_000, 10_000 + B))
    )
    assert_follows(output[:, 0], p, "first token")
    assert_follows(output[accepted >= 1, 1], p, "second token, first accepted")
    # acceptance probability is sum min(p, q); the first rejection draws from norm(max(0, p - q))
    alpha = float(torch.minimum(p, q).sum())
    assert scipy.stats.binomtest(int((accepted >= 1).sum()), B, alpha).pvalue > 1e-3
    assert_follows(output[accepted == 0, 0], (p - q).clamp(min=0), "recovered token")


@pytest.mark.parametrize("draft_kind", ["fixed token", "arbitrary tokens"])
def test_rejection_sampling_follows_p_without_draft_probs(p_and_q, draft_kind):
    """draft_probs=None (a deterministic drafter): whatever tokens it proposes, the output
    follows p; the first rejection draws from p with the draft token removed."""
    p, q = p_and_q
    B, k = N_DRAWS, 2
    g = torch.Generator().manual_seed(2)
    if draft_kind == "fixed token":
        draft = torch.full((B, k), int(p.argmax()))
    else:  # proposals from any rule at all, here random and sometimes of p = 0 (token 6)
        draft = torch.multinomial(q, B * k, replacement=True, generator=g).view(B, k)
    target_probs = p.expand(B, k + 1, V_SMALL)
    output, accepted = rejection_sample(
        draft, torch.full((B,), k), None, target_probs, generators_for(range(20_000, 20_000 + B))
    )
    assert_follows(output[:, 0], p, "first token")
    assert_follows(output[accepted >= 1, 1], p, "second token, first accepted")
    if draft_kind == "fixed token":
        x = int(p.argmax())
        assert scipy.stats.binomtest(int((accepted >= 1).sum()), B, float(p[x])).pvalue > 1e-3
        p_without_x = p.clone()
        p_without_x[x] = 0
        assert_follows(output[accepted == 0, 0], p_without_x, "recovered token")


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rows_sharing_a_generator_draw_in_row_order(with_draft_probs):
    """Requests without a seed share one generator: its rows draw their k + 1 uniforms one row
    after another, in row order, exactly as the reference does; rows with their own
    generator are unaffected by the others."""
    B, k, V = 40, 4, 17
    batch = random_batch(31, B, k, V, with_draft_probs, 0.2)
    args = (batch["draft_token_ids"], batch["num_draft"], batch["draft_probs"], batch["target_probs"])

    def layout():  # rows 0, 3, 6, ... share one generator, rows 1, 4, ... another, the rest their own
        shared = generators_for([5, 6])
        return [shared[b % 3] if b % 3 < 2 else torch.Generator().manual_seed(100 + b) for b in range(B)]

    fast_generators, ref_generators = layout(), layout()
    fast_output, fast_accepted = rejection_sample(*args, fast_generators, batch["greedy"])
    ref_output, ref_accepted = reference_rejection_sample(*args, ref_generators, batch["greedy"])
    assert torch.equal(fast_output, ref_output) and torch.equal(fast_accepted, ref_accepted)
    for fast_g, ref_g in zip(fast_generators[:3], ref_generators[:3]):
        assert torch.equal(
            torch.rand(3, dtype=torch.float64, generator=fast_g), torch.rand(3, dtype=torch.float64, generator=ref_g)
        )
