"""The OpenAI-compatible HTTP server's routes, on FastAPI.

    GET  /v1/models             the served model
    POST /v1/completions        text completion (one prompt or a list: one choice each)
    POST /v1/chat/completions   chat, rendered with the model's chat template
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus text (prom.py)

With an API key, every route but /health and /metrics asks for it (middleware.py); a body over
the size limit is a 413 before it is read (middleware.BodyLimit). Prompts are tokenized in a
thread, so that a long one holds up no other client.

`stream: true` answers with Server-Sent Events, one chunk per engine step that brought new
text, then (with stream_options.include_usage) a usage chunk, then `data: [DONE]`. Errors
answer in OpenAI's shape (protocol.APIError), from validation to a full queue (429 with
Retry-After) and a model this server does not serve (404 model_not_found); nothing a request
sends stops the server. After SIGTERM the server drains (server.py): a new request gets a 503
shutting_down, /health included, while those in flight finish; past --shutdown-timeout the engine
stops, and a request still running gets a 503, a stream an error event and then `data: [DONE]`.

A client that closes its connection has its requests aborted at once, wherever they are: waiting
for a slot (never prefilled), in the step that prefills them, or decoding; the engine drops
them at its next step (_unless_client_leaves, AsyncEngine.generate).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import SamplingParams
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.serve.async_engine import AsyncEngine, EngineStopped, QueueFull
from specdec.serve.middleware import KEY_INDEX, APIKeyCheck, BodyLimit, Drain, DrainGate
from specdec.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    SamplingFields,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    lone_surrogate,
    model_list,
    new_id,
    usage,
    vllm_prompt_logprobs,
)
from specdec.serve.tools import (
    ToolChoice,
    ToolError,
    format_for,
    template_messages,
    tool_choice_from,
)

log = logging.getLogger("specdec")
T = TypeVar("T")

RETRY_AFTER_SECONDS = 1
ERRORS = {  # every status an error comes with, as the schema documents it (body: ErrorResponse)
    400: "the request is not valid: the message names the field",
    401: "the API key is missing or wrong (a server started with --api-key)",
    404: "the model is not served here (model_not_found)",
    413: "the body is over --max-request-bytes (request_too_large)",
    429: "the queue is full (queue_full): retry after Retry-After seconds",
    500: "the engine failed on this request (the server goes on)",
    503: "the server is shutting down (shutting_down)",
}
GENERATED = {  # a completion's 200: whole, or streamed
    "description": "the completion (application/json), or with stream: true its Server-Sent Events, "
    "ending in data: [DONE] (text/event-stream)",
    "content": {"application/json": {}, "text/event-stream": {}},
}
DEFAULT_MAX_REQUEST_BYTES = 2_000_000  # TGI's --payload-limit; commands.py raises it for long contexts


@dataclass
class ServerState:
    """What the routes serve. served_names: the model's names in the API (--served-model-name),
    the first the one responses carry; a request may name any of them. async_engine: what runs
    the requests (an AsyncEngine, or ray_serve.ReplicaClient: its generate, start, stop,
    is_running and llm, whose tokenizer the routes use); metrics_text: what /metrics answers
    (default: async_engine.metrics' registry); speculation: the drafters and why, for
    /v1/models (settings.speculation); drain: whether the server drains after SIGTERM, and
    how many requests are in flight (server.Server sets it, middleware.DrainGate reads it).
    api_keys: the keys a client may send (none: an open server); suffix_cache_scope: "key" (the
    requests of one key draft from each other's answers alone, Sequence.cache_scope) or
    "global" (every request from every other's)."""

    async_engine: AsyncEngine
    served_names: list[str]
    max_model_len: int
    api_keys: tuple[str, ...] = ()
    suffix_cache_scope: str = "key"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    created: int = 0
    metrics_text: Callable[[], Awaitable[bytes]] | None = None
    drain: Drain = field(default_factory=Drain)
    speculation: dict | None = None  # what /v1/models says of the drafters (settings.speculation)
    tool_call_parser: str = "auto"  # --tool-call-parser: a tools.TOOL_FORMATS name, or auto (the chat template's)

    @property
    def llm(self):
        return self.async_engine.llm

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def tool_format(self) -> str:
        """The format the model writes tool calls in (tools.py)."""
        if self.tool_call_parser != "auto":
            return self.tool_call_parser
        tokenizer = self.llm.tokenizer
        return format_for(None if tokenizer is None else tokenizer.chat_template)

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its string in the vocabulary ("Ġthe", as vLLM returns it:
        one string per token, where decoded text can give several tokens the same one)."""
        tokenizer = self.llm.tokenizer
        token = tokenizer.id_to_token(token_id) if tokenizer is not None else None
        return token if token is not None else f"<id {token_id}>"


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()
        yield
        await state.async_engine.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    state.created = state.created or int(time.time())
    _add_error_handlers(app)
    _document_errors_as_sent(app)

    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    app.add_middleware(DrainGate, drain=state.drain)
    if state.api_keys:  # added last, so it runs first: no key, no body read
        app.add_middleware(APIKeyCheck, api_keys=state.api_keys)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "the engine runs"},
            503: {"description": "the engine has stopped"},
            **_errors(413),
        },
    )
    async def health() -> Response:
        return Response(status_code=200 if state.async_engine.is_running else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}, **_errors(413)},
    )
    async def metrics() -> Response:
        if state.metrics_text is not None:
            return Response(await state.metrics_text(), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.async_engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_errors(401, 413))
    async def models() -> dict:
        return model_list(state.served_names, state.created, state.max_model_len, state.speculation)

    @app.post("/v1/completions", responses={200: GENERATED, **_errors(*ERRORS)})
    async def completions(body: CompletionRequest, raw: Request):
        return await _unless_client_leaves(raw, _complete(state, body, _cache_scope(state, raw)))

    @app.post("/v1/chat/completions", responses={200: GENERATED, **_errors(*ERRORS)})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await _unless_client_leaves(raw, _chat(state, body, _cache_scope(state, raw)))

    return app


# --- checking requests -------------------------------------------------------------------------------


def _check_common(state: ServerState, body: SamplingFields) -> None:
    if body.model is not None and body.model not in state.served_names:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist here; this server serves "
            f"{' or '.join(map(repr, state.served_names))} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    bad_text = lone_surrogate(body.model_dump())
    if bad_text is not None:
        raise bad_text
    refused = body.refused()
    if refused:
        raise APIError(400, "; ".join(message for _, message in refused), param=refused[0][0])


def _prompt_list(prompt) -> list:
    """The completions prompt as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give text, token ids, or a list of them", param="prompt")
    return list(prompt)


def _prepare(state: ServerState, body: SamplingFields, prompt, max_tokens: int | None, tools: ToolChoice | None = None):
    """(prompt, its token ids, SamplingParams) for one prompt of the request; max_tokens None:
    as many as the context leaves; tools: the calls the answer may make (their grammar its
    structured output). Bad values raise a 400 that names them. It tokenizes (a long prompt
    takes seconds): the routes run it in a thread."""
    add_special_tokens = body.add_special_tokens is not False  # a completion's text: by default
    try:
        tokens = prompt  # the prompt, as text or as token ids once tokenized
        if max_tokens is None:
            ids = state.llm.prompt_token_ids(prompt, body.sampling_params(1), add_special_tokens)
            tokens = _truncated(state, body, ids)
            max_tokens = max(1, state.max_model_len - len(tokens))
        params = body.sampling_params(max_tokens)
        if tools is not None:
            params = _with_tools(params, tools, state.llm.tokenizer)
        prompt_ids = _truncated(state, body, state.llm.prompt_token_ids(tokens, params, add_special_tokens))
    except ValueError as e:
        raise APIError(400, str(e), param=_named_field(str(e), body)) from None
    if len(prompt_ids) + params.max_tokens > state.max_model_len:
        raise APIError(
            400,
            f"the prompt's {len(prompt_ids)} tokens + max_tokens={params.max_tokens} exceed this "
            f"server's context length of {state.max_model_len} tokens; shorten the prompt or lower "
            "max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return prompt, prompt_ids, params


def _token_text(state: ServerState, body: SamplingFields) -> Callable[[int], str]:
    """How the answer's logprobs name a token: its string in the vocabulary (ServerState.token_text),
    or with vLLM's return_tokens_as_token_ids "token_id:{id}" (text that does not decode alone)."""
    if body.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return state.token_text


def _truncated(state: ServerState, body: SamplingFields, prompt_ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context length's worth)."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompt_ids
    if isinstance(k, bool) or not (k >= 1 or k == -1):
        raise APIError(
            400, f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}", param="truncate_prompt_tokens"
        )
    return prompt_ids[-(state.max_model_len if k == -1 else k) :]


def _token_ids(parts: list[CompletionOutput]) -> list[int]:
    """A completion's token ids, its parts' joined."""
    return [token for part in parts for token in part.token_ids]


def _with_token_ids(body: SamplingFields, answer: dict, **token_ids) -> dict:
    """answer with vLLM's token id fields (prompt_token_ids, token_ids) where return_token_ids asks."""
    return {**answer, **token_ids} if body.return_token_ids else answer


def _with_tools(params: SamplingParams, tools: ToolChoice, tokenizer) -> SamplingParams:
    """params with the tools' grammar as their structured output (a ValueError where the request
    says what the output must follow twice)."""
    structured = tools.structured_outputs(tokenizer)
    if structured is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError(
            "tools and response_format (or guided_*, structured_outputs) both say what the output must "
            "follow; give one, or tool_choice none"
        )
    return dataclasses.replace(params, structured_outputs=structured)


def _chat_token_ids(
    state: ServerState, body: ChatCompletionRequest, messages: list[dict], tools: list[dict] | None = None
) -> list[int]:
    try:
        return state.llm.chat_token_ids(
            template_messages(messages),
            body.add_generation_prompt,
            tools,
            template_kwargs=body.template_kwargs(),
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
        )
    except ValueError as e:
        named = [name for name in ("chat_template_kwargs", "continue_final_message") if name in str(e)]
        field = e.field if isinstance(e, ToolError) else named[0] if named else "messages"
        raise APIError(400, str(e), param=field) from None


def _named_field(message: str, body: SamplingFields) -> str | None:
    """The request field a validation message starts with, if any ("temperature must be ...")."""
    first = message.split(" ", 1)[0].rstrip(":,")
    return first if first in type(body).model_fields else None


# --- running requests ---------------------------------------------------------------------------------


def _cache_scope(state: ServerState, raw: Request) -> str | None:
    """The request's cache scope (Sequence.cache_scope): under --suffix-cache-scope key, the
    index of the API key it sent ("key0", ...; never the key); else None, the one global scope."""
    index = raw.scope.get(KEY_INDEX)
    return f"key{index}" if state.suffix_cache_scope == "key" and index is not None else None


async def _complete(state: ServerState, body: CompletionRequest, cache_scope: str | None = None):
    """A completion: its prompts tokenized (in a thread), run, and answered whole or as a stream
    (which starts once every prompt has its first output, so that a refusal is still a status).
    Prompt i's completion j (of n) is choice i x n + j, as in vLLM. echo with max_tokens 0 (vLLM's,
    lm-evaluation-harness's scoring): the prompt alone, with its logprobs where asked (one token
    is generated and left out)."""
    _check_common(state, body)
    prompts = _prompt_list(body.prompt)
    prompt_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if prompt_only else body.max_tokens
    texts = prompts  # what echo returns: the prompts as sent
    if body.suffix:  # fill in the middle: each prompt the text before the gap
        prompts = [await asyncio.to_thread(_gap_prompt, state, prompt, body.suffix) for prompt in prompts]
    requests = [await asyncio.to_thread(_prepare, state, body, prompt, max_tokens) for prompt in prompts]
    if body.suffix:  # the middle ends where the model ends it (FIM_END_TOKENS), besides the request's stops
        stops = state.llm.fill_in_the_middle_stops()
        requests = [
            (prompt, ids, dataclasses.replace(params, stop_token_ids=params.stop_token_ids + stops))
            for prompt, ids, params in requests
        ]
    echoes = [_echo_text(state, text, ids) if body.echo else "" for text, (_, ids, _) in zip(texts, requests)]
    request_id = new_id("cmpl")
    streams = [
        state.async_engine.generate(
            f"{request_id}-{i}",
            ids,
            params,
            prompt if isinstance(prompt, str) else None,
            stream_text=body.stream,
            cache_scope=cache_scope,
        )
        for i, (prompt, ids, params) in enumerate(requests)
    ]
    firsts = await _first_outputs(streams)
    prompt_tokens = sum(len(ids) for _, ids, _ in requests)
    prompt_ids = [ids for _, ids, _ in requests]
    if body.stream and not prompt_only:
        return _sse(_completion_events(state, request_id, body, streams, firsts, prompt_ids, echoes))
    outputs = await _until_finished(streams, firsts)
    if prompt_only:
        return _prompts_alone(state, request_id, body, outputs, prompt_ids, echoes)
    choices = []
    for i, outs in enumerate(outputs):
        prompt_logprobs = _prompt_logprobs(outs)
        echoed = (prompt_ids[i], prompt_logprobs) if body.echoes_logprobs and prompt_logprobs is not None else None
        completions = _completions(outs, body.completions_made)
        if body.chooses:
            completions = _likeliest(completions, body.n, keep_logprobs=body.logprobs is not None)
        for j, parts in enumerate(completions):
            logprobs = _joined_logprobs(
                parts,
                functools.partial(
                    completion_logprobs, token_text=_token_text(state, body), prompt=echoed, num_top=body.logprobs
                ),
            )
            choice = completion_choice(
                i * body.n + j, echoes[i] + "".join(part.text for part in parts), parts[-1].finish_reason, logprobs
            )
            choice = _with_token_ids(body, choice, prompt_token_ids=prompt_ids[i], token_ids=_token_ids(parts))
            choices.append(_with_prompt_logprobs(state, body, choice, prompt_logprobs))
    return completion_response(request_id, state.model_name, choices, prompt_tokens, _num_tokens(outputs))


def _gap_prompt(state: ServerState, prompt, suffix: str) -> list[int]:
    """A completion prompt and suffix as the model's fill-in-the-middle prompt (a 400 names suffix
    where the prompt is not text or the model has no FIM tokens)."""
    if not isinstance(prompt, str):
        raise APIError(400, "suffix needs the prompt as text (the code before the gap), not token ids", param="suffix")
    try:
        return state.llm.fill_in_the_middle_ids(prompt, suffix)
    except ValueError as e:
        raise APIError(400, str(e), param="suffix") from None


def _prompts_alone(state: ServerState, request_id: str, body: CompletionRequest, outputs, prompt_ids, echoes):
    """echo with max_tokens 0: each choice the prompt's text (and the prompt's logprobs), finish
    reason length, no completion tokens; as one chunk a choice, then [DONE], where streamed."""
    choices = []
    for i, outs in enumerate(outputs):
        prompt_logprobs = _prompt_logprobs(outs)
        logprobs = None
        if body.echoes_logprobs and prompt_logprobs is not None:
            logprobs = completion_logprobs(
                [], _token_text(state, body), 0, (prompt_ids[i], prompt_logprobs), body.logprobs
            )
        for j in range(body.n):
            choice = completion_choice(i * body.n + j, echoes[i], "length", logprobs)
            choices.append(_with_prompt_logprobs(state, body, choice, prompt_logprobs))
    prompt_tokens = sum(map(len, prompt_ids))
    if not body.stream:
        return completion_response(request_id, state.model_name, choices, prompt_tokens, 0)

    async def events():
        created = int(time.time())
        for choice in choices:
            yield completion_chunk(request_id, state.model_name, created, [choice])
        if body.include_usage:
            yield completion_chunk(request_id, state.model_name, created, [], usage(prompt_tokens, 0))

    return _sse(events())


def _likeliest(completions: list[list[CompletionOutput]], n: int, keep_logprobs: bool) -> list[list[CompletionOutput]]:
    """best_of: the n completions of the highest log-probability per token (OpenAI's "best"), the
    likeliest first; their logprobs dropped where the request did not ask for them."""

    def per_token(parts: list[CompletionOutput]) -> float:
        entries = [entry for part in parts for entry in part.logprobs or ()]
        return sum(entry.logprob for entry in entries) / len(entries) if entries else float("-inf")

    chosen = sorted(completions, key=per_token, reverse=True)[:n]
    if keep_logprobs:
        return chosen
    return [[dataclasses.replace(part, logprobs=None) for part in parts] for parts in chosen]


def _prompt_logprobs(outputs: list[RequestOutput]) -> list | None:
    """A request's prompt logprobs: in the first of its outputs that has them (None: not asked)."""
    return next((output.prompt_logprobs for output in outputs if output.prompt_logprobs is not None), None)


def _with_prompt_logprobs(state: ServerState, body, answer: dict, prompt_logprobs: list | None) -> dict:
    """answer (a completion's choice, a chat response or chunk) with vLLM's prompt_logprobs field
    where the request asked for it (body.prompt_logprobs) and they are known."""
    if body.prompt_logprobs is not None and prompt_logprobs is not None:
        answer["prompt_logprobs"] = vllm_prompt_logprobs(
            prompt_logprobs, _token_text(state, body), body.prompt_logprobs
        )
    return answer


async def _chat(state: ServerState, body: ChatCompletionRequest, cache_scope: str | None = None):
    """A chat completion: its messages rendered (with its tools) and tokenized (in a thread), run,
    and answered whole or as a stream (which starts once the first output is there)."""
    _check_common(state, body)
    try:
        tools = tool_choice_from(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_format)
    except ToolError as e:
        raise APIError(400, str(e), param=e.field) from None
    messages = [m.template_fields() for m in body.messages]
    rendered = None if tools is None else tools.template_tools
    prompt_ids = await asyncio.to_thread(_chat_token_ids, state, body, messages, rendered)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    _, ids, params = await asyncio.to_thread(_prepare, state, body, prompt_ids, max_tokens, tools)
    request_id = new_id("chatcmpl")
    stream = state.async_engine.generate(request_id, ids, params, stream_text=body.stream, cache_scope=cache_scope)
    (first,) = await _first_outputs([stream])
    echo = body.echoed_text()
    if body.stream:
        return _sse(_chat_events(state, request_id, body, stream, first, ids, echo, tools))
    (outputs,) = await _until_finished([stream], [first])
    choices = [
        _with_token_ids(
            body,
            _chat_choice(_token_text(state, body), j, echo + "".join(part.text for part in parts), parts, tools),
            token_ids=_token_ids(parts),
        )
        for j, parts in enumerate(_completions(outputs, body.n))
    ]
    answer = chat_response(request_id, state.model_name, choices, len(ids), _num_tokens([outputs]))
    answer = _with_token_ids(body, answer, prompt_token_ids=ids)
    return _with_prompt_logprobs(state, body, answer, _prompt_logprobs(outputs))


def _chat_choice(token_text, index: int, text: str, parts: list[CompletionOutput], tools) -> dict:
    """A whole chat choice: its text, or with tools, its content and tool calls (tools.py)."""
    logprobs = _joined_logprobs(parts, lambda entries: chat_logprobs(entries, token_text))
    reason = parts[-1].finish_reason
    if tools is None or tools.mode == "none":
        return chat_choice(index, text, reason, logprobs)
    content, calls = tools.parse(text)
    return chat_choice(index, content, tools.finish_reason(reason, bool(calls)), logprobs, calls)


def _echo_text(state: ServerState, prompt, prompt_ids: list[int]) -> str:
    """A completion prompt's text, as echo returns it before the completion (token ids decoded)."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = state.llm.tokenizer
    return "" if tokenizer is None else tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _completions(outputs: list[RequestOutput], n: int) -> list[list[CompletionOutput]]:
    """A request's outputs as each of its n completions' parts, in order."""
    parts: list[list[CompletionOutput]] = [[] for _ in range(n)]
    for output in outputs:
        for completion in output.outputs:
            parts[completion.index].append(completion)
    return parts


def _num_tokens(outputs: list[list[RequestOutput]]) -> int:
    """The tokens generated in every completion of these requests' outputs."""
    return sum(len(part.token_ids) for outs in outputs for output in outs for part in output.outputs)


async def _unless_client_leaves(raw: Request, work: Awaitable[T]) -> T:
    """work's result, unless the client closes the connection first: then work is cancelled, which
    closes its requests' streams and so aborts them in the engine wherever they are (waiting for
    a slot, in the step that prefills them, decoding: AsyncEngine.generate), and the answer is a
    499 that nobody reads. A stream's response, once returned, is watched by Starlette's
    StreamingResponse itself, which ends the stream (and so the requests) when the client leaves."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_client_left(raw))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel([left, task])  # task: still running only if the client left (or this route was cancelled)
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _client_left(raw: Request) -> None:
    """Returns once the client has closed the connection: the server's http.disconnect message.
    The body is read before a route runs, so receive() has nothing else to give (an empty
    http.request at most, which is passed over)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _first_outputs(streams: list[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """Each stream's first output: a request the engine refuses, or a full queue, fails here,
    before any response is sent (the other streams are closed, which aborts them)."""
    results = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
    errors = [result for result in results if isinstance(result, BaseException)]
    if not errors:
        return cast("list[RequestOutput]", results)
    for stream in streams:
        await stream.aclose()
    raise _told(errors[0])


def _told(error: BaseException) -> BaseException:
    """The error to raise for one a request's stream raised: as the client is told of it
    (_api_error), or as it is where it is no Exception (a cancellation)."""
    return _api_error(error) if isinstance(error, Exception) else error


def _api_error(error: Exception) -> APIError:
    """What the client is told of an error a request's stream raised (AsyncEngine.generate): a
    full queue is a 429, a stopping engine a 503, a refused request a 400, a failed step or
    anything unforeseen a 500 (logged, with its traceback)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFull):
        return APIError(
            429,
            str(error),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), type="server_error", code="shutting_down")
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    if isinstance(error, RuntimeError):  # AsyncEngine's word for a failed step (logged there)
        return APIError(500, str(error), type="server_error")
    log.error("a request failed", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")


async def _until_finished(streams, firsts: list[RequestOutput]) -> list[list[RequestOutput]]:
    """Every output of every stream (each list starting with its first). A client that leaves
    meanwhile cancels this (_unless_client_leaves), and with it the requests."""

    async def rest(stream, first):
        outputs = [first]
        if not first.finished:
            outputs += [output async for output in stream]
        return outputs

    tasks = [asyncio.ensure_future(rest(stream, first)) for stream, first in zip(streams, firsts)]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception as e:
        raise _told(e) from None
    finally:
        await _cancel(tasks)  # the others, where one failed
        for stream in streams:
            await stream.aclose()


def _joined_logprobs(parts: list[CompletionOutput], shape) -> dict | None:
    """The logprobs of a completion's parts, all of them, in the API's shape (shape(entries));
    None where the request asked for none."""
    if parts[0].logprobs is None:
        return None
    return shape([entry for part in parts for entry in part.logprobs or ()])


async def _cancel(tasks) -> None:
    """Cancel tasks and wait until they have unwound (a stream a task iterates can then be closed)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(streams, firsts) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(index, output) from every stream as they come, each stream's first output first."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as e:  # the engine failed, or is stopping: the client hears of it
            await queue.put((index, e))
        await queue.put((index, done))

    for index, first in enumerate(firsts):
        yield index, first
    tasks = [asyncio.ensure_future(pump(i, s)) for i, (s, f) in enumerate(zip(streams, firsts)) if not f.finished]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        await _cancel(tasks)
        for stream in streams:
            await stream.aclose()


# --- streaming responses --------------------------------------------------------------------------------


def _sse(events: AsyncGenerator[dict, None]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # the engine failed or is stopping: an error event, then [DONE]
            yield f"data: {json.dumps(_api_error(e).body())}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_events(
    state: ServerState,
    request_id: str,
    body: CompletionRequest,
    streams,
    firsts,
    prompt_ids: list[list[int]],
    echoes: list[str],
) -> AsyncGenerator[dict, None]:
    """Prompt i's completion j is choice i x n + j; an echoed prompt comes before its first text
    (and, echo with logprobs, its tokens before the first logprobs: the prompt's logprobs come
    in a request's first output, before any completion's first tokens)."""
    created, completion_tokens = int(time.time()), 0
    text_offsets: dict[int, int] = {}  # where each choice's next text starts, for logprobs' text_offset
    prompt_logprobs: dict[int, list] = {}  # prompt index -> its logprobs, once they came
    async with contextlib.aclosing(_merged(streams, firsts)) as outputs:
        async for prompt_index, output in outputs:
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                first = index not in text_offsets
                text = echoes[prompt_index] + completion.text if first else completion.text
                offset = text_offsets.get(index, len(echoes[prompt_index]))
                completion_tokens += len(completion.token_ids)
                logprobs, echoed = None, None
                if first and body.echoes_logprobs and prompt_index in prompt_logprobs:
                    echoed = (prompt_ids[prompt_index], prompt_logprobs[prompt_index])
                if completion.logprobs is not None:
                    logprobs = completion_logprobs(
                        completion.logprobs, _token_text(state, body), offset, echoed, body.logprobs
                    )
                text_offsets[index] = offset + len(completion.text)
                with_ids = completion.token_ids and (logprobs is not None or body.return_token_ids)
                if text or completion.finish_reason or with_ids:
                    choice = completion_choice(index, text, completion.finish_reason, logprobs)
                    choice = _with_token_ids(body, choice, token_ids=completion.token_ids)
                    if first:
                        choice = _with_token_ids(body, choice, prompt_token_ids=prompt_ids[prompt_index])
                        choice = _with_prompt_logprobs(state, body, choice, prompt_logprobs.get(prompt_index))
                    yield completion_chunk(request_id, state.model_name, created, [choice])
    if body.include_usage:
        prompt_tokens = sum(map(len, prompt_ids))
        yield completion_chunk(request_id, state.model_name, created, [], usage(prompt_tokens, completion_tokens))


async def _chat_events(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    stream,
    first,
    prompt_ids: list[int],
    echo: str,
    tools: ToolChoice | None = None,
) -> AsyncGenerator[dict, None]:
    """Each of the n choices: its role (with the echoed message, if any), its text as it comes
    (with tools: its content, then each tool call whole: tools.ToolCallStream), then its finish
    reason."""
    created, completion_tokens = int(time.time()), 0
    calls = [tools.stream() for _ in range(body.n)] if tools is not None and tools.mode != "none" else None
    for index in range(body.n):
        chunk = chat_chunk(request_id, state.model_name, created, {"role": "assistant", "content": echo}, index=index)
        if index == 0:
            chunk = _with_token_ids(body, chunk, prompt_token_ids=prompt_ids)
            chunk = _with_prompt_logprobs(state, body, chunk, first.prompt_logprobs)
        yield chunk
    async with contextlib.aclosing(_merged([stream], [first])) as outputs:
        async for _, output in outputs:
            for completion in output.outputs:
                index, reason = completion.index, completion.finish_reason
                completion_tokens += len(completion.token_ids)
                logprobs = None
                if completion.logprobs:
                    logprobs = chat_logprobs(completion.logprobs, _token_text(state, body))
                if calls is not None:
                    for delta in calls[index].feed(completion.text, final=reason is not None):
                        yield chat_chunk(request_id, state.model_name, created, delta, index=index)
                    reason = tools.finish_reason(reason, calls[index].num_calls > 0)  # pyright: ignore[reportOptionalMemberAccess]
                    if logprobs is not None:
                        yield chat_chunk(request_id, state.model_name, created, {}, logprobs=logprobs, index=index)
                elif completion.text or logprobs is not None or (body.return_token_ids and completion.token_ids):
                    delta = {"content": completion.text}
                    chunk = chat_chunk(request_id, state.model_name, created, delta, logprobs=logprobs, index=index)
                    if body.return_token_ids:
                        chunk["choices"][0]["token_ids"] = completion.token_ids
                    yield chunk
                if reason:
                    yield chat_chunk(request_id, state.model_name, created, {}, reason, index=index)
    if body.include_usage:
        yield chat_chunk(request_id, state.model_name, created, None, usage_=usage(len(prompt_ids), completion_tokens))


# --- errors ---------------------------------------------------------------------------------------------


def _errors(*statuses: int) -> dict:
    """The schema's entries for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


def _document_errors_as_sent(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body; this server answers a request that
    does not validate with a 400 (as OpenAI does), documented with the rest: the 422 is left out."""
    make_schema = app.openapi

    def schema() -> dict:
        if app.openapi_schema is None:
            made = make_schema()
            for operations in made["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                made.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema  # pyright: ignore[reportReturnType]

    app.openapi = schema


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(error.status_code, str(error.detail), type=kind).body(),
            status_code=error.status_code,
            headers=error.headers,  # a 405's Allow
        )

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        body = APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error").body()
        return JSONResponse(body, status_code=500)


def _validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one message, and the request field they are about. A field of several
    accepted types (prompt: text or token ids) fails once per type: they are named together."""
    if not errors:
        return "the request is not valid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not location:
        return f"the request body: {first.get('msg', 'invalid')}", None
    field = location[0]
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [field]]
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    if len(same_field) > 1 and first.get("type") != "missing":
        kinds = sorted({str(e["loc"][-1]) for e in same_field if len(e.get("loc", ())) > 2})
        return f"{field}: expected {' or '.join(kinds) or 'another value'}, got {got}", field
    if first.get("type") == "missing":
        return f"{'.'.join(location)} is required", field
    return f"{'.'.join(location)}: {first.get('msg', 'invalid')}, got {got}", field
