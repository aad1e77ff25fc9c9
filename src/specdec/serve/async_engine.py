"""AsyncEngine: the step-based engine behind an asyncio front, for the server.

One background thread owns the Engine: it takes new requests and aborts from a queue between
steps, runs a step while any request is unfinished (sleeping otherwise), and hands each step's
outputs to the event loop, where every request has its own asyncio queue. A request is an async
iterator of RequestOutput deltas (outputs.py); leaving it early (a client that disconnects, a
cancelled task) aborts the request before the next step, wherever it is: a request still waiting
is dropped before any prefill, a running one leaves the batch. Aborts are counted in /metrics
(specdec:request_aborted, by stage), never as a success.

The thread keeps the event loop free while the model runs: PyTorch releases the GIL in its
kernels, so the server answers /health and /metrics and reads new requests during a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator

import torch

from specdec.config import SamplingParams
from specdec.outputs import RequestOutput
from specdec.serve.prom import ServerMetrics

log = logging.getLogger("specdec")


class QueueFull(Exception):
    """More requests wait than the server queues."""


class EngineStopped(Exception):
    """The server is shutting down: no new requests, and (past --shutdown-timeout) no more
    tokens for those still running."""


SHUTTING_DOWN = "the server is shutting down; send the request again (to another server, or once it is back)"
ENGINE_DEAD = "the server's engine has stopped; send the request again to another server"


class AsyncEngine:
    """llm's engine, prepared to serve (engine.prepare_to_serve) and stepped in a thread.
    max_waiting: requests that may wait for a slot; one more is refused (QueueFull)."""

    def __init__(self, llm, metrics: ServerMetrics, max_waiting: int):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # ("add", args), ("abort", id), ("swap_head", args)
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # read and written on the event loop only
        self._arrivals: dict[str, float] = {}  # request id -> perf_counter at arrival (the engine thread's)
        self._num_unfinished = 0  # requests given and not yet finished or aborted (event loop)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.step_errors = 0

    @property
    def is_running(self) -> bool:
        """Whether the engine's thread is stepping (or waiting for work)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_open_requests(self) -> int:
        """Requests whose callers still iterate them: given, and neither finished, refused, failed
        nor left (a request left early has its abort on the way to the engine's thread)."""
        return self._num_unfinished

    @property
    def num_slots(self) -> int:
        return self.engine.scheduler.num_slots

    def start(self) -> None:
        """Start stepping (on the running event loop's behalf)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs or waits, and end the thread. Each request hears at once
        (EngineStopped), not after the step the thread may be in; stopping twice is stopping once."""
        self._stopping = True
        self._wake.set()
        for stream in list(self._streams.values()):
            stream.put_nowait(EngineStopped(SHUTTING_DOWN))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        stream_text: bool = True,
        cache_scope: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, step by step, until the one marked finished (stream_text: each
        carries its new text; else the last carries it all). Raises QueueFull (nothing queued),
        EngineStopped, or the engine's ValueError for a request it refuses."""
        if self._stopping:
            raise EngineStopped(SHUTTING_DOWN)
        if not self.is_running:
            raise EngineStopped(ENGINE_DEAD)
        if self._num_unfinished >= self.num_slots + self.max_waiting:
            raise QueueFull(
                f"{self._num_unfinished} requests are running or waiting, the most this server takes "
                f"({self.num_slots} running + {self.max_waiting} waiting); retry later"
            )
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._num_unfinished += 1
        added = (request_id, prompt_token_ids, params, prompt, stream_text, cache_scope, time.perf_counter())
        self._command("add", added)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True  # the engine refused it or failed: nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._streams[request_id]
            self._num_unfinished -= 1
            if not finished:  # left early: the client went away, or the task was cancelled
                self._command("abort", request_id)

    def swap_head(self, drafter, prepared, version: int) -> None:
        """Have the engine's thread swap prepared (EagleDrafter.load_version's) into drafter
        between two steps, and count what is drafted from then on as that head version's."""
        self._command("swap_head", (drafter, prepared, version))

    def _command(self, kind: str, argument) -> None:
        self._commands.put((kind, argument))
        self._wake.set()

    # --- the engine's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Step while requests are unfinished, until stopped. An error outside a step (taking
        commands, bookkeeping) fails the requests the engine holds, and the thread goes on; if
        the thread ends anyway, every request still open hears so (none waits for ever)."""
        try:
            with torch.inference_mode():
                while not self._stopping:
                    try:
                        self._run_once()
                    except Exception as e:  # a bug outside a step: fail what the engine holds, go on
                        log.exception("the engine's thread failed between steps; its requests are aborted")
                        self._fail(self._unfinished_ids(), e)
                self._take_commands()
                for request_id in self._unfinished_ids():
                    self.engine.abort(request_id)
        finally:
            if not self._stopping:  # the thread dies: nothing would ever answer the open requests
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._fail_open_streams)

    def _run_once(self) -> None:
        """Take the new requests and aborts; step if any request is unfinished, else wait for one."""
        self._take_commands()
        if not self.engine.has_unfinished_requests():
            self._wake.wait()
            self._wake.clear()
            return
        self._step()

    def _unfinished_ids(self) -> list[str]:
        return self.engine.request_ids()

    def _take_commands(self) -> None:
        while True:
            try:
                kind, argument = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt_token_ids, params, prompt, stream_text, cache_scope, arrival = argument
                try:
                    self.engine.add_request(
                        request_id,
                        prompt_token_ids,
                        params,
                        prompt=prompt,
                        stream_text=stream_text,
                        cache_scope=cache_scope,
                    )
                    self._arrivals[request_id] = arrival
                except ValueError as e:  # refused: the client hears why
                    self._deliver([e], [request_id])
                except Exception as e:  # a bug: this request fails, the server goes on
                    log.exception("adding request %s failed", request_id)
                    self._deliver([RuntimeError(f"the engine failed: {type(e).__name__}: {e}")], [request_id])
            elif kind == "swap_head":
                drafter, prepared, version = argument
                drafter.swap_head(prepared)
                self.metrics.head_swapped(version, self.engine.stats)
                log.info("drafting with head version %d (%s)", version, prepared.path)
            else:
                self._abort(argument)

    def _abort(self, request_id: str) -> None:
        """A request whose client left (AsyncEngine.generate ended early) out of the engine, its
        slot and blocks free, counted as aborted where it was: waiting for a slot (dropped before
        any prefill) or running. Nothing if it had finished meanwhile (it counted as a success)."""
        stage = "running" if request_id in self.engine.request_ids(waiting=False) else "waiting"
        if self.engine.abort(request_id):
            self._arrivals.pop(request_id, None)
            self.metrics.aborted(request_id, stage)
            self._observe_engine()

    def _step(self) -> None:
        """One engine step, its outputs delivered, then counted. A step that raises (a bug, a
        device error, anywhere in the batch's round) fails the requests in the batch, which free
        their slots and blocks; the waiting requests go on, and so does the server."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.step_errors += 1
            self.metrics.step_failures.inc()
            log.exception("an engine step failed; its requests are aborted")
            self._fail(self.engine.request_ids(waiting=False), e)
            return
        self._deliver(outputs, [output.request_id for output in outputs])
        try:
            self.metrics.observe_step(
                outputs, self._arrivals, self.engine.num_running, self.engine.num_waiting, self.engine.stats
            )
            self._observe_engine()
        except Exception:  # a bug in counting fails no request
            log.exception("observing an engine step's metrics failed")
        for output in outputs:
            if output.finished:
                self._arrivals.pop(output.request_id, None)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """Abort these requests (their slots and blocks free) and tell each of them why."""
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._arrivals.pop(request_id, None)
            self.metrics.forget(request_id)
        failure = RuntimeError(f"the engine failed: {type(error).__name__}: {error}")
        self._deliver([failure] * len(request_ids), request_ids)
        self._observe_engine()

    def _observe_engine(self) -> None:
        """The queue's and the cache's gauges and counters, as the engine is now."""
        self.metrics.observe_queue(self.engine.num_running, self.engine.num_waiting)
        blocks = self.engine.capacity.blocks
        prefix_queries, prefix_hits = self.engine.capacity.prefix_cache_counts
        self.metrics.observe_cache(
            self.engine.capacity.cache_usage,
            0 if blocks is None else blocks.num_held,
            prefix_queries,
            prefix_hits,
            self.engine.scheduler.num_preemptions,
        )

    def _deliver(self, items: list, request_ids: list[str]) -> None:
        """Hand items to their requests' streams, on the event loop."""
        if items:
            assert self._loop is not None  # start() set it before the engine thread runs
            self._loop.call_soon_threadsafe(self._put, items, request_ids)

    def _put(self, items: list, request_ids: list[str]) -> None:
        for item, request_id in zip(items, request_ids):
            stream = self._streams.get(request_id)
            if stream is not None:  # gone: aborted, its abort on the way
                stream.put_nowait(item)

    def _fail_open_streams(self) -> None:
        """Every open request told that the engine has stopped (its thread ended)."""
        for stream in self._streams.values():
            stream.put_nowait(EngineStopped(ENGINE_DEAD))
