"""uvicorn's server, with a shutdown that ends the engine's requests in words.

uvicorn's own graceful shutdown waits for the requests in flight, then cancels what still runs:
a stream is cut with no error event and no `data: [DONE]`, a whole completion answered with a
plain-text 500. Server stops the engine first, so that every request left hears why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

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
