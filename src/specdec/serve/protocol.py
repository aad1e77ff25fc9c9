"""The OpenAI API's requests, responses and errors, as the server reads and writes them.

Requests are pydantic models (a field that would change the output and that specdec does not
do, or that it does not know, is refused by name, never silently ignored: request_fields.py);
responses are plain dicts in the API's shapes, built by the functions below. Every error is one shape:
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import MAX_N, SamplingParams, StructuredOutputsParams
from specdec.outputs import TokenLogprob
from specdec.serve import request_fields


class APIError(Exception):
    """An error the client gets as an OpenAI-style error body, with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body (APIError.body), as the schema documents it."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share: the model, sampling, streaming, and
    specdec's extra num_speculative_tokens (the openai client sends it in extra_body)."""

    model_config = ConfigDict(extra="allow")  # kept, to be refused by name or ignored (request_fields.py)
    ENDPOINT: ClassVar[str]

    model: str | None = None  # None: the served model, as vLLM takes it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after a stop string, not before it
    skip_special_tokens: bool = True  # vLLM's: False writes special tokens in the text
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token ids as JSON keys: {"50256": -100}
    min_tokens: int = 0  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top ones', in the answer
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens (-1: the context length)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:{id}"
    # vLLM's: the tokenizer adds its special tokens (a BOS) to a text prompt (None: a completion's
    # tokenizer does, a chat template writes its own)
    add_special_tokens: bool | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs (one of them)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # vLLM's: the regex of JSON's whitespace (with a JSON schema)
    structural_tag: str | dict | None = None  # vLLM's (its JSON text): free text whose tags hold JSON
    structured_outputs: dict | None = None

    def refused(self) -> list[tuple[str, str]]:
        """(field, message) for each field sent that this server refuses (request_fields.py)."""
        return request_fields.problems(self.model_dump(exclude_unset=True), type(self).model_fields, self.ENDPOINT)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (a ValueError names a bad value)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_tokens=max_tokens,
            # SamplingParams takes a string or a list and keeps a tuple
            stop=self.stop or (),  # pyright: ignore[reportArgumentType]
            stop_token_ids=self.stop_token_ids or (),  # pyright: ignore[reportArgumentType]
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.logprobs_count(),
            prompt_logprobs=self.prompt_logprobs_count(),
            num_speculative_tokens=self.num_speculative_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            structured_outputs=self._structured_outputs(),
            n=self.completions_made,
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """What the output must follow, from whichever field says it (a ValueError names a field
        that says it wrongly, or two that both do)."""
        given: dict[str, dict[str, Any]] = {
            name: value
            for name, value in (
                ("response_format", _from_response_format(self.response_format)),
                ("guided_json", None if self.guided_json is None else {"json": self.guided_json}),
                ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
                ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
                ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}),
                ("structural_tag", None if self.structural_tag is None else {"structural_tag": self.structural_tag}),
                ("structured_outputs", _from_structured_outputs(self.structured_outputs)),
            )
            if value is not None
        }
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both say what the output must follow; give one")
        if not given:
            return None
        ((name, fields),) = given.items()
        if self.guided_whitespace_pattern is not None:
            if "json" not in fields and not fields.get("json_object"):
                raise ValueError(f"guided_whitespace_pattern is JSON's whitespace; {name} asks for no JSON")
            fields = {**fields, "whitespace_pattern": self.guided_whitespace_pattern}
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def _logit_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (a ValueError names a key that is none)."""
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not key.strip().isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {bad[:3]}")
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def logprobs_count(self) -> int | None:
        """How many top tokens' logprobs to return with each token's own (None: no logprobs)."""
        return None

    @property
    def completions_made(self) -> int:
        """The completions made of each prompt (n; completions' best_of)."""
        return self.n

    def prompt_logprobs_count(self) -> int | None:
        """How many top tokens' logprobs to compute with each prompt token's own (None: none)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    ENDPOINT: ClassVar[str] = request_fields.COMPLETIONS
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # the top tokens' logprobs with each token's own
    echo: bool = False  # the prompt's text before each choice's
    suffix: str | None = None  # the text after the completion: the model fills the gap (fill in the middle)
    best_of: int | None = None  # OpenAI's: this many completions made, the n likeliest per token returned

    @property
    def completions_made(self) -> int:
        if self.best_of is None:
            return self.n
        if isinstance(self.best_of, bool) or not self.n <= self.best_of <= MAX_N:
            raise APIError(
                400, f"best_of must be an integer from n ({self.n}) to {MAX_N}, got {self.best_of!r}", param="best_of"
            )
        if self.stream and self.best_of > self.n:
            raise APIError(
                400,
                "best_of more than n cannot be streamed (OpenAI's rule); leave best_of out or stream off",
                param="best_of",
            )
        return self.best_of

    @property
    def chooses(self) -> bool:
        """Whether the answer is the n likeliest of more completions (best_of > n)."""
        return self.completions_made > self.n

    def logprobs_count(self) -> int | None:
        if self.chooses and self.logprobs is None:
            return 0  # each token's own: what a completion's likelihood is scored by
        return self.logprobs

    @property
    def echoes_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens come first in each choice's logprobs (OpenAI's)."""
        return self.echo and self.logprobs is not None

    def prompt_logprobs_count(self) -> int | None:
        counts = [count for count in (self.prompt_logprobs, self.logprobs if self.echo else None) if count is not None]
        return max(counts) if counts else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...

    role: str
    content: str | list[dict] | None = None

    def template_fields(self) -> dict:
        """The message as the chat template gets it: every field sent (name, tool_calls,
        tool_call_id, ...: a template renders those it knows, as in vLLM and transformers), the
        content as text."""
        return {**self.model_dump(exclude_none=True), "content": self.text()}

    def text(self) -> str:
        """The content as text: a list of parts keeps its text parts (other kinds are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.get("type") for part in self.content}
        if kinds - {"text"}:
            raise APIError(
                400,
                f"message content parts of type {sorted(map(str, kinds - {'text'}))} are not "
                "supported: this server takes text",
                param="messages",
            )
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(SamplingFields):
    ENDPOINT: ClassVar[str] = request_fields.CHAT
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's: the last message's content before each choice's, where it is the assistant's
    tools: list[dict] | None = None  # functions the model may call (serve/tools.py)
    tool_choice: str | dict | None = None  # none, auto (the default with tools), required, or a named function
    parallel_tool_calls: bool | None = None  # False: one call at most
    chat_template_kwargs: dict | None = None  # vLLM's: more of the chat template's variables
    documents: list[dict] | None = None  # vLLM's: the template's documents (retrieval, as transformers passes them)
    continue_final_message: bool = False  # vLLM's: the answer goes on with the last message

    def template_kwargs(self) -> dict | None:
        """The chat template's variables beyond messages and tools (chat_template_kwargs, documents)."""
        extra = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            extra["documents"] = self.documents
        return extra or None

    def echoed_text(self) -> str:
        """What echo puts before each choice's content: the last message's, where that is the
        assistant's (the reply it continues), else nothing."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == "assistant" else ""

    def logprobs_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def _from_response_format(response_format: dict | None) -> dict[str, Any] | None:
    """OpenAI's response_format as StructuredOutputsParams' fields (None: free text)."""
    kind = None if response_format is None else response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")  # pyright: ignore[reportOptionalMemberAccess]
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise ValueError(
                'response_format of type json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
            )
        return {"json": json_schema["schema"]}
    if kind == "structural_tag":  # vLLM's: {"type": "structural_tag", "structures": [...], "triggers": [...]}
        return {"structural_tag": response_format}
    raise ValueError(
        f"response_format type {kind!r} is not supported; give text, json_object, json_schema or structural_tag"
    )


STRUCTURED_OUTPUTS_FIELDS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
    "structural_tag",
    "whitespace_pattern",
)


def _from_structured_outputs(fields: dict | None) -> dict[str, Any] | None:
    """vLLM's structured_outputs as StructuredOutputsParams' fields (None: none)."""
    if not fields:
        return None
    unknown = sorted(name for name, value in fields.items() if name not in STRUCTURED_OUTPUTS_FIELDS and value)
    if unknown:
        raise ValueError(
            f"structured_outputs fields {unknown} are not supported; give one of {', '.join(STRUCTURED_OUTPUTS_FIELDS)}"
        )
    return {name: value for name, value in fields.items() if name in STRUCTURED_OUTPUTS_FIELDS}


def completion_logprobs(
    entries: list[TokenLogprob],
    token_text,
    offset: int = 0,
    prompt: tuple[list[int], list] | None = None,
    num_top: int | None = None,
) -> dict:
    """The completions API's logprobs of entries (each chosen token is also in its top
    dict, as vLLM returns it); token_text(id) is a token's text; offset: where the first
    token's text starts in the choice's text. prompt: (its token ids, their logprobs) to come
    first, from offset 0 (echo with logprobs: the first token's logprob and top are null), each
    with its num_top likeliest tokens (the request's logprobs: prompt_logprobs may have kept more)."""
    first: list[int] = []
    scored = list(entries)
    if prompt is not None:
        (ids, prompt_logprobs), offset = prompt, 0
        echoed = [dataclasses.replace(entry, top=entry.top[:num_top]) for entry in prompt_logprobs[1:]]
        first, scored = ids[:1], echoed + scored
    tokens = [token_text(token_id) for token_id in first] + [token_text(entry.token_id) for entry in scored]
    offsets = [offset + sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]
    tops = [
        {**{token_text(token_id): value for token_id, value in entry.top}, token_text(entry.token_id): entry.logprob}
        for entry in scored
    ]
    nulls: list[None] = [None] * len(first)
    return {
        "tokens": tokens,
        "token_logprobs": nulls + [entry.logprob for entry in scored],
        "top_logprobs": nulls + tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], token_text, num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each a dict of token id
    (a string, as JSON keys are) -> {logprob, rank, decoded_token}: the token's own and the
    num_top most likely ones'."""

    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    shaped: list[dict | None] = [None]
    for entry in entries[1:]:
        assert entry is not None
        top = {str(token_id): item(token_id, value, i + 1) for i, (token_id, value) in enumerate(entry.top[:num_top])}
        shaped.append({str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank), **top})
    return shaped


def chat_logprobs(entries: list[TokenLogprob], token_text) -> dict:
    """The chat API's logprobs of entries: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(token_id, value) for token_id, value in entry.top],
            }
            for entry in entries
        ]
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    request_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int
) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    request_id: str, model: str, created: int, choices: list[dict], usage_: dict | None = None
) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A chat completion's choice: the assistant's message (its tool calls, where it made any)."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(request_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict | None,
    finish_reason: str | None = None,
    usage_: dict | None = None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """A chat.completion.chunk: choice index's delta, or (delta None) no choice, for the usage chunk."""
    choices = (
        []
        if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def model_list(names: list[str], created: int, max_model_len: int, speculation: dict | None = None) -> dict:
    """The served model, once under each of its names (--served-model-name), as vLLM lists it,
    with the drafters it speculates with and why (speculation; left out where None)."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "specdec",
                "root": names[0],
                "max_model_len": max_model_len,
                **({"speculation": speculation} if speculation is not None else {}),
            }
            for name in names
        ],
    }


def lone_surrogate(value, where: str = "") -> APIError | None:
    """A 400 for the first string in value (a request's JSON: dicts, lists, strings) that holds a
    lone surrogate, else None. A surrogate (U+D800..U+DFFF) is half of a UTF-16 pair: JSON's
    "\\udc00" escape gives one alone, which is no character and cannot be encoded as UTF-8, so
    no tokenizer or chat template can take it. where: value's place in the request."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is None:
            return None
        return APIError(
            400,
            f"{where or 'the request'} is not valid text: it holds a lone surrogate "
            f"({found.group()!r}, at character {found.start()}), half of a UTF-16 pair; send text as "
            "UTF-8, or escape characters outside the Basic Multilingual Plane as both halves of their pair",
            param=where.split(".")[0].split("[")[0] or None,
        )
    if isinstance(value, dict):
        items = ((f"{where}.{key}" if where else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((error for place, item in items if (error := lone_surrogate(item, place)) is not None), None)


_SURROGATE = re.compile("[\ud800-\udfff]")
