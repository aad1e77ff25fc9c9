"""Staged drafts (Spector & Ré 2023, "Accelerating LLM Inference with Staged Speculative
Decoding"): the draft model that proposes to the target draws its own tokens by speculative
decoding, with a cheaper drafter drafting for it: prompt lookup, a smaller model, or stages of
their own (prompt lookup -> a 0.5B draft -> the 1.5B target). The first stage may be a model of
another tokenizer (SmolLM2-135M -> the 0.5B -> the 1.5B): it drafts through text for the stage
after it (drafters/cross_tokenizer.py), whose tokens are the target's; a stage drafted for is
handed tokens in its own vocabulary, so every later model stage shares the target's.

Terms, for one stage:
  model         the stage's draft model: it proposes to the model above it (the target, or
                the next stage)
  inner         the drafter that drafts for the model (the stages before it)
  view          a row's sequence followed by the tokens drawn for it so far this round: what
                the inner drafter drafts after
  inner round   the inner drafter proposes up to k' tokens after each row's view; one forward
                of the model over [the view's tokens its cache lacks, the k' drafts] gives the
                model's distribution at the view's last token and after each draft; rejection
                sampling (verify.py) keeps a prefix of the drafts and adds one token (recovered
                or bonus), as the engine's round does with the target
Inner rounds repeat over the rows that still need tokens until every row holds the k the engine
asked of it; no inner round drafts past that (k' is at most the tokens a row still needs, less
the one its round adds).

Exactness. The inner rejection sampler draws each row's tokens exactly as the model's own
sampling would, one after another (each from the model's warped distribution given the view
before it). The Draft carries those distributions, the inner verify's target probabilities at
each token (probs [B, k, V]), which is what the target's rejection sampler needs: to the target,
a staged drafter is its model sampled k times. Greedy rows: the inner verify matches prefixes
against the model's argmax, so the draft is the model's greedy chain, and the target's verify
keeps the output the target's either way.

Each inner round's k' per row: by goodput (goodput.py's policy, with the model as its target:
the model's measured forward costs, the inner drafter's step cost, each sequence's inner
acceptance rate), or, with k_policy "fixed" or a seeded sampled request in the batch (whose
tokens must not depend on timings), the most the row can use: the tokens it still needs, less
one.

A draft model's cache remembers what it was fed as (n, drafts): the first n tokens of the
sequence it drafted for, then drafts (draft_model.py). An inner draft model drafts for views,
whose tokens past the sequence the target may yet reject, so after each inner proposal its
records are rebased onto the sequence: (n, drafts) with n past the sequence's length L becomes
(L, the view's tokens from L to n, then drafts), and the next round compares them with what the
target kept.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch

from specdec.config import NGRAM_STAGE, SpeculativeConfig
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.cross_tokenizer import draft_model_drafter
from specdec.drafters.draft_model import (
    CATCH_UP_WIDTH,
    DraftModelDrafter,
    check_same_vocabulary,
    has_other_tokenizer,
    load_draft,
)
from specdec.drafters.ngram import NgramDrafter
from specdec.kv_cache import BlockPool
from specdec.metrics import SpecStats
from specdec.models.eagle import is_head_directory
from specdec.models.loader import LoadedModel, ModelLoadError
from specdec.models.registry import resolve_model
from specdec.sampling import SamplingTensors, warp
from specdec.sequence import Sequence
from specdec.spec.goodput import GoodputPolicy
from specdec.spec.verify import greedy_verify, rejection_sample
from specdec.worker import ForwardBatch, ModelRunner

CALIBRATION_CONTEXT = 128  # the positions the model's forwards are timed at, as the engine's (capacity.py)


@dataclasses.dataclass
class InnerRound:
    """What one inner round gives its rows (R of them).

    tokens [R, k'+1]          each row's accepted drafts, then the recovered or bonus token (-1 after)
    num_tokens [R]            how many of them: accepted + 1
    probs [R, k'+1, V] | None the model's warped distribution at each of them (None: all greedy)
    """

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None


class StagedDrafter(DraftModelDrafter):
    """A draft model (its runner, as DraftModelDrafter's) whose tokens are drawn by inner rounds
    with inner drafting for it (see the module's docstring). k_max: the engine's k, the most any
    row asks for; k_policy: the engine's, "goodput" or "fixed", for each inner round's k'.
    stages: the stages' names (as given), first to this one's model, for what reports them."""

    grows_trees = False  # its tokens come from inner rounds of chains
    propose_tree = Drafter.propose_tree  # which says so

    def __init__(
        self,
        model: DraftModelDrafter,
        inner: Drafter,
        k_max: int,
        k_policy: str = "goodput",
        stages: tuple[str, ...] = ("inner", "model"),
    ):
        super().__init__(model.runner, model.vocab_size)
        self.inner, self.k_max, self.k_policy, self.stages = inner, k_max, k_policy, stages
        self.policy = GoodputPolicy(k_max, self.runner.cost_width)  # inner k' by goodput
        self.started: set[int] = set()  # the slots whose sequence the policy estimates
        self.stats = SpecStats()  # every row's inner rounds since reserve, merged: the inner α and τ

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target: LoadedModel, target_runner: ModelRunner) -> StagedDrafter:
        """spec.model's stages, first to last (SpeculativeConfig has checked their spelling): "[ngram]"
        is prompt lookup with spec's n-gram lengths, any other stage a draft model loaded as
        DraftModelDrafter loads one (the first may have another tokenizer: a
        CrossTokenizerDrafter); each drafts for the next, the last for the target."""
        stages = spec.model
        assert isinstance(stages, tuple) and len(stages) >= 2  # SpeculativeConfig's rule for "staged"
        _check_stage_paths(stages, target)
        drafter: Drafter | None = None
        sizes = []  # (stage, parameters) of each model stage
        for number, stage in enumerate(stages, start=1):
            if stage == NGRAM_STAGE:
                drafter = NgramDrafter.from_config(spec, target, target_runner)
                continue
            model_spec = dataclasses.replace(spec, method="draft_model", model=stage)
            if drafter is None:  # the first stage: a draft model, or one with another tokenizer
                drafter = draft_model_drafter(model_spec, target, target_runner)
                sizes.append((stage, drafter.model.config.num_parameters))
                continue
            model = _same_tokenizer_stage(model_spec, target, target_runner, number)
            sizes.append((stage, model.model.config.num_parameters))
            drafter = cls(model, drafter, spec.num_speculative_tokens, spec.k_policy, stages[:number])
        _check_stage_sizes(sizes, (str(target.path), target.model.config.num_parameters))
        assert isinstance(drafter, StagedDrafter)  # at least two stages, the last a model
        return drafter

    # --- the engine's calls ------------------------------------------------------------------

    def compiles(self, max_batch: int, max_len: int, num_forwards: int) -> bool:
        query_lengths = (1, CATCH_UP_WIDTH, self.k_max + 1)
        return self.runner.compiles(max_batch, max_len, query_lengths, num_forwards) or self.inner.compiles(
            max_batch, max_len, num_forwards
        )

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        """The model's cache, for forwards of a catch-up and up to k_max - 1 drafts a row, and the
        inner drafter's; with goodput, the model's forward costs and the inner drafter's step
        timed at max_batch rows (other batch sizes start from them: goodput.py). Both in the
        pool, as a draft model's (an inner round writes no further than the round's k drafts:
        row i's k' is at most its need less one)."""
        self.runner.prepare(max_batch, max_len, (1, CATCH_UP_WIDTH, self.k_max + 1), num_forwards, pool=pool)
        self.shares_pool = self.runner.reads_pool(pool)
        self.inner.reserve(max_batch, max_len, num_forwards, pool)
        if self.k_policy == "goodput" and self.k_max > 1:
            self.policy.calibrate(
                max_batch,
                self.k_max - 1,
                functools.partial(self._time_forward, max_batch),
                functools.partial(self.inner.time_step, max_batch),
            )
        self.fed.clear()  # calibration wrote into slots 0..max_batch-1
        self.started.clear()
        self.stats = SpecStats()  # the work ahead's

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.inner.release(seq)
        self.started.discard(seq.slot)

    def position_bytes(self) -> int:
        return self.model.position_bytes + self.inner.position_bytes()

    def cached_entries(self, seq: Sequence) -> int | None:
        """The positions both the model's cache and the inner drafter's hold."""
        inner = self.inner.cached_entries(seq)
        own = super().cached_entries(seq)
        return own if inner is None or own is None else min(own, inner)

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        """ks[i] tokens for row i, drawn as the model's own sampling draws them, by inner rounds
        over the rows that still need tokens; their distributions in the Draft (None: all greedy)."""
        device = self.model.device
        K = max(ks, default=0)
        token_ids = torch.zeros(len(batch), K, dtype=torch.long, device=device)  # [B, K]
        probs = None if sampling.all_greedy else torch.zeros(len(batch), K, self.vocab_size, device=device)
        drawn = [0] * len(batch)  # tokens drawn so far per row
        while rows := [row for row, k in enumerate(ks) if drawn[row] < k]:
            index = torch.tensor(rows, device=device)  # [R]
            seqs = [batch[row] for row in rows]
            views = [_view(seq, token_ids[row, : drawn[row]].tolist()) for seq, row in zip(seqs, rows)]
            needs = [ks[row] - drawn[row] for row in rows]
            inner = self._inner_round(seqs, views, needs, sampling.select_rows(index))
            _place(inner, index, [drawn[row] for row in rows], token_ids, probs)
            for row, n in zip(rows, inner.num_tokens.tolist()):
                drawn[row] += n
        return Draft(token_ids, torch.tensor(ks, device=device), probs)

    # --- an inner round ------------------------------------------------------------------------

    def _inner_round(
        self, seqs: list[Sequence], views: list[Sequence], needs: list[int], sampling: SamplingTensors
    ) -> InnerRound:
        """Inner drafting for each view, one forward of the model over it, rejection sampling:
        rows' tokens (see the module's docstring). needs[i]: the tokens row i still needs."""
        inner_ks, by_goodput = self._inner_ks(views, needs)
        t0 = time.perf_counter()
        draft, all_rows_drafted = self._inner_draft(seqs, views, inner_ks, sampling)
        num_draft = torch.minimum(draft.num_tokens, torch.tensor(inner_ks, device=draft.num_tokens.device))  # [R]
        draft = draft.narrowed(int(num_draft.max()))  # [R, k']
        t1 = time.perf_counter()
        logits, width, num_fed = self._model_logits(seqs, views, draft.token_ids, num_draft)  # [R, k'+1, V]
        tokens, num_accepted, probs = self._verify(views, draft, num_draft, logits, sampling)
        t2 = time.perf_counter()
        self.inner.observe(views, num_accepted)
        self._record_fed(seqs, views, draft.token_ids, num_draft)
        proposed, accepted = num_draft.tolist(), num_accepted.tolist()
        for row in range(len(views)):
            self.stats.record_round(proposed[row], accepted[row], accepted[row] + 1, k=inner_ks[row])
        if by_goodput:
            self.policy.observe([view.slot for view in views], proposed, accepted)
            draft_seconds = t1 - t0 if all_rows_drafted else None
            self.policy.observe_round(len(views), max(inner_ks), width, t2 - t1, draft_seconds, num_fed)
        return InnerRound(tokens, num_accepted + 1, probs)

    def _inner_ks(self, views: list[Sequence], needs: list[int]) -> tuple[list[int], bool]:
        """Each row's k' (at most its need less one) and whether the goodput policy chose them:
        it does unless k_policy is "fixed", a seeded sampled row is in the batch, or no row has
        room for a draft."""
        rooms = [min(self.k_max, need - 1) for need in needs]
        seeded = any(view.params.seed is not None and not view.params.greedy for view in views)
        if self.k_policy == "fixed" or seeded or max(rooms) == 0:
            return rooms, False
        for view in views:
            if view.slot not in self.started:
                self.policy.start(view.slot)
                self.started.add(view.slot)
        return self.policy.choose([view.slot for view in views], rooms), True

    def _inner_draft(
        self, seqs: list[Sequence], views: list[Sequence], inner_ks: list[int], sampling: SamplingTensors
    ) -> tuple[Draft, bool]:
        """The inner drafter's draft for the rows with k' > 0 (the rest propose nothing), its
        draft models' records then rebased onto the sequences; and whether every row drafted."""
        device = self.model.device
        rows = [row for row, k in enumerate(inner_ks) if k > 0]
        if not rows:
            return Draft.empty(len(views), device), False
        index = torch.tensor(rows, device=device)  # [R']
        drafted = self.inner.propose(
            [views[row] for row in rows], [inner_ks[row] for row in rows], sampling.select_rows(index)
        )
        for stage in _model_stages(self.inner):
            _rebase(stage, [seqs[row] for row in rows], [views[row] for row in rows])
        if len(rows) == len(views):
            return drafted, True
        return drafted.scattered(len(views), index), False

    def _model_logits(
        self, seqs: list[Sequence], views: list[Sequence], drafts: torch.Tensor, num_draft: torch.Tensor
    ) -> tuple[torch.Tensor, int, int]:
        """One forward of the model over each view's tokens its cache lacks and its drafts
        [R, k'] (num_draft [R] of them) -> its logits at the view's last token and after each
        draft [R, k'+1, V] (columns past a row's drafts hold its padding's: never read), the
        forward's width and its real tokens in all.
        A row that lacks more than CATCH_UP_WIDTH tokens (a new sequence, one back from plain
        rounds) is fed the rest first, alone with the other such rows (as draft_model.py does)."""
        catch_ups, starts = [], []
        for seq, view in zip(seqs, views):
            start = self._first_unfed(seq, view)
            catch_ups.append(view.token_ids[start:])
            starts.append(start)
        long_rows = [row for row, chunk in enumerate(catch_ups) if len(chunk) > CATCH_UP_WIDTH]
        if long_rows:
            heads = [catch_ups[row][:-CATCH_UP_WIDTH] for row in long_rows]
            self._feed([views[row] for row in long_rows], heads, [starts[row] for row in long_rows])
            for row, head in zip(long_rows, heads):
                catch_ups[row], starts[row] = catch_ups[row][len(head) :], starts[row] + len(head)
        draft_lists = drafts.tolist()
        chunks = [chunk + draft_lists[row][:n] for row, (chunk, n) in enumerate(zip(catch_ups, num_draft.tolist()))]
        forward, last_index = self.runner.ragged_batch(chunks, starts, [view.slot for view in views])
        forward = dataclasses.replace(forward, input_ids=self._in_draft_vocabulary(forward.input_ids))
        logits = self._logits(self.runner(forward))  # [R, W, V]
        R, W, V = logits.shape
        first = last_index.to(logits.device) - num_draft.to(logits.device)  # [R]: each view's last token's column
        columns = (first[:, None] + torch.arange(drafts.shape[1] + 1, device=logits.device)).clamp(max=W - 1)
        return logits.gather(1, columns[:, :, None].expand(R, -1, V)), W, sum(map(len, chunks))  # [R, k'+1, V]

    def _verify(
        self,
        views: list[Sequence],
        draft: Draft,
        num_draft: torch.Tensor,
        logits: torch.Tensor,
        sampling: SamplingTensors,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rejection sampling of the inner draft against the model (greedy: prefix matching) ->
        tokens [R, k'+1], num_accepted [R], the model's warped distributions [R, k'+1, V] (None
        when all greedy). The model's logits are processed as the target's are (the requests'
        penalties, biases, grammar: spec/processors.py), so that the stage drafts what the target
        may take."""
        if sampling.processors is not None:
            logits = sampling.processors.for_chain(logits, views, draft.token_ids)
        if sampling.all_greedy:
            return *greedy_verify(draft.token_ids, num_draft, logits.argmax(-1)), None
        R, T, V = logits.shape  # T = k' + 1
        probs = warp(logits.reshape(R * T, V), sampling.repeat_rows(T)).view(R, T, V)
        greedy = sampling.greedy if sampling.any_greedy else None
        generators = [view.generator for view in views]
        tokens, num_accepted = rejection_sample(draft.token_ids, num_draft, draft.probs, probs, generators, greedy)
        return tokens, num_accepted, probs

    # --- the model's cache -----------------------------------------------------------------------

    def _first_unfed(self, seq: Sequence, view: Sequence) -> int:
        """The first position of view the model's cache lacks (at most its last token's: its
        logits are needed). Its record (n, drafts) is on the sequence: n <= seq's length."""
        return min(self._num_fed(seq, view.token_ids), view.num_tokens - 1)

    def _record_fed(
        self, seqs: list[Sequence], views: list[Sequence], drafts: torch.Tensor, num_draft: torch.Tensor
    ) -> None:
        """After an inner round the model's cache holds each view whole, then the row's drafts:
        on the sequence of length L, its first L tokens and then the view's after them and the
        drafts."""
        for seq, view, row_drafts, n in zip(seqs, views, drafts.tolist(), num_draft.tolist()):
            self.fed[seq.slot] = (seq.num_tokens, view.token_ids[seq.num_tokens :] + row_drafts[:n])

    def _time_forward(self, batch_size: int, num_tokens: int) -> None:
        """A forward of the model over num_tokens tokens a row for batch_size rows, in slots
        0..batch_size-1 from position CALIBRATION_CONTEXT on (reserve forgets what they held)."""
        device = self.model.device
        start = max(0, min(CALIBRATION_CONTEXT, self.runner.max_len - num_tokens - 1))
        input_ids = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)  # [B, T]
        positions = start + torch.arange(num_tokens, device=device).expand(batch_size, num_tokens)  # [B, T]
        self.runner(ForwardBatch.of(input_ids, positions, range(batch_size)))


def _place(
    inner: InnerRound, rows: torch.Tensor, starts: list[int], token_ids: torch.Tensor, probs: torch.Tensor | None
) -> None:
    """An inner round's new tokens [R, k'+1] (and distributions) into the round's draft token_ids
    [B, K] (probs [B, K, V]): row i's into row rows[i], from column starts[i] on."""
    width = inner.tokens.shape[1]
    offsets = torch.arange(width, device=token_ids.device)  # [k'+1]
    columns = torch.tensor(starts, device=token_ids.device)[:, None] + offsets  # [R, k'+1]
    new = offsets[None, :] < inner.num_tokens[:, None]  # [R, k'+1]: the row's accepted and final tokens
    batch_rows = rows[:, None].expand_as(columns)  # [R, k'+1]
    token_ids[batch_rows[new], columns[new]] = inner.tokens[new]
    if probs is not None and inner.probs is not None:
        probs[batch_rows[new], columns[new]] = inner.probs[new]


def _view(seq: Sequence, drawn: list[int]) -> Sequence:
    """seq followed by the tokens drawn for it this round: the sequence the inner drafter drafts
    after (the same slot, settings and generator)."""
    return dataclasses.replace(seq, output_token_ids=seq.output_token_ids + drawn)


def _model_stages(drafter: Drafter) -> list[DraftModelDrafter]:
    """The draft models of a chain of stages, the last first (a StagedDrafter, then its inner's)."""
    stages = []
    while isinstance(drafter, DraftModelDrafter):
        stages.append(drafter)
        if not isinstance(drafter, StagedDrafter):
            break
        drafter = drafter.inner
    return stages


def _rebase(stage: DraftModelDrafter, seqs: list[Sequence], views: list[Sequence]) -> None:
    """stage's records, made on views, rebased onto their sequences (see the module's docstring)."""
    for seq, view in zip(seqs, views):
        n, drafts = stage.fed.get(seq.slot, (0, []))
        if n > seq.num_tokens:
            stage.fed[seq.slot] = (seq.num_tokens, view.token_ids[seq.num_tokens : n] + drafts)


def _same_tokenizer_stage(
    spec: SpeculativeConfig, target: LoadedModel, target_runner: ModelRunner, number: int
) -> DraftModelDrafter:
    """Stage number's draft model (spec.model), which other stages draft for: it must share the
    target's tokenizer (only a first stage drafts through text, for the stage after it)."""
    draft, runner = load_draft(spec, target, target_runner)
    if has_other_tokenizer(target, draft):
        raise ModelLoadError(
            f"stage {number} ({spec.model}) has another tokenizer than the target {target.path}: only the "
            "first stage of staged drafts may (it drafts through text for the stage after it), since the "
            "stages before a model draft in its tokens; put it first, without prompt lookup before it"
        )
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(runner, target.model.config.vocab_size, spec.draft_confidence_threshold)


def _check_stage_paths(stages: tuple[str, ...], target: LoadedModel) -> None:
    """No model stage is the target itself, an EAGLE head, or the same model as the stage after it."""
    paths = {
        number: Path(str(resolve_model(stage, f"stage {number}"))).expanduser().resolve()
        for number, stage in enumerate(stages, start=1)
        if stage != NGRAM_STAGE
    }
    for number, path in paths.items():
        stage = stages[number - 1]
        if path == Path(target.path).expanduser().resolve():
            raise ModelLoadError(
                f"stage {number} ({stage}) is the target itself: the stages draft for the target, so list "
                "only the drafts, smallest first (the target is LLM's model)"
            )
        if is_head_directory(path):
            raise ModelLoadError(
                f"stage {number} ({stage}) is an EAGLE head, which drafts from its target's features and cannot "
                "be a stage: run it alone (speculative_method='eagle')"
            )
        if paths.get(number + 1) == path:
            raise ModelLoadError(
                f"stages {number} and {number + 1} are the same model ({stage}): a model drafting for itself "
                "agrees with itself and saves nothing; drop one"
            )


def _check_stage_sizes(sizes: list[tuple[str, int]], target: tuple[str, int]) -> None:
    """Each model stage is no larger than the model it drafts for (the next stage, or the
    target), by parameters: a larger one costs more than the forwards it saves."""
    chain = [*sizes, target]
    for upper, ((stage, parameters), (above, above_parameters)) in enumerate(zip(chain, chain[1:]), start=1):
        if parameters > above_parameters:
            what = "the target" if upper == len(sizes) else "the next stage"
            raise ModelLoadError(
                f"the stage {stage} ({parameters / 1e6:,.2f}M parameters) drafts for {what} {above} "
                f"({above_parameters / 1e6:,.2f}M) and is larger: list the stages smallest first, each "
                "drafting for the next, the last for the target"
            )
