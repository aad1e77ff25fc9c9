"""Logits -> warped probabilities, and sampling with per-request generators.

The target's logits come here after the request's logits processors (spec/processors.py: penalties,
logit_bias, min_tokens). Warping, in this order (the order of transformers' logits warpers):
  1. temperature: logits / T (T = 0 means greedy: the result is a point mass on the argmax)
  2. top_k: keep the tokens at least as likely as the k-th most likely (ties at the boundary
     are kept)
  3. top_p: keep the most likely tokens, in order, while the mass before each is < top_p
  4. min_p: drop tokens whose probability is < min_p * the largest probability
then renormalise. Softmax is always float32. The draft and the target are warped by the same
function with the same settings, so q and p are what the draft and the target really sample.

Sampling is inverse-CDF in float64 with one uniform per draw from the row's generator: a
seeded request has its own, so it draws the same numbers whatever else is in the batch
(and, in float32, gets the same tokens; see SamplingParams.seed for half precision);
requests without a seed share one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec.config import SamplingParams
from specdec.outputs import TokenLogprob


@dataclass(frozen=True)
class SamplingTensors:
    """The settings of a batch of rows as tensors, one entry per row."""

    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [N] long; 0 = no limit
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    greedy: torch.Tensor  # [N] bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_greedy: bool
    any_greedy: bool
    # the requests' logits processors (processors.LogitsProcessors), which a drafter that samples
    # from logits applies to its own (steps.py); None: none
    processors: Any = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        greedy = [p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]
        return cls(
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            any_top_k=any(p.top_k > 0 for p in sampled),
            any_top_p=any(p.top_p < 1 for p in sampled),
            any_min_p=any(p.min_p > 0 for p in sampled),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
        )

    def select_rows(self, rows: torch.Tensor) -> SamplingTensors:
        """The settings of some rows (the batch-wide flags kept: they only enable checks)."""
        return self._map_rows(lambda t: t[rows])

    def repeat_rows(self, n: int) -> SamplingTensors:
        """Each row's settings repeated n times in place: [N] -> [N * n], for [N, n, V] logits."""
        return self._map_rows(lambda t: t.repeat_interleave(n))

    def _map_rows(self, f) -> SamplingTensors:
        """f applied to every per-row tensor; the batch-wide flags unchanged."""
        return dataclasses.replace(self, **{name: f(getattr(self, name)) for name in PER_ROW_FIELDS})


PER_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "greedy")


CANDIDATES = 1024  # the tokens sorted first for top_k / top_p (_keep_top_k_top_p)
NUCLEUS_SHARE = 1e-4  # top_p alone sorts first the tokens at least this share of the likeliest ...
NUCLEUS_MARGIN = 1e-6  # ... where they hold top_p + this of the mass (float32 rounding: ~1e-7)


def warp(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """logits [N, V] -> warped probs [N, V] (float32, rows sum to 1)."""
    logits = logits.float()
    if settings.all_greedy:
        return point_mass(logits.argmax(-1), logits.shape[-1])
    probs = torch.softmax(logits / settings.temperature[:, None], dim=-1)  # [N, V]
    if settings.any_top_k or settings.any_top_p:
        probs = _keep_top_k_top_p(probs, settings)
    if settings.any_min_p:
        threshold = settings.min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [N, 1]
        probs = torch.where(probs < threshold, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if settings.any_greedy:
        probs = torch.where(settings.greedy[:, None], point_mass(logits.argmax(-1), logits.shape[-1]), probs)
    return probs


def _keep_top_k_top_p(probs: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """probs [N, V] with the tokens top_k and top_p drop set to 0, renormalised.

    What they keep is a prefix of each row's descending order, usually a short one: so the
    CANDIDATES most likely tokens are sorted first, and the whole row only where some row's
    prefix reaches the last of them (a flat distribution, a top_k above CANDIDATES). Both give
    the same prefix, hence the same output bit for bit (tests/spec/test_distribution.py)."""
    V = probs.shape[-1]
    if V > CANDIDATES and not settings.any_top_k and probs.device.type == "cpu":  # CPU: cumsum sums in order
        nucleus = _nucleus_above_threshold(probs, settings)
        if nucleus is not None:
            return nucleus
    if V > CANDIDATES and not (settings.any_top_k and bool((settings.top_k > CANDIDATES).any())):
        values, ids = sorted_descending(probs, CANDIDATES)  # [N, CANDIDATES] each
        keep = _kept_prefix(values, settings)  # [N, CANDIDATES]
        if not bool(keep[:, -1].any()):  # every row's prefix ends among the candidates
            return _renormalised(torch.zeros_like(probs).scatter_(1, ids, values * keep))
    values, ids = sorted_descending(probs)  # [N, V] each
    return _renormalised(torch.zeros_like(probs).scatter_(1, ids, values * _kept_prefix(values, settings)))


def _nucleus_above_threshold(probs: torch.Tensor, settings: SamplingTensors) -> torch.Tensor | None:
    """top_p alone (no top_k), from the candidates: the tokens at least NUCLEUS_SHARE of each
    row's likeliest. Where they hold at least top_p of the row's mass, every token top_p keeps is
    among them (it keeps a prefix of the descending order, and every other token comes after
    them all, its mass before >= top_p), so sorting them alone gives the same prefix, hence the
    same output bit for bit, as sorting the row: the mass before is summed in the same order (on
    the CPU, cumsum accumulates sequentially), and NUCLEUS_MARGIN covers the float32 rounding of
    the first token after them. A peaked row has a few hundred candidates, found by a compare
    and a gather (sorted_descending's partial selection of the CANDIDATES likeliest costs ~1 ms a
    row of 151,936 tokens). None where some row's nucleus may reach past them (a flat row): the
    caller sorts more. Rows without top_p (1) keep every token."""
    cut = settings.top_p < 1  # [N]
    candidate = probs >= probs.amax(-1, keepdim=True) * NUCLEUS_SHARE  # [N, V]
    rows, ids = candidate.nonzero(as_tuple=True)  # [M] each: row by row, ids ascending
    counts = torch.bincount(rows, minlength=len(probs))  # [N]
    column = torch.arange(len(rows), device=probs.device) - (counts.cumsum(0) - counts)[rows]  # [M]: place in its row
    width = int(counts.max())
    candidate_probs = probs.new_zeros(len(probs), width).index_put_((rows, column), probs[rows, ids])  # [N, C]
    candidate_ids = ids.new_zeros(len(probs), width).index_put_((rows, column), ids)  # [N, C]
    values, order = sorted_descending(candidate_probs)  # [N, C]: each row's candidates, then its padding (0)
    held = values.cumsum(-1)[:, -1]  # [N]: the candidates' mass, summed as _kept_prefix sums it
    if not bool((held >= settings.top_p + NUCLEUS_MARGIN)[cut].all()):
        return None
    kept = values * _kept_prefix(values, settings)  # [N, C]
    nucleus = torch.zeros_like(probs).scatter_add_(1, candidate_ids.gather(1, order), kept)  # padding adds 0
    return _renormalised(nucleus if bool(cut.all()) else torch.where(cut[:, None], nucleus, probs))


def _renormalised(kept: torch.Tensor) -> torch.Tensor:
    return kept / kept.sum(-1, keepdim=True)


def _kept_prefix(values: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """Which tokens top_k and top_p keep: values [N, V], each row's probabilities in
    descending order -> keep [N, V] bool, a prefix of each row.

    top_k keeps the tokens at least as likely as the k-th (ties at the boundary kept); top_p
    then keeps tokens, in order, while the mass before each is < top_p of what top_k kept."""
    keep, kept_values = None, values
    if settings.any_top_k:
        limited = settings.top_k > 0  # [N]
        k = torch.where(limited, settings.top_k, values.shape[-1]).clamp(max=values.shape[-1])  # [N]
        keep = values >= values.gather(1, (k - 1)[:, None])  # [N, V]: at least the k-th largest
        kept_values = values * keep
    if settings.any_top_p:
        cumulative = kept_values.cumsum(-1)  # [N, V]
        top_p = torch.where(settings.top_p < 1, settings.top_p, float("inf"))[:, None]  # [N, 1]: 1 drops nothing
        if settings.any_top_k:
            top_p = top_p * torch.where(limited[:, None], cumulative[:, -1:], 1.0)  # a fraction of top_k's mass
        within = cumulative - kept_values < top_p  # [N, V]: the mass before each token
        within[:, 0] = True  # the most likely always: a top_p too small for float32 rounds to 0
        keep = within if keep is None else keep & within
    assert keep is not None  # the caller asks only where top_k or top_p is set
    return keep


def sorted_descending(probs: torch.Tensor, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [N, V] (>= 0) sorted in descending order, ties in token-id order: values and
    token ids [N, V], exactly as a stable sort gives them; with limit, only the first limit
    columns of that order [N, limit] (a partial selection, torch.topk of the unique keys below:
    on the CPU a 151,936-token row's full sort costs ~3 ms, its first 1,024 ~0.3 ms).

    On the CPU, PyTorch's sort (which always also sorts indices) and numpy's argsort are many
    times slower than numpy's sort of plain int64 keys (docs/runner.md, "Sampling on the CPU").
    So each probability and its id are packed into one key:
    non-negative float32s order like their bit patterns, and the id goes in the low bits,
    reversed so that among equal probabilities the smaller id sorts first."""
    if probs.device.type != "cpu":
        values, ids = probs.sort(dim=-1, descending=True, stable=True)
        return (values, ids) if limit is None else (values[:, :limit], ids[:, :limit])
    V = probs.shape[-1]
    id_bits = max(V - 1, 1).bit_length()
    reversed_ids = torch.arange(V - 1, -1, -1)  # [V]
    keys = (probs.float().contiguous().view(torch.int32).long() << id_bits) | reversed_ids  # [N, V]
    if limit is not None and limit < V:  # unique keys: the largest limit of them are the order's first
        keys = keys.topk(limit, dim=-1, sorted=True).values  # [N, limit], descending
    else:
        keys = -torch.from_numpy(np.sort((-keys).numpy(), axis=-1))  # [N, V], descending
    values = (keys >> id_bits).int().view(torch.float32)
    return values, (V - 1) - (keys & ((1 << id_bits) - 1))


def point_mass(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids [N] -> one-hot float32 distributions [N, V]."""
    return torch.nn.functional.one_hot(token_ids, vocab_size).float()


def request_generator(seed: int | None, shared: torch.Generator, device: torch.device | str) -> torch.Generator:
    """A request's random stream: its own, seeded, when it gives a seed (so that its numbers do not
    depend on what else is batched), else the stream requests without a seed share."""
    return shared if seed is None else torch.Generator(device).manual_seed(seed)


def uniforms(generators: list[torch.Generator], counts: int | list[int], device: torch.device | str) -> torch.Tensor:
    """counts[i] float64 uniforms in [0, 1) for row i from that row's generator (or n for
    every row): [len(generators), max(counts)], zero past a row's count.

    Rows that share one generator object (requests without a seed of their own) draw
    together in one call, in row order; a seeded request's own generator serves its row
    alone, so its numbers do not depend on the rest of the batch."""
    counts = [counts] * len(generators) if isinstance(counts, int) else list(counts)
    width = max(counts, default=0)
    out = torch.zeros(len(generators), width, dtype=torch.float64, device=device)
    if width == 0:
        return out
    rows_by_generator: dict[int, list[int]] = {}
    for row, g in enumerate(generators):
        rows_by_generator.setdefault(id(g), []).append(row)
    for rows in rows_by_generator.values():
        row_counts = [counts[row] for row in rows]
        drawn = torch.rand(sum(row_counts), generator=generators[rows[0]], dtype=torch.float64, device=device)
        if len(rows) == 1:
            out[rows[0], : row_counts[0]] = drawn
            continue
        block = torch.zeros(len(rows), width, dtype=torch.float64, device=device)  # [R, width]
        block[torch.arange(width, device=device)[None, :] < torch.tensor(row_counts, device=device)[:, None]] = drawn
        out[torch.tensor(rows, device=device)] = block
    return out


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not sum to 1), u [N] float64 -> token ids [N].
    Picks the first token whose cumulative mass exceeds u * total, so a token of
    probability 0 is never picked, even for u = 0; u * total is kept below the total, which
    rounding could otherwise reach (the pick is then the token where the sum reaches its total)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    target = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))  # [N, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [N]


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [N, V], each drawn with its row's generator."""
    return sample_with_uniforms(probs, uniforms(generators, 1, probs.device)[:, 0])


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """Each row's token's log-probability under log_softmax(logits) (logits [N, V], token_ids
    [N]), with the num_top most likely tokens' (ids and log-probabilities, most likely first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logprobs.gather(1, token_ids[:, None].to(logprobs.device))  # [N, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # [N]
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprob(token, value, tuple(zip(ids, values)), rank)
        for token, value, ids, values, rank in zip(
            token_ids.tolist(), chosen[:, 0].tolist(), top_ids.tolist(), top_values.tolist(), ranks
        )
    ]
