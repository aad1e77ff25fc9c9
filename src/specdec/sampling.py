"""Logits -> warped probabilities, and sampling with per-request generators.

Warping, in this order (the order of transformers' logits warpers):
  1. temperature: logits / T (T = 0 means greedy: the result is a point mass on the argmax)
  2. top_k: keep tokens whose logit is >= the k-th largest (ties at the boundary are kept)
  3. top_p: keep the most likely tokens, in order, while the mass before each is < top_p
  4. min_p: drop tokens whose probability is < min_p * the largest probability
then renormalise. Softmax is always float32. The draft and the target are warped by the same
function with the same settings, so q and p are what the draft and the target really sample.

Sampling is inverse-CDF in float64 with one uniform per draw from the row's generator: a
seeded request has its own, so it draws the same numbers whatever else is in the batch;
requests without a seed share one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams


CANDIDATES = 64  # the most likely tokens a top-k / top-p cut is first looked for among


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

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
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

    def select_rows(self, rows: torch.Tensor) -> "SamplingTensors":
        """The settings of some rows (the batch-wide flags kept: they only enable checks)."""
        return self._map_rows(lambda t: t[rows])

    def repeat_rows(self, n: int) -> "SamplingTensors":
        """Each row's settings repeated n times in place: [N] -> [N * n], for [N, n, V] logits."""
        return self._map_rows(lambda t: t.repeat_interleave(n))

    def _map_rows(self, f) -> "SamplingTensors":
        """f applied to every per-row tensor; the batch-wide flags unchanged."""
        return dataclasses.replace(self, **{name: f(getattr(self, name)) for name in PER_ROW_FIELDS})


PER_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "greedy")


def warp(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """logits [N, V] -> warped probs [N, V] (float32, rows sum to 1)."""
    logits = logits.float()
    if settings.all_greedy:
        return point_mass(logits.argmax(-1), logits.shape[-1])
    logits = logits / settings.temperature[:, None]
    if settings.any_top_k or settings.any_top_p:
        logits = _top_k_top_p(logits, settings)
    probs = torch.softmax(logits, dim=-1)
    if settings.any_min_p:
        threshold = settings.min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [N, 1]
        probs = torch.where(probs < threshold, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if settings.any_greedy:
        probs = torch.where(settings.greedy[:, None], point_mass(logits.argmax(-1), logits.shape[-1]), probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """Set to -inf the logits that top_k or top_p drop. logits [N, V].

    The kept tokens are usually a few of the most likely, so the cut is first looked for
    among the CANDIDATES largest logits (a partial selection, much cheaper than sorting the
    vocabulary); rows whose cut is not decided there are sorted in full."""
    if logits.shape[-1] <= 2 * CANDIDATES:
        return _cut_sorted(logits, settings)
    cut, decided = _cut_among_candidates(logits, settings)
    if not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)  # [R]
        cut[rows] = _cut_sorted(logits[rows], settings.select_rows(rows))
    return cut


def _cut_among_candidates(logits: torch.Tensor, settings: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut of _cut_sorted made from the top CANDIDATES logits only, and whether each row's
    cut is decided by them: [N, V] logits (-inf where dropped), [N] bool.

    A row is decided when its kept tokens end before the last candidate with a strictly larger
    logit (so no token outside the candidates ties with, or precedes, a kept one) and top_p's
    probabilities are computable: without top_k they are over the whole vocabulary, with
    top_k <= CANDIDATES over the candidates it keeps."""
    V = logits.shape[-1]
    values, ids = logits.topk(CANDIDATES, dim=-1)  # [N, C], descending; the order among ties is unspecified
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)  # [N, C] in token-id order
    values, order = values.sort(dim=-1, descending=True, stable=True)  # _cut_sorted's order: logit, then id
    ids = ids.gather(1, order)  # [N, C]
    k = torch.where(settings.top_k > 0, settings.top_k.clamp(max=V), V)  # [N]
    kth_largest = values.gather(1, (k.clamp(max=CANDIDATES) - 1)[:, None])  # [N, 1]
    k_within = (k <= CANDIDATES) & (kth_largest[:, 0] > values[:, -1])  # [N]: top_k's tokens are all candidates
    drop = torch.zeros_like(values, dtype=torch.bool)  # [N, C]
    if settings.any_top_k:
        drop = k_within[:, None] & (values < kth_largest)
    if settings.any_top_p:
        row_max = values[:, :1]  # [N, 1]
        exp_values = torch.exp(values - row_max).masked_fill(drop, 0.0)  # [N, C]
        full_total = torch.exp(logits - row_max).sum(-1, keepdim=True)  # [N, 1]
        total = torch.where(k_within[:, None], exp_values.sum(-1, keepdim=True), full_total)
        probs = exp_values / total  # [N, C]
        drop = drop | _top_p_drops(probs, settings.top_p)
    num_kept = (~drop).sum(-1)  # [N]; kept tokens come first
    last_kept = values.gather(1, (num_kept - 1)[:, None])[:, 0]  # [N]
    decided = (num_kept < CANDIDATES) & (last_kept > values[:, -1]) & (k_within | (k == V))
    cut = torch.full_like(logits, float("-inf")).scatter_(1, ids, values.masked_fill(drop, float("-inf")))
    return cut, decided


def _cut_sorted(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """_top_k_top_p by a full (stable) sort of every row. logits [N, V]."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    if settings.any_top_k:
        k = torch.where(settings.top_k > 0, settings.top_k.clamp(max=V), V)  # [N]
        kth_largest = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if settings.any_top_p:
        sorted_logits = sorted_logits.masked_fill(_top_p_drops(torch.softmax(sorted_logits, dim=-1), settings.top_p),
                                                  float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_drops(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top_p drops: those whose mass before them, in descending order, is >= top_p.
    sorted_probs [N, C] (descending), top_p [N] -> [N, C] bool. The most likely token always
    stays, and top_p = 1 drops nothing (float32 sums can reach 1 before the tail ends)."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [N, C]
    drop = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    return drop


def point_mass(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids [N] -> one-hot float32 distributions [N, V]."""
    return torch.nn.functional.one_hot(token_ids, vocab_size).float()


def uniforms(generators: list[torch.Generator], n: int, device: torch.device | str) -> torch.Tensor:
    """n float64 uniforms in [0, 1) per row from that row's generator: [len(generators), n].

    Rows that share one generator object (requests without a seed of their own) draw
    together in one call, in row order; a seeded request's own generator serves its row
    alone, so its numbers do not depend on the rest of the batch."""
    out = torch.empty(len(generators), n, dtype=torch.float64, device=device)
    if n == 0:
        return out
    rows_by_generator: dict[int, list[int]] = {}
    for row, g in enumerate(generators):
        rows_by_generator.setdefault(id(g), []).append(row)
    for rows in rows_by_generator.values():
        drawn = torch.rand(len(rows), n, generator=generators[rows[0]], dtype=torch.float64, device=device)
        if len(rows) == 1:
            out[rows[0]] = drawn[0]
        else:
            out[torch.tensor(rows, device=device)] = drawn
    return out


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not sum to 1), u [N] float64 -> token ids [N].
    Picks the first token whose cumulative mass exceeds u * total, so a token of
    probability 0 is never picked, even for u = 0."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = (u * cdf[:, -1])[:, None]  # [N, 1]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [N]
    last_nonzero = (probs > 0).long().cumsum(-1).argmax(-1)  # rounding could push past the end
    return torch.minimum(token, last_nonzero)


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [N, V], each drawn with its row's generator."""
    return sample_with_uniforms(probs, uniforms(generators, 1, probs.device)[:, 0])
