"""The logits processors: what a request asks to be done to the target's logits before they are
warped (sampling.py) and sampled or verified, at every position the target samples from.

Terms:
  position  a column of the target's forward whose logits give the distribution of a next token:
            the prefill's last, a plain step's, or each of a verify forward's (the last token,
            then each draft token, whose column gives the distribution of the token after it)
  context   what a position's token follows: the sequence so far (prompt and output), then the
            draft tokens on the position's own branch up to it (a chain's earlier drafts; a
            tree node's ancestors and itself). The processors count those draft tokens as
            generated: the distribution a position verifies against is the one the target
            alone would sample from after that context, so speculation never changes the
            output (rejection sampling keeps a prefix of drafts that the target, processed,
            would have drawn).
  count     c[v]: how often token v is in the context's output (generated tokens, drafts included)

In this order (vLLM's: biases and masks, then penalties), for a row whose request sets them:
  0. grammar        z[v] = -inf for every v the request's structured output forbids after the
                    context (grammar.py)
     allowed        z[v] = -inf for every v not in allowed_token_ids (vLLM's)
     bad words      z[w_n] = -inf where the output ends with w_1 .. w_(n-1), for each bad word's
                    tokens w_1 .. w_n (vLLM's: the word as encoded alone and after a space)
  1. logit_bias     z[v] += bias[v]
  2. min_tokens     z[v] = -inf for the EOS and stop tokens while fewer than min_tokens tokens
                    precede the position's token in the output
  3. repetition     z[v] = z[v] / r where z[v] > 0, z[v] * r elsewhere, for v in the prompt or
                    the output (vLLM's and transformers' repetition_penalty r)
  4. frequency and presence   z[v] -= frequency * c[v] + presence * [c[v] > 0] (OpenAI's)
The logits returned are float32 for processed rows (others are returned as they came).
"""

from __future__ import annotations

import torch

from specdec.models.tokenizer import Tokenizer
from specdec.sequence import Sequence
from specdec.spec.grammar import GrammarState


class LogitsProcessors:
    """The processors of a batch's requests (SamplingParams' presence_penalty, frequency_penalty,
    repetition_penalty, logit_bias, min_tokens, allowed_token_ids, bad_words). eos_token_ids: the
    tokens min_tokens holds back (with each request's stop tokens) unless the request ignores EOS;
    tokenizer: what encodes bad words; vocab_size: the target's (a drafter's scores over another
    vocabulary are not processed)."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None = None, vocab_size: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}  # each request's words' tokens, by words

    def __call__(
        self,
        logits: torch.Tensor,
        batch: list[Sequence],
        drafts: torch.Tensor | None = None,
        on_branch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [B, T, V] at T positions per row -> the processed logits [B, T, V]. Position t
        of row b follows the row's sequence and the drafts drafts[b, s] (token ids [B, D]) for
        which on_branch[b, t, s] ([B, T, D] bool); None: no drafts (T = 1, or none counted)."""
        rows = [row for row, seq in enumerate(batch) if seq.params.processed]
        if not rows:
            return logits
        processed = logits.to(torch.float32, copy=True)
        for row in rows:
            row_drafts = drafts[row] if drafts is not None else None
            row_branch = on_branch[row] if on_branch is not None else None
            processed[row] = self._process_row(processed[row], batch[row], row_drafts, row_branch)
        return processed

    def _process_row(
        self, z: torch.Tensor, seq: Sequence, drafts: torch.Tensor | None, on_branch: torch.Tensor | None
    ) -> torch.Tensor:
        """One row's logits z [T, V] at its T positions (drafts [D], on_branch [T, D] as above)."""
        params = seq.params
        T, V = z.shape
        if drafts is None or on_branch is None:
            drafts = torch.zeros(0, dtype=torch.long, device=z.device)  # [D = 0]
            on_branch = torch.zeros(T, 0, dtype=torch.bool, device=z.device)
        paths = _paths(drafts, on_branch) if params.structured_outputs is not None or params.bad_words else []
        if params.structured_outputs is not None:
            z = z.masked_fill(~self._grammar(seq, V).masks(paths, z.device), float("-inf"))
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(V, dtype=torch.bool, device=z.device)
            allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=z.device)] = True
            z = z.masked_fill(~allowed, float("-inf"))
        if params.bad_words:
            z = self._ban_bad_words(z, seq, paths)
        if params.logit_bias:
            tokens = torch.tensor(list(params.logit_bias), dtype=torch.long, device=z.device)  # [n]
            z[:, tokens] += torch.tensor(list(params.logit_bias.values()), dtype=z.dtype, device=z.device)
        if params.min_tokens:
            generated = len(seq.output_token_ids) + on_branch.sum(-1)  # [T]: output tokens before each position's
            held = self._held_back(seq, z.device)  # [h]
            early = (generated < params.min_tokens)[:, None].expand(-1, len(held))  # [T, h]
            z[:, held] = z[:, held].masked_fill(early, float("-inf"))
        if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
            counts = self._counts(seq, drafts, on_branch, V)  # [T, V]
            if params.repetition_penalty != 1:
                seen = (counts > 0) | self._in_prompt(seq, V, z.device)[None, :]  # [T, V]
                r = params.repetition_penalty
                z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
            if params.frequency_penalty or params.presence_penalty:
                z = z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(z.dtype)
        return z

    def _counts(self, seq: Sequence, drafts: torch.Tensor, on_branch: torch.Tensor, V: int) -> torch.Tensor:
        """c [T, V]: each position's context's output token counts (the output's, then the drafts on
        its branch)."""
        output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=drafts.device)  # [L]
        counts = torch.bincount(output, minlength=V).to(torch.float32)  # [V]
        counts = counts[None, :].repeat(on_branch.shape[0], 1)  # [T, V]
        counts.scatter_add_(1, drafts[None, :].expand(on_branch.shape[0], -1), on_branch.to(torch.float32))
        return counts

    def for_chain(self, logits: torch.Tensor, batch: list[Sequence], drafts: torch.Tensor) -> torch.Tensor:
        """A chain's verify logits [B, k+1, V] after its drafts [B, k] processed (column t follows
        drafts 0..t-1), or as they came where the vocabulary is another model's."""
        if logits.shape[-1] != self.vocab_size:
            return logits
        return self(logits, batch, drafts, chain_branches(drafts))

    def for_draft(
        self, scores: torch.Tensor, batch: list[Sequence], drafted: torch.Tensor | None, scored_ids=None, vocab_size=0
    ) -> torch.Tensor:
        """A drafter's next-token scores [B, S] after its drafted tokens [B, j] (None: none yet),
        processed as the target's would be there, so that it drafts what the target may accept.
        scored_ids [S]: the vocabulary ids the scores are of (a head's), in a vocabulary of
        vocab_size; None: the whole vocabulary (S = V)."""
        if not any(seq.params.processed for seq in batch) or (vocab_size or scores.shape[-1]) != self.vocab_size:
            return scores  # nothing to do, or a drafter of another vocabulary
        B = scores.shape[0]
        logits = scores
        if scored_ids is not None:  # over the whole vocabulary, -inf where the drafter has no score
            logits = scores.new_full((B, vocab_size), float("-inf")).index_copy_(1, scored_ids, scores)  # [B, V]
        j = 0 if drafted is None else drafted.shape[1]
        drafts = drafted if drafted is not None else torch.zeros(B, 0, dtype=torch.long, device=scores.device)
        on_branch = torch.ones(B, 1, j, dtype=torch.bool, device=scores.device)  # every drafted token
        processed = self(logits[:, None], batch, drafts, on_branch)[:, 0]  # [B, V]
        return processed if scored_ids is None else processed[:, scored_ids]

    def forced_tokens(self, seq: Sequence) -> list[int]:
        """The tokens seq's grammar forces next, after its output (none where it has none)."""
        state = _followed(seq)
        return [] if state is None else state.forced()

    def num_allowed(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of tokens, drafted after seq's output, its request's grammar allows in a row
        (all where it has none, or has not sampled yet)."""
        state = _followed(seq)
        return len(tokens) if state is None else state.valid_prefix(tokens)

    def _grammar(self, seq: Sequence, vocab_size: int) -> GrammarState:
        """seq's grammar state, made at its first use, fed its output so far."""
        if seq.grammar is None:
            assert self.tokenizer is not None and seq.params.structured_outputs is not None  # prompts.py checks
            seq.grammar = GrammarState(seq.params.structured_outputs, self.tokenizer, vocab_size, self.eos_token_ids)
        state = _followed(seq)
        assert state is not None  # made above
        return state

    def _ban_bad_words(self, z: torch.Tensor, seq: Sequence, paths: list[list[int]]) -> torch.Tensor:
        """z [T, V] with each bad word's last token banned at the positions whose context's output
        (the output, then the position's path) ends with the word's other tokens."""
        for t, path in enumerate(paths):
            context = seq.output_token_ids + path
            for word in self._bad_words_ids(seq.params.bad_words):
                *head, last = word
                if not head or context[len(context) - len(head) :] == head:
                    z[t, last] = float("-inf")
        return z

    def _bad_words_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each word's tokens as the tokenizer encodes it alone and after a space (each distinct
        encoding once), cached by the request's words."""
        if words not in self._bad_words:
            assert self.tokenizer is not None  # prompts.py refuses bad_words without one
            encodings = [
                self.tokenizer.encode(text, add_special_tokens=False)
                for w in words
                for text in (w.lstrip(), " " + w.lstrip())
            ]
            self._bad_words[words] = [ids for i, ids in enumerate(encodings) if ids and ids not in encodings[:i]]
        return self._bad_words[words]

    @staticmethod
    def _in_prompt(seq: Sequence, V: int, device) -> torch.Tensor:
        """[V] bool: the tokens of seq's prompt."""
        present = torch.zeros(V, dtype=torch.bool, device=device)
        present[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=device)] = True
        return present

    def _held_back(self, seq: Sequence, device) -> torch.Tensor:
        """The tokens min_tokens holds back: the request's stop tokens, and EOS unless it ignores EOS."""
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return torch.tensor(sorted(set(eos) | set(seq.params.stop_token_ids)), dtype=torch.long, device=device)


def _followed(seq: Sequence) -> GrammarState | None:
    """seq's grammar state brought to its output (None: it has none yet)."""
    if seq.grammar is not None:
        seq.grammar.follow(seq.output_token_ids)
    return seq.grammar


def _paths(drafts: torch.Tensor, on_branch: torch.Tensor) -> list[list[int]]:
    """Each position's drafts on its branch (drafts [D], on_branch [T, D]), in column order: a
    branch's ancestors come before it."""
    draft_list = drafts.tolist()
    return [[draft_list[s] for s in row.nonzero().flatten().tolist()] for row in on_branch]


def chain_branches(drafts: torch.Tensor) -> torch.Tensor:
    """[B, k+1, k] bool: the drafts (drafts [B, k]) in each verify column's context: a chain's
    column t follows drafts 0..t-1."""
    B, D = drafts.shape
    columns = torch.arange(D + 1, device=drafts.device)  # [k+1]
    return (columns[None, :-1] < columns[:, None])[None].expand(B, -1, -1)  # [B, k+1, k]
