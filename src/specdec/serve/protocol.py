"""The OpenAI API's requests, responses and errors, as the server reads and writes them.

Requests are pydantic models (fields the API has and specdec does not implement are refused
by name, never silently ignored: see `unsupported`); responses are plain dicts in the API's
shapes, built by the functions below. Every error is one shape:
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import SamplingParams


class APIError(Exception):
    """An error the client gets as an OpenAI-style error body, with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share: the model, sampling, streaming, and
    specdec's extra num_speculative_tokens (the openai client sends it in extra_body)."""

    model_config = ConfigDict(extra="allow")  # the API grows fields; unknown ones are ignored, as vLLM does

    model: str
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
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    # in the API, not in specdec: refused when set to anything but their neutral value
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    best_of: int | None = None
    echo: bool = False
    tools: list | None = None

    def unsupported(self) -> list[str]:
        """The fields set to something specdec does not do."""
        neutral = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (0,),
                   "frequency_penalty": (0,), "logit_bias": (None, {}), "best_of": (None, 1), "echo": (False,),
                   "tools": (None, [])}
        return [name for name, allowed in neutral.items() if getattr(self, name) not in allowed]

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (a ValueError names a bad value)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                              seed=self.seed, ignore_eos=self.ignore_eos,
                              num_speculative_tokens=self.num_speculative_tokens)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as text: a list of parts keeps its text parts (other kinds are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.get("type") for part in self.content}
        if kinds - {"text"}:
            raise APIError(400, f"message content parts of type {sorted(map(str, kinds - {'text'}))} are not "
                                "supported: this server takes text", param="messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(request_id: str, model: str, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict], usage_: dict | None = None
                     ) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None) -> dict:
    """A chat.completion.chunk: one choice with delta, or (delta None) none, for the usage chunk."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def model_list(model: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "specdec",
                                        "root": model, "max_model_len": max_model_len}]}
