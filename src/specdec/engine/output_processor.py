"""The output processor: what the engine's tokens become for the caller.

  emit        a round's tokens onto each row's sequence (append), the round counted in its stats
  append      a round's tokens, one by one, onto a sequence, stopping at EOS, a stop token, a
              stop string or max_tokens even inside an accepted run: nothing after a stop is kept.
              With min_tokens, a stop string counts only where it ends in the text of the
              min_tokens-th token or a later one (vLLM's: no stop is checked before min_tokens;
              EOS and stop tokens are masked until then: spec/processors.py)
  final_text  the output's text, cut before the first stop string
  new_output  what is new since the sequence's last RequestOutput (outputs.py): its tokens, and
              for a request streaming text, the text that more tokens can no longer change (one
              of a request's n completions: under the request's id, with its index)

Text is the output's tokens decoded as they read after the prompt (Tokenizer.decode_after).
"""

from __future__ import annotations

import time

from specdec.metrics import SpecStats
from specdec.models.tokenizer import DECODE_CONTEXT_TOKENS, Tokenizer
from specdec.outputs import CompletionOutput, RequestOutput, TokenLogprob
from specdec.sequence import Sequence
from specdec.spec.round import RoundResult


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def append(
        self, seq: Sequence, tokens: list[int], num_from_draft: int, logprobs: list[TokenLogprob] | None = None
    ) -> int:
        """Append tokens to seq until one of them finishes it; returns how many were emitted.
        The first num_from_draft tokens are accepted drafts, the rest the target's own;
        logprobs: each token's, kept with it."""
        params = seq.params
        if tokens and not seq.output_token_ids:
            seq.stats.first_token_seconds = time.perf_counter() - seq.arrival_time
        for count, token in enumerate(tokens, start=1):
            seq.output_token_ids.append(token)
            seq.output_from_draft.append(count <= num_from_draft)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[count - 1])
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif params.stop and self._stop_string_ends_now(seq):
                seq.finish_reason = "stop"
            elif seq.remaining_tokens <= 0:
                seq.finish_reason = "length"
            if seq.finished:
                return count
        return len(tokens)

    def emit(self, batch: list[Sequence], result: RoundResult, totals: SpecStats, timings: dict[str, float]) -> None:
        """A round's (or a prefill's) new tokens appended to each row's sequence (append), the
        round counted in the sequence's stats and in totals, its parts' seconds added to timings
        (and this bookkeeping's, as "bookkeeping")."""
        start = time.perf_counter()
        for row, seq in enumerate(batch):
            if not result.tokens[row]:  # a prefill under way
                continue
            forced = result.num_forced[row] if result.num_forced else 0
            emitted = self.append(
                seq, result.tokens[row], forced + result.num_accepted[row], logprobs=result.logprobs[row]
            )
            for stats in (seq.stats, totals):
                stats.record_round(
                    result.num_proposed[row],
                    result.num_accepted[row],
                    emitted,
                    k=result.ks[row],
                    depth=result.tree_depths[row],
                    num_forced=forced,
                )
        for part, seconds in result.seconds.items():
            timings[part] += seconds
        timings["bookkeeping"] += time.perf_counter() - start

    def new_output(self, seq: Sequence) -> RequestOutput | None:
        """What is new in seq since its last RequestOutput (None: nothing): its new tokens, and,
        if it streams text, the new text that can no longer change (held back: an unfinished
        character, and a tail that may be the start of a stop string); all of its text once it
        finishes."""
        new_token_ids = seq.output_token_ids[seq.num_tokens_reported :]
        from_draft = seq.output_from_draft[seq.num_tokens_reported :]
        logprobs = seq.output_logprobs[seq.num_tokens_reported :] if seq.params.logprobs is not None else None
        if not new_token_ids and not seq.finished:
            return None
        seq.num_tokens_reported = len(seq.output_token_ids)
        text = (
            seq.text
            if seq.finished
            else (_settled_text(self._output_text(seq), seq.params.stop) if seq.stream_text else seq.text_reported)
        )
        new_text = text[len(seq.text_reported) :] if text.startswith(seq.text_reported) else ""
        seq.text_reported += new_text
        completion = CompletionOutput(seq.index, new_text, new_token_ids, seq.finish_reason, from_draft, logprobs)
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_reported:
            prompt_logprobs, seq.prompt_logprobs_reported = list(seq.prompt_logprobs), True
        return RequestOutput(
            seq.output_request_id,
            seq.prompt,
            seq.prompt_token_ids,
            [completion],
            seq.stats,
            finished=seq.finished,
            prompt_logprobs=prompt_logprobs,
        )

    def finish(self, seq: Sequence) -> None:
        """A sequence out of the batch (finished or aborted): its time taken, its final text."""
        seq.stats.seconds = time.perf_counter() - seq.arrival_time
        seq.text = self.final_text(seq)

    def final_text(self, seq: Sequence) -> str:
        """The decoded output, cut before the first stop string that counts (min_tokens)."""
        text = self._output_text(seq)
        span = _stop_string_span(text, seq.params.stop, self._held_chars(seq))
        if span is None:
            return text
        return text[: span[1]] if seq.params.include_stop_str_in_output else text[: span[0]]

    def _stop_string_ends_now(self, seq: Sequence) -> bool:
        """Whether a stop string that counts ends in the output's text (checked after each token:
        one that ended earlier would have stopped it, unless min_tokens held it)."""
        min_tokens, stops = seq.params.min_tokens, seq.params.stop
        if len(seq.output_token_ids) < min_tokens:
            return False
        if (
            min_tokens and len(seq.output_token_ids) - _stop_window(stops) < min_tokens - 1
        ):  # the tail reaches back before it
            return _stop_string_index(self._output_text(seq), stops, self._held_chars(seq)) is not None
        return _stop_string_index(self._tail_text(seq), stops) is not None

    def _held_chars(self, seq: Sequence) -> int:
        """The length of the text before the min_tokens-th token's: no stop string ends in it."""
        if seq.params.min_tokens <= 1 or self.tokenizer is None:
            return 0
        return len(
            self.tokenizer.decode_after(
                seq.prompt_token_ids, seq.output_token_ids[: seq.params.min_tokens - 1], seq.params.skip_special_tokens
            )
        )

    def _tail_text(self, seq: Sequence) -> str:
        """The text of the output's last tokens, enough to hold any stop string that the last one
        completed (an earlier one would have stopped the output before): a character takes at most
        4 bytes, and every token at least one, so 4 x the longest stop string + 1 tokens. Checking
        stop strings in this tail, not the whole output, keeps the check per token constant."""
        window = _stop_window(seq.params.stop)
        if len(seq.output_token_ids) <= window or self.tokenizer is None:
            return self._output_text(seq)
        before = seq.output_token_ids[-window - DECODE_CONTEXT_TOKENS : -window]  # what the tail reads after
        return self.tokenizer.decode_after(before, seq.output_token_ids[-window:], seq.params.skip_special_tokens)

    def _output_text(self, seq: Sequence) -> str:
        """The output's text as it reads after the prompt (Tokenizer.decode_after)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode_after(seq.prompt_token_ids, seq.output_token_ids, seq.params.skip_special_tokens)


def _stop_window(stops: tuple[str, ...]) -> int:
    """The output's last tokens that hold any stop string the last one completed (_tail_text)."""
    return 4 * max(len(stop) for stop in stops) + 1


def _settled_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running request's text that more tokens cannot change: less an unfinished
    UTF-8 character (decoded as U+FFFD) and less the longest tail that begins a stop string."""
    text = text.rstrip("\ufffd")
    hold = max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
    return text[: len(text) - hold]


def _stop_string_index(text: str, stops: tuple[str, ...], min_end: int = 0) -> int | None:
    """Where the first of the stop strings that end past min_end characters starts in text, or None."""
    span = _stop_string_span(text, stops, min_end)
    return None if span is None else span[0]


def _stop_string_span(text: str, stops: tuple[str, ...], min_end: int = 0) -> tuple[int, int] | None:
    """(start, end) in text of the first of the stop strings that end past min_end characters (of
    two starting there, the shorter), or None."""
    found = [(i, i + len(stop)) for stop in stops if (i := text.find(stop, max(0, min_end - len(stop) + 1))) >= 0]
    return min(found) if found else None
