"""A smaller model with the target's tokenizer, sampled k times per round.

The draft's KV cache follows the target's: each slot remembers which tokens it has fed
(the sequence so far, then the draft tokens it fed while proposing). At the next round the
tokens that still match the sequence stay; the rest (rejected drafts) are simply overwritten
by feeding the sequence from the first mismatch: after a rejection that is the recovered
token, after a full acceptance the last draft token and the bonus token.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from specdec.config import SMALL_DRAFT_PARAMETERS, keeps_file_quantization, requantization
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.steps import DraftSteps
from specdec.drafters.tree_growth import TreeGrowth
from specdec.kv_cache import BlockPool, TreeAttention
from specdec.models.gguf import gguf_bits_per_weight
from specdec.models.gguf_linear import runs_gguf_kernels
from specdec.models.gguf_requantize import quantize_into_gguf_kernels
from specdec.models.loader import (
    LoadedModel,
    ModelLoadError,
    is_gguf_file,
    load_pretrained,
    model_config_from_hf,
    read_config,
)
from specdec.models.registry import resolve_model
from specdec.progress import stage
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.tree import TreeShape
from specdec.worker import ForwardBatch, ModelRunner

LARGE_WEIGHT_BYTES = 2_000_000  # float32 matrices at least this big run in bf16 in a small CPU draft
DRAFT_BLOCK_TYPE = "Q4_0"  # what draft_quantization "auto" requantizes a wide GGUF draft into (gguf_requantization)
REQUANTIZE_ABOVE_BITS = 5.25  # a GGUF draft stored with more bits per weight is requantized (Q4_0: 4.5;
# Q4_K_M files: 4.8-5.0, their 6-bit output layer weighing more where the vocabulary is large)
CATCH_UP_WIDTH = 2  # tokens a row the batch's catch-up forward feeds (a round's accepted ones: see _catch_up)
QUERY_LENGTHS = (1, CATCH_UP_WIDTH)  # a round's forwards: the catch-up, then one token a draft step


class DraftModelDrafter(Drafter):
    """runner: how the draft model runs (runner.model is the model)."""

    grows_trees = True

    def __init__(self, runner: ModelRunner, vocab_size: int, confidence_threshold: float = 0.0):
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        self.confidence_threshold = confidence_threshold  # 0 = always draft k
        # slot -> (n, drafts): the cache holds the sequence's first n tokens, then these drafts
        self.fed: dict[int, tuple[int, list[int]]] = {}
        self.shares_pool = False  # whether the cache reserve() made is in the engine's pool

    @property
    def model(self):
        """The draft model (the runner's)."""
        return self.runner.model

    @classmethod
    def from_config(cls, spec, target: LoadedModel, target_runner: ModelRunner) -> DraftModelDrafter:
        """Load spec.model (load_draft), check that it shares the target's vocabulary, and draft
        with it."""
        draft, runner = load_draft(spec, target, target_runner)
        check_same_vocabulary(target, draft)
        return cls(runner, target.model.config.vocab_size, spec.draft_confidence_threshold)

    def sharing_weights(self, confidence_threshold: float | None = None) -> DraftModelDrafter:
        """A drafter over the same draft model and runner (for comparisons within one process:
        the two share the runner's cache, so they run one generate at a time, each preparing its
        own); confidence_threshold None keeps this one's."""
        threshold = self.confidence_threshold if confidence_threshold is None else confidence_threshold
        return DraftModelDrafter(self.runner, self.vocab_size, threshold)

    def compiles(self, max_batch: int, max_len: int, num_forwards: int) -> bool:
        return self.runner.compiles(max_batch, max_len, QUERY_LENGTHS, num_forwards)

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        self.runner.prepare(max_batch, max_len, QUERY_LENGTHS, num_forwards, pool=pool)
        self.fed.clear()
        self.shares_pool = self.runner.reads_pool(pool)

    def release(self, seq: Sequence) -> None:
        self.fed.pop(seq.slot, None)

    def position_bytes(self) -> int:
        return self.model.position_bytes

    def cached_entries(self, seq: Sequence) -> int | None:
        return self._num_fed(seq) if self.shares_pool else None

    def _num_fed(self, seq: Sequence, tokens: list[int] | None = None) -> int:
        """The leading positions of tokens (seq's own, or seq followed by more) whose entries
        the cache holds: what it fed for seq that still matches them; for a sequence not fed
        yet, its cached prefix's where the cache is in the pool (block_manager.py), else none."""
        tokens = seq.token_ids if tokens is None else tokens
        start = seq.num_drafter_cached_tokens if self.shares_pool else 0
        num_confirmed, drafts = self.fed.get(seq.slot, (start, []))
        return num_confirmed + _common_prefix(drafts, tokens[num_confirmed:])

    def time_step(self, batch_size: int) -> None:
        """One draft step of batch_size rows, at position 0 of slots 0..batch_size-1 (a new
        sequence's catch-up rewrites it: reserve() forgot what every slot held)."""
        device = self.model.device
        input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.runner(ForwardBatch.of(input_ids, torch.zeros_like(input_ids), range(batch_size)))

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        """Up to ks[i] draft tokens for row i, drawn as steps.py says (greedy, sampled, stopping
        early below the confidence threshold)."""
        device = self.model.device
        if max(ks, default=0) == 0:
            return Draft.empty(len(batch), device)
        slots = [seq.slot for seq in batch]
        steps = DraftSteps(batch, ks, sampling, self.confidence_threshold, device)
        token = steps.draw(self._catch_up(batch))  # from each row's next-token logits [B, V]
        while steps.more:
            step = len(steps.tokens) - 1  # the step whose token is fed
            positions = torch.tensor([seq.num_tokens + step for seq in batch], device=device)[:, None]  # [B, 1]
            token = steps.draw(self._logits(self.runner(ForwardBatch.of(token[:, None], positions, slots))[:, 0]))
        token_ids = steps.token_ids()  # [B, steps]
        for row, seq in enumerate(batch):  # the cache holds every draft token but the last
            self.fed[seq.slot] = (seq.num_tokens, token_ids[row, : token_ids.shape[1] - 1].tolist())
        return steps.draft()

    def propose_tree(
        self, batch: list[Sequence], budget: int, shape: TreeShape, max_depths: list[int], sampling: SamplingTensors
    ) -> Draft:
        """A tree grown as tree_growth.py says. After the catch-up the cache holds each row's
        tokens up to its last (position L-1); the expanded nodes are written from position L on,
        a node at depth d at RoPE position L-1+d, and forgotten afterwards (the next catch-up
        feeds the accepted ones again)."""
        device = self.model.device
        slots = [seq.slot for seq in batch]
        growth = TreeGrowth(batch, shape, budget, max_depths, sampling, device)
        growth.start(self._catch_up(batch))
        lengths = torch.tensor([seq.num_tokens for seq in batch], device=device)  # [B]: L
        while (frontier := growth.frontier()) is not None:
            positions = (lengths - 1 + frontier.depth)[:, None].expand_as(frontier.tokens)  # [B, W]
            tree = TreeAttention(lengths[:, None] + frontier.fed, lengths, frontier.visible)
            forward = ForwardBatch.of(self._in_draft_vocabulary(frontier.tokens), positions, slots, tree)
            growth.grow(frontier, self._logits(self.runner(forward)))  # [B, W, V]
        for seq in batch:
            self.fed[seq.slot] = (seq.num_tokens, [])
        return growth.draft()

    def _catch_up(self, batch: list[Sequence]) -> torch.Tensor:
        """Feed each row the tokens its cache lacks (the whole prompt for a new sequence,
        one or two tokens after a round); return the logits after each row's last token.
        The batch's forward feeds at most CATCH_UP_WIDTH tokens a row: a row that lacks more
        (a sequence that just joined, one back from plain rounds) is fed the rest first, alone
        with the other such rows, so that one long prompt does not widen every row's forward."""
        chunks, starts = [], []
        for seq in batch:
            tokens = seq.token_ids
            start = min(self._num_fed(seq), len(tokens) - 1)  # always feed the last token: its logits are needed
            chunks.append(tokens[start:])
            starts.append(start)
        long_rows = [row for row, chunk in enumerate(chunks) if len(chunk) > CATCH_UP_WIDTH]
        if long_rows:
            heads = [chunks[row][:-CATCH_UP_WIDTH] for row in long_rows]
            self._feed([batch[row] for row in long_rows], heads, [starts[row] for row in long_rows])
            for row, head in zip(long_rows, heads):
                chunks[row], starts[row] = chunks[row][len(head) :], starts[row] + len(head)
        return self._feed(batch, chunks, starts)

    def _feed(self, batch: list[Sequence], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One forward over each row's chunk of tokens from its start position -> the draft's
        logits after each row's last token [B, V]."""
        forward, last_index = self.runner.ragged_batch(chunks, starts, [seq.slot for seq in batch])
        forward = dataclasses.replace(forward, input_ids=self._in_draft_vocabulary(forward.input_ids))
        return self._logits(self.runner.last_token_logits(forward, last_index))

    def _in_draft_vocabulary(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A draft with a smaller embedding than the target's (a padded vocabulary: ids the shared
        tokenizer never makes) cannot embed the target's extra ids, which a prompt of ids or a
        sample can still hold: it reads them as id 0. That changes only what the draft proposes;
        verification keeps the output the target's."""
        draft_vocab_size = self.model.config.vocab_size
        if draft_vocab_size >= self.vocab_size:
            return input_ids
        return torch.where(input_ids < draft_vocab_size, input_ids, 0)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V_draft] in the target's vocabulary [B, V]: extra ids cut, missing
        ids given -inf (never drafted)."""
        V = self.vocab_size
        if logits.shape[-1] >= V:
            return logits[..., :V]
        pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def load_draft(spec, target: LoadedModel, target_runner: ModelRunner) -> tuple[LoadedModel, ModelRunner]:
    """Load spec.model in spec.draft_dtype (with its tokenizer where the target has one) and run
    it as the target runs (device, platform, compile). "auto" on the CPU, for a small draft:
    float32, and where it runs eagerly, its matrices of at least LARGE_WEIGHT_BYTES (those big
    enough for bytes to matter: in the shipped draft, only the output layer) prepacked in
    bfloat16 if this CPU has it natively. A draft requantized (gguf_requantization) is read
    dequantized, then its linear layers are quantized into that GGUF block type."""
    device = target_runner.device
    path = resolve_model(spec.model, "the draft")  # a registered name: its fetched file or directory
    small = _is_small(str(path))
    small_on_cpu = spec.draft_dtype == "auto" and device.type == "cpu" and small
    if small_on_cpu:
        draft_dtype = torch.float32
    else:
        draft_dtype = target.model.dtype if spec.draft_dtype == "auto" else spec.draft_dtype
    block_type = gguf_requantization(spec, target, device, path, small)
    draft = load_pretrained(
        path,
        draft_dtype,
        device,
        load_tokenizer=target.tokenizer is not None,
        platform=target_runner.platform,
        what="the draft",
        keep_quantized=keeps_file_quantization(spec.draft_quantization) and block_type is None,
    )
    if block_type is not None:
        with stage(f"the draft: quantizing its weights into {block_type}"):
            quantize_into_gguf_kernels(draft.model, block_type)
    warn_if_shorter_context(target, draft)
    runner = ModelRunner(
        draft.model,
        target_runner.platform,
        target_runner.compile_mode,
        bf16_pack_min_bytes=LARGE_WEIGHT_BYTES if small_on_cpu else None,
        name="the draft",
        quantization=requantization(spec.draft_quantization),
    )
    return draft, runner


def gguf_requantization(spec, target: LoadedModel, device: torch.device, path: str | Path, small: bool) -> str | None:
    """The GGUF block type the linear layers of the draft at path (spec.model resolved; small:
    of at most SMALL_DRAFT_PARAMETERS) are requantized into, or None (its own
    weights). draft_quantization "auto", drafting for a target that runs on the GGUF kernels, on
    the CPU: DRAFT_BLOCK_TYPE (Q4_0) for a GGUF draft file of more than REQUANTIZE_ABOVE_BITS
    bits per matrix weight (Q5_0, Q8_0, float; SmolLM2-135M's Q4_1 file, 5.7 with its 8-bit
    embedding; a Q4_K_M file, 4.8-5.0, runs as it is), and for a model directory's float weights
    (16 or 32 bits a weight: `smollm2`'s converted directory) unless the draft is small enough
    to run in float32 (SMALL_DRAFT_PARAMETERS: the shipped code draft). A decoding step reads
    every weight, so the draft's cost c follows its bytes (docs/runner.md, "A draft model in
    Q4_0"): the fetched Qwen2.5-Coder-0.5B (Q5_0 matrices, a Q8_0 embedding and output layer)
    costs about half the 1.5B Q4_K_M target's step as it is; SmolLM2-135M's step costs 28-42 ms
    from its directory in bfloat16 and 4-6 ms in Q4_0 (AVX-512 and AVX2 alike). Where the draft drafts, the
    output is the target's either way."""
    if spec.draft_quantization != "auto" or device.type != "cpu" or not runs_gguf_kernels(target.model):
        return None
    if is_gguf_file(path):
        return DRAFT_BLOCK_TYPE if gguf_bits_per_weight(path) > REQUANTIZE_ABOVE_BITS else None
    return None if small else DRAFT_BLOCK_TYPE


def _is_small(path: str) -> bool:
    """At most SMALL_DRAFT_PARAMETERS, by its config.json (a missing one fails later, in
    load_pretrained, with a clear error)."""
    if not (Path(path) / "config.json").is_file():
        return False
    config = model_config_from_hf(read_config(Path(path)), Path(path) / "config.json")
    return config.num_parameters <= SMALL_DRAFT_PARAMETERS


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def warn_if_shorter_context(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft trained on shorter texts than its target is run past its length on long
    requests: say so once (its proposals may fall off there; the output stays the target's)."""
    draft_context, target_context = (m.model.config.max_position_embeddings for m in (draft, target))
    if draft_context < target_context:
        warnings.warn(
            f"the draft {draft.path} has a context of {draft_context} tokens, the target {target_context}: "
            f"past {draft_context} tokens it drafts beyond what it was trained on, and fewer of its "
            "tokens may be accepted (the output is still the target's)",
            stacklevel=2,
        )


def has_other_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    """Both models have tokenizers, and they map text to different token ids."""
    if target.tokenizer is None or draft.tokenizer is None:
        return False
    return target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must map text to the same token ids as the target (embedding sizes may differ,
    as padded vocabularies often do)."""
    if target.tokenizer is not None and draft.tokenizer is not None:
        target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
            raise ModelLoadError(
                f"the draft {draft.path} has a different vocabulary from the target {target.path} "
                f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {differing}); "
                "this drafter needs a draft that shares the target's tokenizer (speculative_method "
                "'draft_model' drafts through text with a draft of another tokenizer: drafters/cross_tokenizer.py)"
            )
    elif target.model.config.vocab_size != draft.model.config.vocab_size:
        raise ModelLoadError(
            f"the draft {draft.path} has vocab_size {draft.model.config.vocab_size}, the target "
            f"{target.path} has {target.model.config.vocab_size}; a draft must share the target's vocabulary, "
            "or, to draft through text with another tokenizer, both need their tokenizers: load the target's "
            "(drop skip_tokenizer_init) and give the draft a tokenizer.json"
        )
