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

from dataclasses import dataclass

import torch

from specdec.config import SamplingParams


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

    def repeat_rows(self, n: int) -> "SamplingTensors":
        """Each row's settings repeated n times in place: [N] -> [N * n], for [N, n, V] logits."""
        rep = lambda t: t.repeat_interleave(n)  # noqa: E731
        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p),
                               rep(self.greedy), self.any_top_k, self.any_top_p, self.any_min_p,
                               self.all_greedy, self.any_greedy)


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
    """Set to -inf the logits that top_k or top_p drop. logits [N, V]."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    if settings.any_top_k:
        k = torch.where(settings.top_k > 0, settings.top_k.clamp(max=V), V)  # [N]
        kth_largest = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if settings.any_top_p:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [N, V]
        drop = mass_before >= settings.top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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
