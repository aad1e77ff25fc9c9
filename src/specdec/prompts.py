"""Prompts as checked token ids: what the engine's callers (LLM, the server's routes, a Ray Serve
ingress that holds no weights) do to a request's prompt before any work is done.

A prompt is text (encoded by the model's tokenizer), token ids, a conversation (a list of
{"role", "content"} messages rendered by the model's chat template), or the text before and
after a gap for a code model to fill (fill in the middle: the model's FIM tokens around them). The ids must lie in the
model's vocabulary, and the prompt and max_tokens must fit its context length; a ValueError
names what is wrong.
"""

from __future__ import annotations

from pathlib import Path

from specdec.config import SamplingParams, check
from specdec.models.tokenizer import Tokenizer
from specdec.spec import grammar

# the fill-in-the-middle tokens of the code model families that have them: (before the prefix, before
# the suffix, before the middle the model writes), as the prompt orders them
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
# tokens that end a middle (where the model has them): an instruct model's end of sequence is its
# chat turn's end (Qwen2.5's <|im_end|>), not what it writes after a middle (llama.cpp stops on these too)
FIM_END_TOKENS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<file_sep>", "<|end_of_text|>")


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
        self, messages: list[dict], *rendering, add_special_tokens: bool = False, **options
    ) -> list[int]:
        """One conversation rendered with the model's chat template (rendering and options:
        Tokenizer.apply_chat_template's: add_generation_prompt, the tools it may call, more of its
        variables, continue_final_message), as token ids (the template writes its own special
        tokens, so the tokenizer adds none unless add_special_tokens)."""
        tokenizer = self.need_tokenizer("chat")
        check_messages(messages)
        rendered = tokenizer.apply_chat_template(messages, *rendering, **options)
        return tokenizer.encode(rendered, add_special_tokens=add_special_tokens)

    def fill_in_the_middle_ids(self, prefix: str, suffix: str) -> list[int]:
        """The prompt of a gap between prefix and suffix for the model to fill: its FIM tokens
        (FIM_TOKENS) around them, prefix first; the model's answer is the middle (a ValueError
        where the model has no such tokens)."""
        tokenizer = self.need_tokenizer("suffix (fill in the middle)")
        for names in FIM_TOKENS:
            before_prefix, before_suffix, before_middle = (tokenizer.token_to_id(name) for name in names)
            if before_prefix is not None and before_suffix is not None and before_middle is not None:
                prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
                suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
                return [before_prefix, *prefix_ids, before_suffix, *suffix_ids, before_middle]
        raise ValueError(
            "suffix asks to fill in the middle, and this model has no fill-in-the-middle tokens "
            f"({', '.join(names[0] for names in FIM_TOKENS)}, ...); leave suffix out"
        )

    def fill_in_the_middle_stops(self) -> tuple[int, ...]:
        """The tokens that end a middle (FIM_END_TOKENS the model has): stop tokens of a gap's request."""
        tokenizer = self.need_tokenizer("suffix (fill in the middle)")
        return tuple(i for i in (tokenizer.token_to_id(name) for name in FIM_END_TOKENS) if i is not None)

    def prompt_token_ids(self, prompt, params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        """The prompt (text or token ids) as token ids, checked as generate checks a request
        with these params: a ValueError names what is wrong before any work is done.
        add_special_tokens: a text's tokenizer adds its own (a BOS) as it encodes it."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character or token id")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates, as bytes that were not UTF-8 arrive in sys.argv
                raise ValueError(
                    f"the prompt is not valid UTF-8 text (at character {e.start}); give it as UTF-8"
                ) from e
            prompt_ids = self.need_tokenizer("text prompts").encode(prompt, add_special_tokens)
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
