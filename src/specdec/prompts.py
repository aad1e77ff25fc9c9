"""Prompts as checked token ids: what the engine's callers (LLM, the server's routes, a Ray Serve
ingress that holds no weights) do to a request's prompt before any work is done.

A prompt is text (encoded by the model's tokenizer), token ids, or a conversation (a list of
{"role", "content"} messages rendered by the model's chat template). The ids must lie in the
model's vocabulary, and the prompt and max_tokens must fit its context length; a ValueError
names what is wrong.
"""

from __future__ import annotations

from pathlib import Path

from specdec.config import SamplingParams, check
from specdec.models.tokenizer import Tokenizer
from specdec.spec import grammar


class PromptEncoder:
    """tokenizer: the model's (None: prompts must be token ids); vocab_size and max_model_len:
    its vocabulary's size and context length."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len

    @classmethod
    def load(cls, model: str | Path) -> PromptEncoder:
        """The encoder of a model directory, GGUF file or registered name, from its tokenizer and
        config alone (no weight is read)."""
        from specdec.models.loader import load_tokenizer_and_config

        tokenizer, config = load_tokenizer_and_config(model)
        return cls(tokenizer, config.vocab_size, config.max_position_embeddings)

    def chat_token_ids(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """One conversation rendered with the model's chat template (with the tools it may call),
        as token ids (the template writes its own special tokens, so none are added)."""
        tokenizer = self.need_tokenizer("chat")
        check_messages(messages)
        return tokenizer.encode(
            tokenizer.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False
        )

    def prompt_token_ids(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt (text or token ids) as token ids, checked as generate checks a request
        with these params: a ValueError names what is wrong before any work is done."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character or token id")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates, as bytes that were not UTF-8 arrive in sys.argv
                raise ValueError(
                    f"the prompt is not valid UTF-8 text (at character {e.start}); give it as UTF-8"
                ) from e
            prompt_ids = self.need_tokenizer("text prompts").encode(prompt)
        else:
            prompt_ids = list(prompt)
        self._check(prompt_ids, params)
        if params.stop:
            self.need_tokenizer("stop strings")
        if params.bad_words:
            self.need_tokenizer("bad_words")
        if params.structured_outputs is not None:
            self.need_tokenizer("structured outputs")
            grammar.check(params.structured_outputs)
        return prompt_ids

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.vocab_size
        if not prompt_ids:
            raise ValueError("empty prompt: it encodes to no tokens; give a non-empty prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        outside = [t for t in params.stop_token_ids if t >= vocab_size]
        check(
            not outside,
            f"stop_token_ids {outside} are outside the vocabulary [0, {vocab_size}): they could never be generated",
        )
        outside = [t for t in params.logit_bias or () if t >= vocab_size]
        check(not outside, f"logit_bias names token ids {outside} outside the vocabulary [0, {vocab_size})")
        outside = [t for t in params.allowed_token_ids or () if t >= vocab_size]
        check(not outside, f"allowed_token_ids {outside} are outside the vocabulary [0, {vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} exceeds the "
                f"model's context length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )

    def need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} need a tokenizer, but this LLM was made with skip_tokenizer_init=True "
                "(or the model has none); give prompts as token ids"
            )
        return self.tokenizer


def check_messages(messages) -> None:
    """A conversation: a non-empty list of {"role": str, "content": str} dicts."""
    check(
        isinstance(messages, (list, tuple)) and len(messages) > 0,
        f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {_short(messages)}",
    )
    for i, message in enumerate(messages):
        check(
            isinstance(message, dict), f"messages[{i}] must be a dict with 'role' and 'content', got {_short(message)}"
        )
        check(
            isinstance(message.get("role"), str) and message["role"],
            f"messages[{i}] needs a 'role' (e.g. 'system', 'user', 'assistant'), got {_short(message.get('role'))}",
        )
        check(
            isinstance(message.get("content"), str),
            f"messages[{i}]['content'] must be text, got {_short(message.get('content'))}",
        )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
