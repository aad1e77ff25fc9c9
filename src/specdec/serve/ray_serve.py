"""`specdec serve MODEL --replicas N`: N engines on Ray Serve, behind the same OpenAI routes.

    pip install "specdec[ray]"
    specdec serve models/code-target --draft models/code-draft -k 5 --replicas 2

Terms:
  engine replica  one engine: the LLM the flags describe, stepped by an AsyncEngine, with
                  --replica-threads torch threads (and as many Ray CPUs); the Ray Serve application
                  specdec-engine-i of one deployment, engine-i, of one replica (EngineReplica). Ray
                  restarts a replica that dies
  ingress         app.py's routes, served by uvicorn in this process (the `specdec serve`
                  command), with a ReplicaClient where a single server has its AsyncEngine: it
                  tokenizes, routes each request (router.PrefixRouter: where it finishes first, its
                  cached prefix and the replicas' outstanding tokens counted) and streams its
                  outputs back from the replica through Ray

Ray Serve runs no HTTP proxy here (ProxyLocation.Disabled): the only port is the ingress's, so
the API key guards every route the process serves (Ray's proxy would answer /-/routes and
/-/healthz itself, to anyone), and SIGTERM drains as the single server does (server.run_server:
a new request gets a 503 shutting_down while those in flight have --shutdown-timeout to finish,
then the rest end with a 503 shutting_down, or on a stream an error event and `data: [DONE]`),
before Ray Serve shuts down. There is no ingress replica to die apart from the server: the ingress is the process.

One application per engine, not one deployment of N replicas: the router names the replica (the
one holding the prompt's prefix), and /metrics asks each; a handle to a deployment of several
replicas picks one itself. A replica that dies ends its requests in flight with a 503 (code
replica_unavailable; an error event then `data: [DONE]` on a stream); the router sends nothing to
it until it answers again. /metrics: every replica's metrics with a `replica` label, and the
router's own (replica_up, router_requests by replica and reason).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import cast

try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve import RunTarget
    from ray.serve.config import ProxyLocation
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ImportError as e:  # the one line the command line prints (cli.py prints a ValueError's words)
    raise ValueError('--replicas N needs Ray Serve: pip install "specdec[ray]"') from e

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from specdec.log_lines import show_log
from specdec.prompts import PromptEncoder
from specdec.serve.app import ServerState
from specdec.serve.async_engine import AsyncEngine
from specdec.serve.prom import ServerMetrics
from specdec.serve.protocol import APIError
from specdec.serve.router import PrefixRouter
from specdec.serve.server import run_server
from specdec.serve.settings import (
    api_keys,
    max_request_bytes,
    prepare_llm,
    served_names,
    speculation_from_flags,
)

log = logging.getLogger("specdec")

APP_NAME = "specdec"
HEALTH_PERIOD_S = 2.0  # how often the ingress asks each replica whether it answers
HEALTH_TIMEOUT_S = 5.0  # a replica that does not answer in this long is down
METRICS_TIMEOUT_S = 5.0  # a replica's metrics not in by then are left out of /metrics


def engine_name(index: int) -> str:
    """The deployment of engine replica index."""
    return f"engine-{index}"


# --- the engines ------------------------------------------------------------------------------------


@serve.deployment
class EngineReplica:
    """One engine: the LLM the serve flags (args) describe, prepared to serve and stepped by an
    AsyncEngine in a thread, with args.replica_threads torch threads."""

    def __init__(self, args: argparse.Namespace, index: int):
        show_log()  # a Ray worker: specdec's log lines (the dtype, the cache's size) in the server's output
        torch.set_num_threads(args.replica_threads)
        self.index = index
        # without --kv-cache-memory each replica takes its share of half the free memory (all
        # on this machine, as far as it knows: a cluster's replicas are given the flag)
        llm, _ = prepare_llm(args, where=f"Ray Serve replica {engine_name(index)}", engines_sharing=args.replicas)
        self.engine = AsyncEngine(llm, ServerMetrics(served_names(args)[0]), args.max_waiting)

    def _started(self) -> AsyncEngine:
        """The AsyncEngine, its thread started on this replica's event loop (the one its calls run on)."""
        if not self.engine.is_running:
            self.engine.start()
        return self.engine

    async def generate(self, request_id, prompt_token_ids, params, prompt, stream_text, cache_scope=None):
        """AsyncEngine.generate's outputs, streamed to the caller; its errors raised there."""
        engine = self._started()
        async for output in engine.generate(request_id, prompt_token_ids, params, prompt, stream_text, cache_scope):
            yield output

    async def metrics_text(self) -> bytes:
        return generate_latest(self.engine.metrics.registry)

    async def ready(self) -> str:
        """This replica's Ray actor name (what ray.kill takes, by ray.get_actor(name, namespace="serve"))."""
        self._started()
        return ray.get_runtime_context().get_actor_name() or ""


# --- the ingress ------------------------------------------------------------------------------------


class ReplicaClient:
    """What app.py's routes use of an AsyncEngine, over the engine replicas: generate routes each
    request (PrefixRouter) and streams its outputs from the replica through Ray; stop ends every
    request still open with a 503 shutting_down, as AsyncEngine.stop does. llm: the ingress's
    tokenizer and prompt checks (a PromptEncoder: the routes call llm.prompt_token_ids; the
    ingress holds no weights)."""

    def __init__(self, llm: PromptEncoder, handles: list[DeploymentHandle], model_name: str):
        self.llm = llm
        self.handles = handles
        self.router = PrefixRouter(len(handles))
        self.registry = CollectorRegistry()
        self.replica_up = Gauge(
            "specdec:replica_up", "1 while an engine replica answers, else 0 (Ray restarts it).",
            ["model_name", "replica"], registry=self.registry,
        )  # fmt: skip
        self.routed = Counter(
            "specdec:router_requests", "Requests routed to each replica: by a cached prefix, or by load.",
            ["model_name", "replica", "reason"], registry=self.registry,
        )  # fmt: skip
        self.model_name = model_name
        self._watcher: asyncio.Task | None = None
        self._stopping = False
        self._stopped = asyncio.Event()  # set by stop: every request still open ends
        for replica in range(len(handles)):  # down until it first answers (_watch_replicas)
            self.router.mark_down(replica)
            self.replica_up.labels(model_name, str(replica)).set(0)

    @property
    def is_running(self) -> bool:
        """Whether any replica answers (/health's 200), and the server is not stopping. Replicas
        count as down until they first answer: a /health of 200 while the engines were still
        loading and timing their rounds (for minutes) once sent load (benchmarks/bench_replicas.py's,
        a load balancer's) to requests that waited out the replicas' start (docs/server.md,
        "Replicas on Ray Serve")."""
        return not self._stopping and len(self.router.down) < len(self.handles)

    def start(self) -> None:
        self._watcher = asyncio.ensure_future(self._watch_replicas())

    async def stop(self) -> None:
        """Take no more requests, and end those still open (each hears shutting_down; its replica
        aborts it). The server calls it --shutdown-timeout after SIGTERM, and again on the way out."""
        self._stopping = True
        self._stopped.set()
        if self._watcher is not None:
            self._watcher.cancel()

    async def generate(self, request_id, prompt_token_ids, params, prompt=None, stream_text=True, cache_scope=None):
        """The request's outputs from the replica the router chose (AsyncEngine.generate's
        contract). A replica that dies meanwhile: APIError 503 replica_unavailable; the server
        stopping (stop): APIError 503 shutting_down."""
        if self._stopping:
            raise _shutting_down()
        route = self.router.route(request_id, prompt_token_ids, params.max_tokens * params.n)  # n completions
        self.routed.labels(self.model_name, str(route.replica), route.reason).inc()
        streaming = self.handles[route.replica].options(stream=True)
        response = cast(
            "DeploymentResponseGenerator",
            streaming.generate.remote(request_id, prompt_token_ids, params, prompt, stream_text, cache_scope),
        )
        finished, prefilled = False, False
        try:
            async for output in self._until_stopped(response):
                finished = output.finished
                new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
                self.router.computed(request_id, new_tokens + (0 if prefilled else route.prefill_tokens))
                prefilled = True
                yield output
        except Exception as e:
            finished = not isinstance(e, APIError)  # an APIError is _until_stopped's: the replica still runs it
            raise self._error(e, route.replica) from None
        finally:
            self.router.finished(request_id)
            if not finished:  # left early: the client went away, or the server stops; the replica aborts it
                response.cancel()

    async def _until_stopped(self, response: DeploymentResponseGenerator):
        """The response's outputs, until it ends or stop is called (then APIError 503
        shutting_down)."""
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            while True:
                output = asyncio.ensure_future(_next(response))
                await asyncio.wait((output, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not output.done():
                    output.cancel()  # Ray may end it with RequestCancelledError: seen, not logged
                    output.add_done_callback(_seen)
                    raise _shutting_down()
                try:
                    item = output.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            stopped.cancel()

    def _error(self, error: Exception, replica: int) -> Exception:
        """What the routes are told of an error from a replica: its own exception (QueueFull,
        ValueError, ...), or a 503 if the replica died."""
        if isinstance(error, RayActorError) or isinstance(getattr(error, "cause", None), RayActorError):
            self._mark(replica, up=False)
            return APIError(
                503,
                f"the engine replica serving this request ({engine_name(replica)}) stopped; Ray restarts it: "
                "send the request again",
                type="server_error",
                code="replica_unavailable",
            )
        if isinstance(error, RayTaskError) and isinstance(error.cause, Exception):
            return error.cause
        return error

    def _mark(self, replica: int, up: bool) -> None:
        if up == (replica in self.router.down):  # a change: the log says when routing changed
            what = "answers: routing to it" if up else "does not answer: routing around it"
            (log.info if up else log.warning)("%s %s", engine_name(replica), what)
        if up:
            self.router.mark_up(replica)
        else:
            self.router.mark_down(replica)
        self.replica_up.labels(self.model_name, str(replica)).set(1 if up else 0)

    async def _watch_replicas(self) -> None:
        """Ask every replica every HEALTH_PERIOD_S whether it answers; mark it up or down."""
        while True:
            answers = await asyncio.gather(*(self._answers(h) for h in self.handles))
            for replica, answered in enumerate(answers):
                self._mark(replica, answered)
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _answers(self, handle: DeploymentHandle) -> bool:
        try:
            await asyncio.wait_for(handle.ready.remote(), HEALTH_TIMEOUT_S)
            return True
        except Exception:  # died, restarting, or too slow: down for now
            return False

    async def metrics_text(self) -> bytes:
        """/metrics: each replica's metrics, labelled replica="i" (a replica that does not answer is
        left out), then the router's."""
        texts = await asyncio.gather(*(self._replica_metrics(h) for h in self.handles))
        merged = _Families(_relabelled(texts))
        return generate_latest(merged) + generate_latest(self.registry)  # pyright: ignore[reportArgumentType]

    async def _replica_metrics(self, handle: DeploymentHandle) -> str | None:
        try:
            return (await asyncio.wait_for(handle.metrics_text.remote(), METRICS_TIMEOUT_S)).decode()
        except Exception:
            return None


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


async def _next(response: DeploymentResponseGenerator):
    """The response's next output (StopAsyncIteration at its end), as a coroutine a task can run."""
    return await response.__anext__()


def _seen(task: asyncio.Task) -> None:
    """Take a left task's outcome, so that asyncio does not log it ("exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


class _Families:
    """Metric families ready for generate_latest (it calls collect())."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _relabelled(texts: list[str | None]) -> list[Metric]:
    """The families of every replica's metrics text (None: left out), each sample labelled with
    its replica's index, one family per name."""
    families: dict[str, Metric] = {}
    for replica, text in enumerate(texts):
        for family in text_string_to_metric_families(text or ""):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, "replica": str(replica)}) for s in family.samples]
    return list(families.values())


def ingress_state(args: argparse.Namespace, prompts: PromptEncoder, handles: list[DeploymentHandle]) -> ServerState:
    """What app.py's routes serve in this process (the ingress): a ReplicaClient over the engine
    deployments' handles (in index order); prompts: the model's tokenizer and prompt checks (no
    weights)."""
    max_model_len = args.max_model_len or prompts.max_model_len
    names = served_names(args)
    client = ReplicaClient(prompts, handles, names[0])
    return ServerState(
        cast("AsyncEngine", client),  # the routes use what ReplicaClient has of AsyncEngine
        names,
        max_model_len,
        api_keys=api_keys(args),
        suffix_cache_scope=args.suffix_cache_scope,
        max_request_bytes=max_request_bytes(args, max_model_len),
        metrics_text=client.metrics_text,
        speculation=speculation_from_flags(args),
        tool_call_parser=args.tool_call_parser,
    )


# --- the command ------------------------------------------------------------------------------------


def app_name(index: int) -> str:
    """The Ray Serve application of engine replica index (one deployment, engine_name(index))."""
    return f"{APP_NAME}-{engine_name(index)}"


def applications(args: argparse.Namespace) -> list[RunTarget]:
    """The Ray Serve applications of args (serve's flags, with replica_threads set): one per
    engine, none exposed over HTTP (route_prefix None: the ingress calls them by handle)."""
    return [
        RunTarget(
            EngineReplica.options(  # pyright: ignore[reportAttributeAccessIssue]
                name=engine_name(i),
                num_replicas=1,
                ray_actor_options={"num_cpus": args.replica_threads},
                max_ongoing_requests=args.max_num_seqs + args.max_waiting + 1,
                graceful_shutdown_timeout_s=args.shutdown_timeout,
            ).bind(args, i),
            name=app_name(i),
            route_prefix=None,
        )
        for i in range(args.replicas)
    ]


class Interrupted(Exception):
    """SIGTERM while the replicas were still starting (before the server listened)."""


def run_replicas(args: argparse.Namespace) -> int:
    """Start the engine replicas on Ray Serve (with no HTTP proxy of Ray's), then serve the routes
    in this process until SIGTERM or Ctrl-C, drained as the single server drains
    (server.run_server); then shut Ray Serve down, and exit 0."""
    threads = args.replica_threads or max(1, (os.cpu_count() or 1) // args.replicas)
    settings = argparse.Namespace(**{**vars(args), "replica_threads": threads, "run": None})
    prompts = PromptEncoder.load(args.model)  # the ingress's; a model that is not there fails before Ray starts
    _start_ray(args.ray_address, args.replicas * threads)
    try:
        state = ingress_state(settings, prompts, _start_engines(settings))
        log.warning(
            "serving %s on http://%s:%d: %d replica%s on Ray Serve, %d thread%s each",
            served_names(args)[0],
            args.host,
            args.port,
            args.replicas,
            "" if args.replicas == 1 else "s",
            threads,
            "" if threads == 1 else "s",
        )
        run_server(state, args.host, args.port, args.log_level, args.shutdown_timeout)
    except Interrupted:
        log.warning("stopped while the replicas were starting")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _start_engines(args: argparse.Namespace) -> list[DeploymentHandle]:
    """Deploy the engine applications and wait until every replica has loaded its model (a
    replica that cannot start raises here); a SIGTERM or Ctrl-C meanwhile raises Interrupted."""

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(proxy_location=ProxyLocation.Disabled)  # no port but ours: the API key guards all
        return serve.run_many(applications(args), wait_for_applications_running=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start_ray(address: str | None, cpus_needed: int) -> None:
    """Join the cluster at address, or start a Ray instance of this machine's own with CPUs
    enough for the replicas (more than the cores, if asked: threads then share cores)."""
    if address is not None:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus_needed), include_dashboard=False)
