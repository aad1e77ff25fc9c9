"""Structured output: what a request's output must follow, enforced by llguidance.

Terms:
  grammar   llguidance's text of what the output must follow, compiled from a request's
            StructuredOutputsParams (a JSON schema, any JSON object, a regex, a choice of strings,
            a Lark or GBNF grammar)
  matcher   a grammar's state after some tokens (llguidance's LLMatcher): the tokens that may
            come next (a mask over the vocabulary; only EOS once the grammar is complete), fed
            tokens one at a time and rolled back
  path      tokens after a sequence's output that a position's distribution follows: the drafts
            on its branch (processors.py)

A sequence's matcher (GrammarState) follows its output: before each use it is brought to the
output it is given (rolled back to what it shares with what it was fed, then fed the rest), so
nothing else has to tell it what was accepted, a sequence preempted and recomputed keeps its
state, and a view of the sequence with tokens drafted after it (staged drafts) may use it too.
A position's mask is the matcher's after its path, which is then rolled back. A path the
grammar refuses somewhere (a draft it forbids) belongs to a position the verify never reaches,
since the forbidden draft has probability 0 under the masked target and is rejected first:
such a position gets no mask.
"""

from __future__ import annotations

import functools
import json

import torch

from specdec import structural_tag
from specdec.config import StructuredOutputsParams
from specdec.models.tokenizer import Tokenizer

ANY_JSON_OBJECT = {"type": "object"}
# JSON's whitespace between tokens: as much as pretty-printing takes (a newline and an indent), not
# without end. llguidance's default is any amount, which a small model can fill with spaces until
# max_tokens (seen with Qwen2.5-Coder-1.5B: benchmarks/bench_structured.py)
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for params (a ValueError names a schema that is not JSON)."""
    import llguidance

    if params.json is not None or params.json_object:
        schema = ANY_JSON_OBJECT if params.json_object else params.json
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema,  # pyright: ignore[reportArgumentType]
                defaults={"whitespace_flexible": False}
                if params.disable_any_whitespace
                else {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern or JSON_WHITESPACE},
            )
        except ValueError as e:
            raise ValueError(f"structured output's json is not a JSON schema: {e}") from None
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    if params.structural_tag is not None:
        return llguidance.grammar_from("lark", structural_tag.lark_grammar(structural_tag.parse(params.structural_tag)))
    assert params.grammar is not None  # exactly one is set (StructuredOutputsParams)
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured output's grammar is neither Lark nor GBNF: {e}") from None


def check(params: StructuredOutputsParams) -> None:
    """A ValueError that names what is wrong with params' schema, regex or grammar, if anything."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    if error:
        kinds = ("json", "regex", "choice", "grammar", "structural_tag")
        kind = next(name for name in kinds if getattr(params, name) is not None)
        raise ValueError(f"structured output's {kind} is not valid: {error}")


@functools.cache
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of the tokenizer over the model's vocabulary (about 1 s to build for
    150,000 tokens: once per tokenizer)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


class GrammarState:
    """One sequence's matcher, kept in step with its output (see the module's docstring)."""

    def __init__(self, params: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        import llguidance

        self.vocab_size = vocab_size
        self.matcher = llguidance.LLMatcher(
            _ll_tokenizer(tokenizer, vocab_size, tuple(eos_token_ids)), grammar_text(params), log_level=0
        )
        self.fed: list[int] = []  # the tokens the matcher holds

    def follow(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to output_token_ids: keep what it shares with them, feed the rest."""
        shared = len(self.fed)
        if output_token_ids[:shared] != self.fed:  # a shorter output, or another one: back to what they share
            shared = next(
                (i for i, (a, b) in enumerate(zip(self.fed, output_token_ids)) if a != b), len(output_token_ids)
            )
            self.matcher.rollback(len(self.fed) - shared)
            del self.fed[shared:]
        new = output_token_ids[shared:]
        if new:
            self.matcher.consume_tokens(new)
            self.fed.extend(new)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its fast-forward tokens; none once it is complete)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, after the output, the grammar allows in a row."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def masks(self, paths: list[list[int]], device) -> torch.Tensor:
        """[T, V] bool: the tokens allowed after each path (all where the grammar refuses the path)."""
        allowed = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for t, path in enumerate(paths):
            if self.valid_prefix(path) < len(path):
                continue  # a position after a forbidden draft: never reached
            if path:
                self.matcher.consume_tokens(path)
            allowed[t] = self._allowed()
            if path:
                self.matcher.rollback(len(path))
        return allowed.to(device)

    def _allowed(self) -> torch.Tensor:
        """[V] bool: the matcher's mask now (one bit per token, little-endian); every token where
        it allows none (a matcher past its grammar's end that was fed more: ignore_eos), so that
        a distribution is never empty."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)  # [ceil(V/32) * 4]
        bits = (packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [bytes, 8]
        allowed = bits.flatten()[: self.vocab_size].bool()  # [V]
        return allowed if bool(allowed.any()) else torch.ones_like(allowed)
