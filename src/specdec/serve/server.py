"""uvicorn's server, with a shutdown that ends the engine's requests in words.

uvicorn's own graceful shutdown waits for the requests in flight, then cancels what still runs:
a stream is cut with no error event and no `data: [DONE]`, a whole completion answered with a
plain-text 500. Server stops the engine first, so that every request left hears why. serve_app
runs it until SIGTERM or Ctrl-C (the replicas' ingress, ray_serve.py; the engine there is a
ReplicaClient, whose stop ends its requests the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from specdec.serve.async_engine import AsyncEngine

log = logging.getLogger("specdec")

SHUTDOWN_GRACE_SECONDS = 5.0  # after the engine stops, for the requests to answer before uvicorn cuts them


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown stops the engine itself once the requests in flight have
    had shutdown_timeout seconds: each request left then is told (AsyncEngine.stop), and has
    SHUTDOWN_GRACE_SECONDS to answer before uvicorn cancels what still runs (which would cut a
    stream with no word, and answer a plain-text 500)."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        stopper = asyncio.ensure_future(self._stop_engine_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper

    async def _stop_engine_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        log.warning("requests still running %g s after the signal to stop: stopping them", seconds)
        await self.async_engine.stop()


def serve_app(app, async_engine: AsyncEngine, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve app on host:port until SIGTERM or Ctrl-C, then drain (Server): the port stops taking
    connections, requests in flight have shutdown_timeout s to finish, then async_engine.stop()
    tells the rest (a 503 shutting_down; on a stream an error event, then `data: [DONE]`).
    Returns once the app has shut down."""
    grace = shutdown_timeout + SHUTDOWN_GRACE_SECONDS
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        timeout_graceful_shutdown=grace,  # pyright: ignore[reportArgumentType]  (hinted int; a float is waited as given)
    )  # fmt: skip
    # uvicorn shuts down gracefully on the signal, then raises it again against the handler that
    # was there before it: a no-op one makes a stopped server return, as a finished one
    previous = {signum: signal.signal(signum, _after_shutdown) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config, async_engine, shutdown_timeout).run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _after_shutdown(signum, frame) -> None:
    """The signal again, after uvicorn's graceful shutdown: nothing left to do."""
