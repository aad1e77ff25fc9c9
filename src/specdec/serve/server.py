"""uvicorn's server, with a drain that answers in words.

uvicorn's own graceful shutdown closes the port at once (a new client finds nothing there), waits
for the requests in flight, then cancels what still runs: a stream is cut with no error event and
no `data: [DONE]`, a whole completion answered with a plain-text 500. Server drains instead: the
port stays open and every new request gets a 503 shutting_down (middleware.DrainGate) while the
requests in flight have --shutdown-timeout seconds to finish; then it stops the engine, so that
every request left hears why, and only then closes the port. run_server runs it until SIGTERM or
Ctrl-C, for the single server (commands.py) and the replicas' ingress (ray_serve.py; the engine
there is a ReplicaClient, whose stop ends its requests the same way).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from specdec.serve.app import ServerState, build_app
from specdec.serve.async_engine import AsyncEngine
from specdec.serve.middleware import Drain

log = logging.getLogger("specdec")

SHUTDOWN_GRACE_SECONDS = 5.0  # after the engine stops, for the requests to answer before uvicorn cuts them
DRAIN_POLL_SECONDS = 0.05


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains (drain.draining: new requests get a 503)
    until no request is in flight or shutdown_timeout seconds have passed, then stops the engine:
    each request left is told (AsyncEngine.stop), and has SHUTDOWN_GRACE_SECONDS to answer
    before uvicorn closes the port and cancels what still runs (which would cut a stream with no
    word, and answer a plain-text 500). A second Ctrl-C skips the wait."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain: Drain, shutdown_timeout: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        self.drain.draining = True
        if not await self._requests_finish(self.shutdown_timeout):
            log.warning(
                "%d request(s) still running %g s after the signal to stop: stopping them",
                self.drain.in_flight,
                self.shutdown_timeout,
            )
            await self.async_engine.stop()
        await super().shutdown(sockets)

    async def _requests_finish(self, seconds: float) -> bool:
        """Whether every request in flight finished within seconds (or a second Ctrl-C came)."""
        deadline = time.monotonic() + seconds
        while self.drain.in_flight and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        return self.drain.in_flight == 0 or self.force_exit


def run_server(state: ServerState, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve state's routes on host:port until SIGTERM or Ctrl-C, then drain (Server). Returns
    once the app has shut down."""
    config = uvicorn.Config(
        build_app(state), host=host, port=port, log_level=log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,  # pyright: ignore[reportArgumentType]  (hinted int; a float is waited as given)
    )  # fmt: skip
    # uvicorn shuts down gracefully on the signal, then raises it again against the handler that
    # was there before it: a no-op one makes a stopped server return (and exit 0), as a finished one
    previous = {signum: signal.signal(signum, _after_shutdown) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config, state.async_engine, state.drain, shutdown_timeout).run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _after_shutdown(signum, frame) -> None:
    """The signal again, after uvicorn's graceful shutdown: nothing left to do."""
