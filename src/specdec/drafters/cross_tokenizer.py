"""A draft model with another tokenizer than the target's: it drafts through text, as
"universal assisted generation" does.

Terms (used in this module only):
  target text    the target's tokens so far, decoded with their special tokens as text (a
                 leading BOS of the target's left out: the draft puts its own first)
  draft context  the target text encoded by the draft's tokenizer, after the tokens the draft's
                 tokenizer puts before any text (its BOS, if it has one): what the draft reads
  draft text     the text of the draft's new tokens, as it reads after the draft context
  lookahead      the draft's last new token: text it adds could still move the target's token
                 boundary before it (" ret" + "urn" is one target token " return"), so only the
                 target tokens that end before its text are proposed; a draft that ends in its
                 end-of-sequence token needs none (a special token is a boundary in itself)
  settled text   the draft text less the lookahead's
  window         the target's last w tokens (w <= JUNCTION_TOKENS), re-encoded together with the
                 draft text to find the target tokens that follow them
  proposal       the target tokens proposed: those after the window in the window's re-encoding,
                 as long as their text stays within the settled text, at most k

A round, for each row with k target tokens wanted:
  read      re-encode the whole target text with the draft's tokenizer (a tail alone need not
            tokenize the same, so the whole, about 1-1.5 ms per 1,000 tokens); the draft's cache
            keeps the longest common prefix of what it was fed and the new draft context, and is
            fed the rest (after a round: the re-encoded accepted text, one to a few tokens)
  draft     by argmax, carrying the draft tokens over (below) after each step, until they carry
            over to k target tokens; at most ceil(k * ratio) + 2 tokens (ratio: draft tokens per
            target token over the target text so far; + 1 for the lookahead, + 1 spare). A row
            also stops after its end-of-sequence token, or, with a confidence threshold, after a
            token the draft gave less than it (that token is then the lookahead)
  carry     decode the draft's tokens, encode the window's text + the draft text with the
            target's tokenizer, from the widest window (JUNCTION_TOKENS tokens) down to one
            token; take the first re-encoding that starts with the window's own tokens (the
            junction falls on a target token boundary and the target's tokens there are what
            its tokenizer makes of this text), and propose its tokens after the window while
            their text reads as a prefix of the settled text. A junction no window reproduces
            (a target token would merge with the draft's text) proposes nothing.
The draft never proposes more than k target tokens; a row proposes nothing when the target
text ends inside a character (a token split a UTF-8 character: the junction is not yet text),
or when its draft context would outgrow the draft's cache (DRAFT_LENGTH_FACTOR target
positions).

Exactness. The proposal is a deterministic function of the sequence so far (argmax drafting,
tokenizers): a point mass, proposed with draft_probs None, as prompt lookup's is. For a point
mass on x, spec/verify.py's rejection_sample tests u * 1 < p(x) with u uniform in [0, 1), so x
is accepted with probability p(x) (p: the target's warped distribution there); on rejection it
draws from residual = max(0, p - onehot(x)), which is p with x's entry set to 0 (p(x) - 1 <= 0),
renormalised by sample_with_uniforms (if p(x) = 1 the residual is empty, but then u < 1 = p(x)
always accepts). So the token emitted at that position is y with probability
p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y): the target's distribution. A
proposal that depends only on the tokens before it keeps this true position by position, so
the output follows the target exactly, whatever the draft proposes. Greedy rows keep drafts
while they equal the target's argmax and then take the argmax: the target's own greedy output.

Special tokens. The target text holds the target's special tokens as their text
("<|im_start|>"). The draft's tokenizer matches such text whole, so a special token both
tokenizers have (ChatML's, shared by SmolLM2 and Qwen2.5) reaches the draft as its own token;
one the draft lacks reaches it as plain characters. In the other direction a draft special
token becomes its text, which the target's tokenizer turns into its own special token of that
text if it has one (the draft's end-of-sequence "<|im_end|>"), else into plain characters, which
the target will most likely reject. Either way only acceptance changes, never the output.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specdec.block_manager import BlockManager
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.draft_model import DraftModelDrafter, check_same_vocabulary, has_other_tokenizer, load_draft
from specdec.kv_cache import BlockPool, blocks_for, pool_for
from specdec.models.loader import LoadedModel
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.worker import ForwardBatch, ModelRunner

JUNCTION_TOKENS = 4  # the widest window of the target's last tokens re-encoded with the draft text
DECODE_CONTEXT = 4  # tokens decoded before a piece of text, so that it reads as it does after them
LOOKAHEAD = 1  # draft tokens drafted past the settled text
SPARE_STEPS = 1  # draft tokens a row may draft beyond k * ratio + LOOKAHEAD, where its text carries fewer
RATIO_RANGE = (0.5, 3.0)  # draft tokens per target token, as measured, clamped to this
DRAFT_LENGTH_FACTOR = 2  # the draft's cache holds this many positions per target position
CATCH_UP_WIDTH = 4  # tokens a row the batch's catch-up forward feeds (more: fed before, alone)


def draft_model_drafter(
    spec, target: LoadedModel, target_runner: ModelRunner
) -> DraftModelDrafter | CrossTokenizerDrafter:
    """The drafter of speculative_method "draft_model": a DraftModelDrafter for a draft that shares
    the target's vocabulary, a CrossTokenizerDrafter for one with another tokenizer (both models
    loaded with their tokenizers); anything else is refused with what to do
    (draft_model.check_same_vocabulary)."""
    draft, runner = load_draft(spec, target, target_runner)
    if has_other_tokenizer(target, draft):
        assert draft.tokenizer is not None and target.tokenizer is not None  # what has_other_tokenizer says
        return CrossTokenizerDrafter(
            runner, draft.tokenizer, target.tokenizer, draft.eos_token_ids, spec.draft_confidence_threshold
        )
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(runner, target.model.config.vocab_size, spec.draft_confidence_threshold)


@dataclasses.dataclass
class _Row:
    """One drafting row: the target's tokens, the k target tokens wanted, its draft context
    (draft token ids) and the most tokens it drafts."""

    target_ids: list[int]
    k: int
    context: list[int]
    max_steps: int


class CrossTokenizerDrafter(Drafter):
    """runner: how the draft model runs; draft_tokenizer / target_tokenizer: the two models';
    draft_eos_ids: the draft's end-of-sequence tokens (a row stops drafting after one);
    confidence_threshold: a row stops after a token the draft gave less than this (0: never)."""

    def __init__(
        self,
        runner: ModelRunner,
        draft_tokenizer: Tokenizer,
        target_tokenizer: Tokenizer,
        draft_eos_ids: tuple[int, ...] = (),
        confidence_threshold: float = 0.0,
    ):
        self.runner = runner
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.draft_eos_ids = frozenset(draft_eos_ids)
        self.confidence_threshold = confidence_threshold
        self.draft_prefix = tokens_before_text(draft_tokenizer)  # e.g. [BOS], or []
        self.target_bos_id = _bos_id(target_tokenizer)
        self.draft_vocab_size = max(draft_tokenizer.get_vocab().values()) + 1  # ids the draft may draft
        self.fed: dict[int, list[int]] = {}  # slot -> the draft tokens its cache holds, from position 0
        # its cache's pool and who holds which of its blocks (made by reserve)
        self.pool: BlockPool | None = None
        self.blocks: BlockManager | None = None

    @property
    def model(self):
        """The draft model (the runner's)."""
        return self.runner.model

    def sharing_weights(self, confidence_threshold: float | None = None) -> CrossTokenizerDrafter:
        """A drafter over the same draft model and runner (as DraftModelDrafter.sharing_weights);
        confidence_threshold None keeps this one's."""
        threshold = self.confidence_threshold if confidence_threshold is None else confidence_threshold
        return CrossTokenizerDrafter(
            self.runner, self.draft_tokenizer, self.target_tokenizer, tuple(self.draft_eos_ids), threshold
        )

    def reserve(self, max_batch: int, max_len: int, num_forwards: int = 0, pool: BlockPool | None = None) -> None:
        """A cache of its own positions (the draft's tokens, DRAFT_LENGTH_FACTOR per target
        position), paged in a pool of its own: as many blocks per block of the engine's pool
        (all max_batch slots at full length where that is less; pool None: those), handed to a
        row as its draft context grows and freed when its sequence leaves."""
        own_len = max_len * DRAFT_LENGTH_FACTOR
        whole = 1 + max_batch * blocks_for(own_len)
        num_blocks = whole if pool is None else min(whole, 1 + (pool.num_blocks - 1) * DRAFT_LENGTH_FACTOR)
        # a round feeds up to CATCH_UP_WIDTH tokens per row (catch-up), then one per draft step
        compiled = self.runner.compiles(max_batch, own_len, (1, CATCH_UP_WIDTH), num_forwards)
        own = self.pool = pool_for(self.pool, max_batch, own_len, num_blocks, self.model.device, True, compiled)
        self.blocks = BlockManager(own.sequence_blocks, own.table)
        self.runner.prepare(max_batch, own_len, (1, CATCH_UP_WIDTH), num_forwards, pool=own)
        self.fed.clear()

    def release(self, seq: Sequence) -> None:
        self.fed.pop(seq.slot, None)
        if self.blocks is not None:
            self.blocks.free(seq.slot)

    def position_bytes(self) -> int:
        return self.model.position_bytes * DRAFT_LENGTH_FACTOR

    def time_step(self, batch_size: int) -> None:
        """One draft forward of batch_size rows at position 0 of slots 0..batch_size-1 (reserve()
        forgot what every slot held). A round costs about k * ratio + 1 of them, and its tokenizer
        work besides."""
        input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.model.device)  # [B, 1]
        self.runner(ForwardBatch.of(input_ids, torch.zeros_like(input_ids), range(batch_size)))

    def propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        """Up to ks[i] target tokens for row i, point masses (argmax drafting whatever the
        request's sampling: see the module docstring), carried over through text."""
        device = self.model.device
        k = max(ks, default=0)
        token_ids = torch.zeros(len(batch), k, dtype=torch.long)  # [B, k]
        num_tokens = torch.zeros(len(batch), dtype=torch.long)  # [B]
        rows = {
            i: row
            for i, (seq, k_i) in enumerate(zip(batch, ks))
            if k_i > 0 and (row := self._read(seq, k_i)) and self._hold(seq.slot, row)
        }
        if rows:
            proposals = self._draft([batch[i] for i in rows], list(rows.values()))
            for i, proposal in zip(rows, proposals):
                token_ids[i, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
                num_tokens[i] = len(proposal)
        return Draft(token_ids.to(device), num_tokens.to(device), None)

    def _read(self, seq: Sequence, k: int) -> _Row | None:
        """The row's draft context and the most tokens to draft for k target tokens; None where
        it proposes nothing (its text ends inside a character, or would outgrow the cache)."""
        target_ids = seq.token_ids
        if target_ids and target_ids[0] == self.target_bos_id:
            target_ids = target_ids[1:]
        text = self.target_tokenizer.decode(target_ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return None
        context = self.draft_prefix + self.draft_tokenizer.encode(text, add_special_tokens=False)
        ratio = (len(context) - len(self.draft_prefix)) / max(1, len(target_ids))  # draft tokens per target token
        max_steps = math.ceil(k * min(max(ratio, RATIO_RANGE[0]), RATIO_RANGE[1])) + LOOKAHEAD + SPARE_STEPS
        if not context or len(context) + max_steps >= self.runner.max_len:  # the last position stays free
            return None
        return _Row(seq.token_ids, k, context, max_steps)

    def _hold(self, slot: int, row: _Row) -> bool:
        """The pool's blocks for the row's draft positions (its context, its drafts and the one
        after, ragged_batch's padding); False, nothing taken, where the pool is short: the row
        proposes nothing this round (the target decodes it alone)."""
        assert self.blocks is not None, "reserve() makes the pool first"
        needed = min(len(row.context) + row.max_steps + 1, self.runner.max_len)
        if not self.blocks.can_grow(slot, needed):
            return False
        self.blocks.grow(slot, needed)
        return True

    def _draft(self, batch: list[Sequence], rows: list[_Row]) -> list[list[int]]:
        """Each row's proposal (target tokens): it drafts by argmax until its draft tokens carry
        over to row.k target tokens, or after an end-of-sequence token or a token under the
        confidence threshold, or at row.max_steps, whichever comes first."""
        device = self.model.device
        slots = [seq.slot for seq in batch]
        lengths = torch.tensor([len(row.context) for row in rows], device=device)  # [B]
        logits = self._catch_up(slots, [row.context for row in rows])  # [B, V_draft]
        drafted: list[list[int]] = [[] for _ in rows]
        proposals: list[list[int]] = [[] for _ in rows]
        drafting = set(range(len(rows)))
        for slot, row in zip(slots, rows):
            self.fed[slot] = row.context
        while True:
            token = logits.argmax(-1)  # [B]
            stopping, tokens = self._stopping(logits, token), token.tolist()
            for i in sorted(drafting):
                row = rows[i]
                drafted[i].append(tokens[i])
                if len(drafted[i]) > LOOKAHEAD or i in stopping:
                    proposals[i] = self._carry_over(row.target_ids, row.context, drafted[i], row.k)
                if len(proposals[i]) == row.k or i in stopping or len(drafted[i]) == row.max_steps:
                    drafting.discard(i)
                else:
                    self.fed[slots[i]] = row.context + drafted[i]  # its last token is fed next
            if not drafting:
                return proposals
            step = max(len(drafted[i]) for i in drafting)
            positions = (lengths + step - 1).clamp(max=self.runner.max_len - 1)[:, None]  # [B, 1]
            # rows done drafting are fed too (one forward for all); past their fed tokens, unread
            logits = self._logits(self.runner(ForwardBatch.of(token[:, None], positions, slots))[:, 0])

    def _stopping(self, logits: torch.Tensor, token: torch.Tensor) -> set[int]:
        """The rows whose token [B] (from logits [B, V]) ends their draft: an end-of-sequence
        token, or one the draft gave less than the confidence threshold."""
        stop = [t in self.draft_eos_ids for t in token.tolist()]
        if self.confidence_threshold > 0:
            confidence = torch.softmax(logits.float(), dim=-1).gather(1, token[:, None])[:, 0]  # [B]
            stop = [s or c < self.confidence_threshold for s, c in zip(stop, confidence.tolist())]
        return {i for i, s in enumerate(stop) if s}

    def _catch_up(self, slots: list[int], contexts: list[list[int]]) -> torch.Tensor:
        """Feed each row the draft context its cache lacks (past the longest common prefix with
        what it was fed; always its last token, whose logits are needed) -> the logits after each
        row's last token [B, V_draft]. Rows lacking more than CATCH_UP_WIDTH tokens (a new
        sequence's prompt) are fed all but their last CATCH_UP_WIDTH first, in a forward of their
        own, so that one long prompt does not widen every row's forward."""
        starts = [
            min(common_prefix_length(self.fed.get(slot, []), context), len(context) - 1)
            for slot, context in zip(slots, contexts)
        ]
        long_rows = [i for i, context in enumerate(contexts) if len(context) - starts[i] > CATCH_UP_WIDTH]
        if long_rows:
            heads = [contexts[i][starts[i] : len(contexts[i]) - CATCH_UP_WIDTH] for i in long_rows]
            self._feed([slots[i] for i in long_rows], heads, [starts[i] for i in long_rows])
            for i in long_rows:
                starts[i] = len(contexts[i]) - CATCH_UP_WIDTH
        return self._feed(slots, [context[start:] for context, start in zip(contexts, starts)], starts)

    def _feed(self, slots: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One forward over each row's chunk from its start position -> the logits after each
        row's last token [B, V_draft]."""
        forward, last_index = self.runner.ragged_batch(chunks, starts, slots)
        return self._logits(self.runner.last_token_logits(forward, last_index))

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits cut to the ids its tokenizer knows [..., V_draft] (a padded
        embedding's extra rows never drafted)."""
        return logits[..., : self.draft_vocab_size]

    def _carry_over(self, target_ids: list[int], context: list[int], draft_tokens: list[int], k: int) -> list[int]:
        """The target tokens proposed for the draft's tokens after its context (at most k)."""
        draft_text = text_after(self.draft_tokenizer, context, draft_tokens)
        ends_in_eos = bool(draft_tokens) and draft_tokens[-1] in self.draft_eos_ids
        settled = draft_text if ends_in_eos else text_after(self.draft_tokenizer, context, draft_tokens[:-LOOKAHEAD])
        if draft_text is None or settled is None:
            return []
        settled = settled[: common_prefix_length(settled, draft_text)]
        return target_proposal(self.target_tokenizer, target_ids, draft_text.rstrip("\ufffd"), settled, k)


def target_proposal(
    tokenizer: Tokenizer, target_ids: list[int], draft_text: str, settled_text: str, max_tokens: int
) -> list[int]:
    """The target tokens to propose after target_ids for draft_text (whose first characters,
    settled_text, no later text can re-tokenize): the junction rule of the module docstring.
    From the widest window of target_ids' last tokens down to one, the first whose re-encoding
    with draft_text starts with the window's own tokens gives the proposal: its tokens after the
    window, as long as their text reads as a prefix of settled_text, at most max_tokens."""
    for width in range(min(JUNCTION_TOKENS, len(target_ids)), 0, -1):
        window = target_ids[len(target_ids) - width :]
        before = target_ids[max(0, len(target_ids) - width - DECODE_CONTEXT) : len(target_ids) - width]
        window_text = text_after(tokenizer, before, window)
        if window_text is None:
            continue
        encoded = tokenizer.encode(window_text + draft_text, add_special_tokens=False)
        if encoded[:width] == window:
            return _settled_tokens(tokenizer, before + window, encoded[width : max_tokens + width], settled_text)
    return []


def _settled_tokens(tokenizer: Tokenizer, before: list[int], candidates: list[int], settled_text: str) -> list[int]:
    """The longest prefix of candidates whose text after before reads as a prefix of
    settled_text (a token ending inside a character is kept only with the one that completes it)."""
    kept = 0
    for end in range(1, len(candidates) + 1):
        text = text_after(tokenizer, before, candidates[:end])
        if text is None:
            break
        if settled_text.startswith(text):
            kept = end
        elif not (text.endswith("\ufffd") and settled_text.startswith(text.rstrip("\ufffd"))):
            break
    return candidates[:kept]


def text_after(tokenizer: Tokenizer, context: list[int], token_ids: list[int]) -> str | None:
    """token_ids' text (special tokens as their text) as it reads after context: decoded with
    the context's last DECODE_CONTEXT tokens, less their text (decoded alone, a SentencePiece
    decoder strips a first token's leading space). None where the context's text does not end
    cleanly (a character split between the two)."""
    context = context[max(0, len(context) - DECODE_CONTEXT) :]
    prefix = tokenizer.decode(context, skip_special_tokens=False)
    text = tokenizer.decode(context + token_ids, skip_special_tokens=False)
    if prefix.endswith("\ufffd") or not text.startswith(prefix):
        return None
    return text[len(prefix) :]


def tokens_before_text(tokenizer: Tokenizer) -> list[int]:
    """The tokens the tokenizer's post-processor puts before any text (a BOS, or none)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _bos_id(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer's BOS token, where its post-processor puts one before a text."""
    prefix = tokens_before_text(tokenizer)
    return prefix[0] if len(prefix) == 1 else None


def common_prefix_length(a, b) -> int:
    """How many leading items (tokens, characters) a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
