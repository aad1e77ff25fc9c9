"""What stands in front of the routes, as plain ASGI (not BaseHTTPMiddleware, which hides a
client's disconnect from the route): the API key (APIKeyCheck), the drain after SIGTERM
(DrainGate) and the body limit (BodyLimit). Each answers in OpenAI's error shape
(protocol.APIError)."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from specdec.serve.async_engine import SHUTTING_DOWN
from specdec.serve.protocol import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the key, as vLLM does: for probes and scrapers


KEY_INDEX = "specdec.api_key_index"  # the ASGI scope's entry: which of the server's keys a request sent


class APIKeyCheck:
    """Every request but those to OPEN_PATHS must carry 'Authorization: Bearer <key>' with one
    of api_keys, else 401: the API, and the schema and its pages (/openapi.json, /docs, /redoc),
    which tell what the API takes. A path that is not there is a 401 too, to a client without a
    key. The key's index in api_keys goes into the ASGI scope (KEY_INDEX), never the key."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            matches = [hmac.compare_digest(given, expected) for expected in self.expected]  # all, no early out
            if not any(matches):
                error = APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await _answer(error, scope, receive, send)
                return
            scope[KEY_INDEX] = matches.index(True)
        await self.app(scope, receive, send)


class Drain:
    """What a draining server shares between its shutdown (server.Server) and its gate
    (DrainGate): whether it drains, and how many requests the gate let in are still being
    answered (a stream counts until its last event is sent)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


DRAIN_OPEN_PATHS = frozenset({"/metrics"})  # still answered while draining: a scraper sees the drain


class DrainGate:
    """Counts the requests in flight, and once drain.draining is set answers every new one with
    a 503 shutting_down (with Retry-After), /health included, so that a client or a load balancer
    hears the server is going away instead of finding its port closed; the requests already in
    flight go on."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in DRAIN_OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = APIError(
                503,
                SHUTTING_DOWN,
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_SECONDS)},
            )
            await _answer(error, scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


DRAIN_RETRY_AFTER_SECONDS = 5  # another replica behind the balancer, or this server restarted


class BodyLimit:
    """A request body over max_bytes is refused with a 413 before it is parsed: at once where
    the request declares its length (Content-Length), else as soon as the bytes read pass the
    limit. A body within it is read whole here (as the routes would) and handed on. The limit
    keeps a huge request from holding the event loop, and so every other client, while it is
    parsed."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _answer(self._too_large(f"{declared:,} bytes"), scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _answer(self._too_large(f"more than {self.max_bytes:,} bytes"), scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body is {size}, more than this server takes ({self.max_bytes:,} bytes, "
            "--max-request-bytes); send a shorter prompt, or start the server with a larger limit",
            code="request_too_large",
        )


def _content_length(scope) -> int | None:
    """The Content-Length the request declares, if it declares one that is a number."""
    value = dict(scope["headers"]).get(b"content-length")
    return int(value) if value is not None and value.isdigit() else None


def _replay(body: bytes, receive):
    """A receive that gives body as the whole request, then passes on to receive (which tells
    of a disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _answer(error: APIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
