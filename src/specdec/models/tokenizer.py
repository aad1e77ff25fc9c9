"""A Hugging Face tokenizer.json (through the `tokenizers` library) with the chat template and
special tokens of tokenizer_config.json. No transformers, no remote code."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer

DECODE_CONTEXT_TOKENS = 4  # prompt tokens decoded with an output so that it reads as it does after them


class Tokenizer:
    def __init__(
        self, backend: _RustTokenizer, special_tokens: dict[str, str] | None = None, chat_template: str | None = None
    ):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_template = chat_template

    @classmethod
    def from_directory(cls, path: str | Path, config: dict | None = None) -> Tokenizer:
        """tokenizer.json in path; config: the parsed tokenizer_config.json, if there is one."""
        path = Path(path)
        backend = _RustTokenizer.from_file(str(path / "tokenizer.json"))
        config = config or {}
        return cls(backend, _special_tokens(config), _chat_template(path, config))

    @classmethod
    def from_backend(cls, backend: _RustTokenizer, config: dict) -> Tokenizer:
        """A tokenizer already built (a GGUF file's), with the tokenizer_config.json fields config."""
        return cls(backend, _special_tokens(config), config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's own string in the vocabulary ("Ġthe", "<0x0A>"), as logprobs name tokens."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: the same ids, and it lets go of the GIL while it works, so a
        # long text tokenized in a thread (the server's) holds up no other
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_after(self, context_ids: list[int], token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """token_ids' text as it reads after context_ids: decoded together with the context's
        last DECODE_CONTEXT_TOKENS tokens, less their text. Decoded alone, a SentencePiece-style
        decoder (Llama 2, Mistral) strips the first token's leading space ("▁al" -> "al"). Falls
        back to decoding token_ids alone where the context's text does not end cleanly (a
        character split between the two)."""
        context = list(context_ids[-DECODE_CONTEXT_TOKENS:])
        prefix = self.decode(context, skip_special_tokens)
        text = self.decode(context + list(token_ids), skip_special_tokens)
        if prefix and not prefix.endswith("\ufffd") and text.startswith(prefix):
            return text[len(prefix) :]
        return self.decode(token_ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render a conversation with the model's own template (Jinja, sandboxed); tools: the
        functions it may call (OpenAI's tool entries), as the template's `tools`; template_kwargs:
        more of the template's variables (vLLM's chat_template_kwargs: {"enable_thinking": False},
        or documents), none of the ones set here. continue_final_message: the text ends where the
        last message's content does (what the template writes after it cut), so that the model
        goes on with that message (transformers' and vLLM's; not with add_generation_prompt)."""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message continues the last message: set add_generation_prompt false")
            return _cut_after_final_message(self.apply_chat_template(messages, False, tools, template_kwargs), messages)
        taken = sorted(
            set(template_kwargs or ()) & {"messages", "add_generation_prompt", "tools", *self.special_tokens}
        )
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken}: the request's own fields set them")
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (none in tokenizer_config.json "
                "or chat_template.jinja); pass a plain prompt instead"
            )
        try:
            return (
                _template_environment()
                .from_string(self.chat_template)
                .render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    **self.special_tokens,
                    **(template_kwargs or {}),
                )
            )
        except ValueError:  # raise_exception(): the template's own message
            raise
        except Exception as e:  # a template that does not parse, names what is undefined, loops too far, ...
            raise ValueError(
                f"the model's chat template failed ({type(e).__name__}: {e}); fix chat_template in "
                "tokenizer_config.json (or chat_template.jinja), or pass a plain prompt"
            ) from e


def _cut_after_final_message(rendered: str, messages: list[dict]) -> str:
    """rendered cut after the last message's content (its last occurrence, as transformers cuts)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # OpenAI's parts: their text
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    for text in (content, content.strip()):
        end = rendered.rfind(text)
        if end >= 0:
            return rendered[: end + len(text)]
    raise ValueError("continue_final_message: the chat template does not write the last message's content as it is")


def _special_tokens(config: dict) -> dict[str, str]:
    return {
        name: _token_text(config[name])
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if config.get(name) is not None
    }


def _chat_template(path: Path, config: dict) -> str | None:
    """The chat template, where transformers looks for it: chat_template.jinja first, else
    tokenizer_config.json's chat_template (a string, or named templates: the "default" one)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"tokenizer_config.json has named chat templates {sorted(map(str, named))} but none "
                "named 'default'; name the one to use 'default'"
            )
        template = named["default"]
    return template


def _template_environment():
    """A sandboxed Jinja environment with what chat templates written for transformers use:
    loop controls ({% break %}), tojson without HTML escaping or key sorting, strftime_now,
    raise_exception, and the {% generation %} tag (which only marks assistant text)."""
    from datetime import datetime

    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)  # the body, as is

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def train_byte_level_bpe(
    texts, vocab_size: int, special_tokens: tuple[str, ...] = ("<|endoftext|>",)
) -> _RustTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style: any text encodes, nothing is unknown)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = _RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
