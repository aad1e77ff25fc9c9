"""DraftSteps: the tokens a model-based drafter draws for a batch, one step at a time.

Both the draft model and the EAGLE head draft the same way once they have next-token logits:
a greedy batch takes the argmax (a point mass: no probabilities kept), otherwise each row
samples from its warped distribution with its own generator: the request's warping (top-k,
top-p, min-p) at its temperature times the drafter's temperature_scale. A scale below 1 sharpens
the draft: for a drafter less sure than the target where both agree (a small head trained on the
target's soft labels), that raises sum_x min(p(x), q(x)), the chance the target accepts a sampled
draft (verify.py); whatever q is, the draft's probabilities kept are the ones it was sampled
from, so the output stays exactly the target's.

A row stops at its own k (the engine's, cut to what it can still emit) and, with a confidence
threshold, after a token the drafter itself gave less than that probability (the next ones would
likely be rejected). A stopped row draws no more random numbers (its later columns hold the
argmax, ignored), so a seeded request consumes its generator the same alone or in any batch.

A drafter that scores only part of the vocabulary (an EAGLE head's output_token_ids) hands over
its S scores, not V logits: warping and sampling then run over S tokens (a softmax and top-p over
151,936 tokens cost ~2.6 ms a step, over 32,768 ~0.7 ms), and only the draft's probabilities
are spread over the whole vocabulary at the end, 0 for the tokens it does not score, as the
verifier reads them: the same distribution the -inf logits of those tokens would give.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from specdec.drafters.base import Draft
from specdec.sampling import SamplingTensors, sample, warp
from specdec.sequence import Sequence


class DraftSteps:
    def __init__(
        self,
        batch: list[Sequence],
        ks: list[int],
        sampling: SamplingTensors,
        confidence_threshold: float,
        device: torch.device,
        temperature_scale: float = 1.0,
        scored_ids: torch.Tensor | None = None,
        vocab_size: int = 0,
    ):
        """scored_ids: the vocabulary ids [S] (ascending) that draw()'s scores are of, in a
        vocabulary of vocab_size; None: draw() gets logits over the whole vocabulary."""
        self.k, self.confidence_threshold = max(ks), confidence_threshold
        self.scored_ids, self.vocab_size = scored_ids, vocab_size
        if temperature_scale != 1.0 and not sampling.all_greedy:  # greedy rows' temperature is unused
            sampling = dataclasses.replace(sampling, temperature=sampling.temperature * temperature_scale)
        self.sampling, self.batch = sampling, batch
        self.generators = [seq.generator for seq in batch]
        self.num_tokens = torch.tensor(ks, device=device)  # [B]: each row's most
        self.drafting = self.num_tokens > 0  # [B]: rows not yet stopped
        self.tokens: list[torch.Tensor] = []  # per step [B]
        self.probs: list[torch.Tensor] = []  # per step [B, S] (sampled batches only; S = V without scored_ids)

    @property
    def more(self) -> bool:
        """Whether another step is wanted: some row drafts on, and k is not reached."""
        return len(self.tokens) < self.k and bool(self.drafting.any())

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row [B] (vocabulary ids) from the drafter's logits [B, V] (its
        scores [B, S] with scored_ids)."""
        step = len(self.tokens)
        probs = None
        if self.sampling.processors is not None:  # the requests' processors, as the target's logits get them
            drafted = self.token_ids() if self.tokens else None
            logits = self.sampling.processors.for_draft(logits, self.batch, drafted, self.scored_ids, self.vocab_size)
        if self.sampling.all_greedy:
            index = logits.argmax(-1)  # [B]
        else:
            probs = warp(logits, self.sampling)  # [B, S]
            index = _sample_rows(probs, self.generators, self.drafting)  # [B]
            self.probs.append(probs)
        token = index if self.scored_ids is None else self.scored_ids[index]  # [B]
        self.tokens.append(token)
        if self.confidence_threshold > 0:
            confidence = _confidence(logits, index, probs, self.sampling.greedy)  # [B]
            stopping = self.drafting & (confidence < self.confidence_threshold)
            self.num_tokens = torch.where(stopping, step + 1, self.num_tokens)
            self.drafting &= ~stopping
        self.drafting &= self.num_tokens > step + 1
        return token

    def token_ids(self) -> torch.Tensor:
        """The tokens drawn so far [B, steps]."""
        return torch.stack(self.tokens, dim=1)

    def draft(self) -> Draft:
        """What was drawn, padded to k columns."""
        token_ids = self.token_ids()  # [B, steps], steps <= k
        padding = self.k - token_ids.shape[1]
        token_ids = F.pad(token_ids, (0, padding))  # [B, k]
        probs = F.pad(torch.stack(self.probs, dim=1), (0, 0, 0, padding)) if self.probs else None  # [B, k, S]
        if probs is not None and self.scored_ids is not None:
            every_token = probs.new_zeros(*probs.shape[:2], self.vocab_size)  # [B, k, V]
            probs = every_token.index_copy_(2, self.scored_ids, probs)
        return Draft(token_ids, self.num_tokens, probs)


def _confidence(
    logits: torch.Tensor, index: torch.Tensor, probs: torch.Tensor | None, greedy: torch.Tensor
) -> torch.Tensor:
    """The drafter's probability of each row's drawn token [B] (index: its column of logits
    [B, S]): under the warped distribution it was sampled from, or, for a greedy row [B] (whose
    warped distribution is a point mass, certain by construction), under the plain softmax,
    whatever else is in the batch."""
    plain = torch.softmax(logits.float(), dim=-1).gather(1, index[:, None])[:, 0]  # [B]
    if probs is None:  # an all-greedy batch
        return plain
    return torch.where(greedy, plain, probs.gather(1, index[:, None])[:, 0])


def _sample_rows(probs: torch.Tensor, generators: list[torch.Generator], rows: torch.Tensor) -> torch.Tensor:
    """A token per row of probs [B, V]: sampled where rows [B] is True (each with its row's
    generator), the argmax elsewhere, drawing nothing there."""
    if bool(rows.all()):
        return sample(probs, generators)
    token = probs.argmax(-1)  # [B]
    chosen = rows.nonzero().squeeze(1).tolist()
    if chosen:
        token[chosen] = sample(probs[chosen], [generators[r] for r in chosen])
    return token
