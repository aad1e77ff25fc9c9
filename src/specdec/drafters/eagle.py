"""EAGLE: draft from the target's own features with a one-layer head (models/eagle.py).

The head's cache entry at position p holds (f_p, token p+1): the target's feature at p and
the embedding of the token after it. Fed the entries up to p = L-2 of a sequence of L tokens
(every feature the target has computed: the last token's comes with the next verification),
it predicts f^_{L-1}, which the target's output layer turns into the first draft token x_1
(position L). Each further step feeds (f^, x_i) at the next position and draws x_{i+1}.

Features flow from verification: after every target forward the engine hands over the hidden
states at the positions the sequence keeps (observe_hidden); they wait here, per slot, until
the row's next proposal feeds them. What the drafting steps wrote past them (entries of
predicted features) sits at later positions and is overwritten then, as the target's own
rejected entries are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import requantization
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.steps import DraftSteps
from specdec.drafters.tree_growth import TreeGrowth
from specdec.kv_cache import BlockPool, CacheRows, KVCache, TreeAttention, ragged_batch
from specdec.models.cpu_linear import can_pack, pack_linears
from specdec.models.eagle import EagleHead, HeadLoadError, head_mismatch, load_head
from specdec.models.gguf_linear import GGUFLinear, runs_gguf_kernels
from specdec.models.gguf_requantize import quantize_into_gguf_kernels
from specdec.models.loader import LoadedModel
from specdec.models.quantized_linear import check_quantization
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.tree import TreeShape
from specdec.worker import ModelRunner

HEAD_QUANTIZATION_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}  # draft_quantization -> the GGUF type a head takes
# A sampled row's drafts come from the head's distribution at this share of the request's
# temperature (steps.py): a head is less sure than its target where the two agree, and the
# sharper draft is accepted more often. On the shipped Qwen2.5-Coder-1.5B head, over text it never
# trained on, the target's chance of accepting a first draft token at temperature 0.8 / top-p
# 0.95 rose from 0.505 (scale 1) to 0.532 (0.5; 0.35: 0.529; the argmax alone: 0.514), at
# temperature 1.0 from 0.454 to 0.530; a draft model (Qwen2.5-Coder-0.5B, 0.743 at scale 1) gains
# nothing from it (docs/runner.md, "A sharper draft for sampled rows").
SAMPLED_TEMPERATURE_SCALE = 0.5


@dataclass(frozen=True)
class PreparedHead:
    """A head loaded from path and prepared as its drafter runs it (dtype, device, quantization,
    packing), with the rows of the target's output layer it scores (None: all of them)."""

    path: Path
    head: EagleHead
    output_layer: torch.nn.Module | None


class EagleDrafter(Drafter):
    """head: the EAGLE head; target: the model whose embedding and output layer it borrows
    (the target runner's eager model: the same weights, packed for fast eager calls)."""

    needs_target_hidden = True
    grows_trees = True

    def __init__(
        self,
        head: EagleHead,
        target,
        confidence_threshold: float = 0.0,
        output_layer=None,
        temperature_scale: float = SAMPLED_TEMPERATURE_SCALE,
    ):
        """output_layer: for a head scoring part of the vocabulary, its rows of the target's output
        layer (EagleHead.output_layer); None: the target's own output layer scores.
        temperature_scale: a sampled row's drafts are drawn at the request's temperature times
        this (DraftSteps)."""
        self.head = head
        self.temperature_scale = temperature_scale
        self.target = target
        self.output_layer = output_layer
        self.confidence_threshold = confidence_threshold
        self.cache: KVCache | None = None  # the head's own, made by reserve
        # slot -> (position of the first feature not yet fed, those features [n, H])
        self.waiting: dict[int, tuple[int, torch.Tensor]] = {}
        self.shares_pool = False  # whether the head's cache is in the engine's pool
        self.prepare: Callable[[Path], PreparedHead] | None = None  # from_config's: how another version loads
        self.head_path: Path | None = None  # the directory the head in use was loaded from

    @classmethod
    def from_config(cls, spec, target: LoadedModel, target_runner: ModelRunner) -> EagleDrafter:
        """Load the head in spec.model for this target, in spec.draft_dtype ("auto": the target's);
        spec.draft_quantization "int8" / "int4": its linear layers quantized into GGUF's Q8_0 / Q4_0
        blocks and run on the GGUF kernels, its decoder layer in one C++ call (a drafting step of
        one row is mostly per-op cost and the bytes of those layers: docs/training.md); "auto":
        int8 for a target that runs on those kernels itself (a GGUF file), else as loaded."""
        quantization = spec.draft_quantization
        if quantization == "auto" and runs_gguf_kernels(target.model):
            quantization = "int8"
        quantization = check_quantization(requantization(quantization), target_runner.device, "draft_quantization")
        dtype = target_runner.dtype if spec.draft_dtype == "auto" else getattr(torch, spec.draft_dtype)
        if dtype != target_runner.dtype:
            raise ValueError(
                f"an EAGLE head runs in its target's dtype ({str(target_runner.dtype).removeprefix('torch.')}"
                f"), whose embedding and output layer it uses; got draft_dtype={spec.draft_dtype!r}"
            )

        def prepare(path) -> PreparedHead:
            return _prepared(Path(path), target, dtype, target_runner.device, quantization)

        prepared = prepare(spec.model)
        if prepared.head.is_eagle3:  # the target's forwards then hand over those layers' outputs as its features
            target_runner.set_feature_layers(prepared.head.feature_layers)
        threshold = spec.draft_confidence_threshold
        drafter = cls(prepared.head, target_runner.eager_model(), threshold, prepared.output_layer)
        drafter.prepare, drafter.head_path = prepare, prepared.path
        return drafter

    def adaptable(self) -> EagleDrafter:
        return self

    def load_version(self, path: str | Path) -> PreparedHead:
        """Another version of this drafter's head (one adapted to the traffic it serves), loaded
        and prepared as from_config prepared the head in use, ready for swap_head. Raises
        HeadLoadError naming what is wrong: a file that is not a head for this target, or a head
        of another shape or reading other layers than the one in use (its cache and the target's
        features would not fit)."""
        if self.prepare is None:
            raise HeadLoadError("this drafter was given its head, not loaded from a directory: it loads no other")
        prepared = self.prepare(Path(path))
        mismatch = head_mismatch(prepared.head, self.head, "the head in use")
        if mismatch is not None:
            raise HeadLoadError(f"the head in {path} {mismatch}: it cannot take its place while the server runs")
        return prepared

    def swap_head(self, prepared: PreparedHead) -> None:
        """Draft with prepared's head from the next round on; call between rounds only (the
        engine's thread). The cache and the waiting features stay: the same shape, made by the old
        head, so the next drafts of the sequences running may be accepted a little less, and no
        output changes (a draft never changes one)."""
        self.head, self.output_layer, self.head_path = prepared.head, prepared.output_layer, prepared.path

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        cache = self.cache
        if cache is None or cache.max_batch < max_batch or cache.max_len < max_len or not cache.reads(pool):
            self.cache = None  # the old one freed before the new one is made
            cache = self.cache = self.head.new_cache(max_batch, max_len, pool=pool)
        self.waiting.clear()
        self.shares_pool = pool is not None and cache.reads(pool)

    def release(self, seq: Sequence) -> None:
        self.waiting.pop(seq.slot, None)

    def position_bytes(self) -> int:
        return self.head.position_bytes

    def cached_entries(self, seq: Sequence) -> int | None:
        """Entries before a row's waiting features are the target's (the catch-up fed them);
        from there on a draft may have written its own predictions."""
        if not self.shares_pool:
            return None
        return self.waiting[seq.slot][0] if seq.slot in self.waiting else 0

    def observe_hidden(
        self, batch: list[Sequence], first_positions: torch.Tensor, hidden: torch.Tensor, num_valid: torch.Tensor
    ) -> None:
        """Keep each row's new features (fused, for an EAGLE-3 head) until its next proposal."""
        firsts, counts = first_positions.tolist(), num_valid.tolist()
        fused = self.head.fuse_features(hidden)  # [B, T, n x H] -> [B, T, H]
        for row, seq in enumerate(batch):
            features = fused[row, : counts[row]]  # [n, H]
            start, waiting = self.waiting.get(seq.slot, (firsts[row], features[:0]))
            if start + len(waiting) != firsts[row]:  # never: the engine hands every kept position once
                raise AssertionError(
                    f"slot {seq.slot}: features up to {start + len(waiting)} kept, next at {firsts[row]}"
                )
            self.waiting[seq.slot] = (start, torch.cat([waiting, features]))

    def time_step(self, batch_size: int) -> None:
        """One drafting step of batch_size rows at position 0 of slots 0..batch_size-1."""
        device = self.head.device
        tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        features = torch.zeros(batch_size, 1, self.head.config.hidden_size, dtype=self.head.dtype, device=device)
        self._step(tokens, features, torch.zeros_like(tokens), self._rows(range(batch_size)))

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        device = self.head.device
        if max(ks, default=0) == 0:
            return Draft.empty(len(batch), device)
        cache = self._rows([seq.slot for seq in batch])
        steps = DraftSteps(
            batch,
            ks,
            sampling,
            self.confidence_threshold,
            device,
            self.temperature_scale,
            self.scored_ids,
            self.head.config.vocab_size,
        )
        feature, scores = self._catch_up(batch, cache)  # f^_{L-1} [B, 1, H], its scores [B, S]
        token = steps.draw(scores)
        while steps.more:
            step = len(steps.tokens) - 1
            positions = torch.tensor([seq.num_tokens - 1 + step for seq in batch], device=device)[:, None]  # [B, 1]
            feature, scores = self._step(token[:, None], feature, positions, cache)
            token = steps.draw(scores[:, 0])
        return steps.draft()

    def propose_tree(
        self, batch: list[Sequence], budget: int, shape: TreeShape, max_depths: list[int], sampling: SamplingTensors
    ) -> Draft:
        """A tree grown as tree_growth.py says. A node at depth d (its token at position L-1+d)
        is expanded by feeding (its parent's predicted feature, its token) at position L-2+d;
        the expanded nodes are written from position L-1 on, where the next catch-up writes
        the target's own features over them."""
        device, H = self.head.device, self.head.config.hidden_size
        cache = self._rows([seq.slot for seq in batch])
        growth = TreeGrowth(batch, shape, budget, max_depths, sampling, device)
        root_feature, scores = self._catch_up(batch, cache)  # f^_{L-1} [B, 1, H], its scores [B, S]
        growth.start(self._over_vocabulary(scores))  # [B, V]
        features = root_feature  # [B, 1 + F, H]: the root's predicted feature, then each expanded node's
        starts = torch.tensor([seq.num_tokens - 1 for seq in batch], device=device)  # [B]: L-1
        while (frontier := growth.frontier()) is not None:
            parent_features = features.gather(1, (frontier.parent_fed + 1)[:, :, None].expand(-1, -1, H))  # [B, W, H]
            positions = (starts - 1 + frontier.depth)[:, None].expand_as(frontier.tokens)  # [B, W]
            tree = TreeAttention(starts[:, None] + frontier.fed, starts, frontier.visible)
            predicted = self.head(
                self.target.embed_tokens(frontier.tokens), parent_features, positions, cache, tree=tree
            )  # [B, W, H]
            features = torch.cat([features, predicted], dim=1)
            growth.grow(frontier, self._over_vocabulary(self._scores(predicted)))  # [B, W, V]
        return growth.draft()

    def _rows(self, slots) -> CacheRows:
        """The head's cache (made by reserve) as row i -> slot slots[i]."""
        assert self.cache is not None, "reserve() makes the head's cache first"
        return self.cache.rows(slots)

    def _catch_up(self, batch: list[Sequence], cache: CacheRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row's waiting features with the tokens after them (entries start..L-2);
        the predicted feature after the last [B, 1, H] and its scores [B, S] (_scores)."""
        device, H = self.head.device, self.head.config.hidden_size
        chunks = [self._waiting_entries(seq) for seq in batch]  # (start, features [n, H], tokens [n])
        tokens, positions, last = ragged_batch(
            [t for _, _, t in chunks], [start for start, _, _ in chunks], cache.max_len
        )  # [B, W], [B, W], [B]
        tokens, positions, last = tokens.to(device), positions.to(device), last.to(device)
        features = torch.zeros(*tokens.shape, H, dtype=self.head.dtype, device=device)  # [B, W, H]
        for row, (_, row_features, _) in enumerate(chunks):
            features[row, : len(row_features)] = row_features
        predicted = self.head(self.target.embed_tokens(tokens), features, positions, cache)  # [B, W, H]
        feature = predicted[torch.arange(len(batch), device=device), last][:, None]  # [B, 1, H]
        for seq in batch:
            del self.waiting[seq.slot]
        return feature, self._scores(feature[:, 0])

    def _waiting_entries(self, seq: Sequence) -> tuple[int, torch.Tensor, list[int]]:
        """(first position, features, the token after each) of seq's entries not yet fed."""
        start, features = self.waiting[seq.slot]
        tokens = seq.token_ids[start + 1 : start + 1 + len(features)]
        if len(tokens) != len(features) or start + len(features) != seq.num_tokens - 1:
            raise AssertionError(
                f"slot {seq.slot}: features for positions {start}..{start + len(features) - 1}, "
                f"but the sequence holds {seq.num_tokens} tokens"
            )
        return start, features, tokens

    def _step(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: CacheRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step: tokens [B, 1], features [B, 1, H] at positions [B, 1] -> the
        predicted features [B, 1, H] and their scores [B, 1, S] (_scores)."""
        predicted = self.head(self.target.embed_tokens(tokens), features, positions, cache)  # [B, 1, H]
        return predicted, self._scores(predicted)

    @property
    def scored_ids(self) -> torch.Tensor | None:
        """The vocabulary ids [S] the head scores (ascending), where it scores part of the
        vocabulary; None: it scores all of it (S = V)."""
        return None if self.output_layer is None else self.head.output_token_ids

    def _scores(self, predicted: torch.Tensor) -> torch.Tensor:
        """Scores of the predicted features [..., H] (float32): over the tokens the head scores
        [..., S] (scored_ids), or the target's logits over its vocabulary [..., V]."""
        if self.output_layer is None:
            return self.target.logits(predicted)
        return self.output_layer(predicted).float()

    def _over_vocabulary(self, scores: torch.Tensor) -> torch.Tensor:
        """_scores' scores [..., S] as logits over the whole vocabulary [..., V] (-inf for the
        tokens the head does not score)."""
        return scores if self.output_layer is None else self.head.logits(scores)


def _prepared(path: Path, target: LoadedModel, dtype: torch.dtype, device, quantization: str | None) -> PreparedHead:
    """The head in path for target, in dtype on device, quantized ("int8" / "int4") or packed for
    the CPU's eager calls, with the rows of the target's output layer it scores."""
    head = load_head(path, target.model.config, dtype, device)
    lm_head = target.model.lm_head
    output_layer = None
    if head.config.output_vocab_size and isinstance(lm_head, GGUFLinear):  # its rows, still quantized
        output_layer = lm_head.rows(head.output_token_ids)
    elif head.config.output_vocab_size:
        output_layer = head.output_layer(lm_head)
    if quantization is not None:
        quantize_into_gguf_kernels(head, HEAD_QUANTIZATION_TYPES[quantization])
    elif can_pack(dtype, device):  # on the CPU: the runner's eager layout
        pack_linears(head)
    if can_pack(dtype, device) and isinstance(output_layer, torch.nn.Linear):
        output_layer = torch.nn.Sequential(output_layer)  # the target's rows: packed as it is
        pack_linears(output_layer)
    return PreparedHead(path, head, output_layer)
