"""`specdec serve MODEL`: the OpenAI-compatible server on uvicorn.

    specdec serve models/code-target --draft models/code-draft -k 5 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "code-target", "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'

SIGTERM or Ctrl-C: the server drains (server.py): a new request gets a 503 shutting_down while
the requests in flight have up to --shutdown-timeout seconds to finish, then it stops the engine,
which tells the rest (a 503, or an error event and `data: [DONE]` on a stream), and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import math

log = logging.getLogger("specdec")

DEFAULT_MAX_NUM_SEQS = 64
MAX_NUM_SEQS_BOUND = 1 << 16  # requests at once: past this, absurd for one engine (vLLM's default is 256)
DEFAULT_MAX_PREFILL_TOKENS = 512  # vLLM's max_num_batched_tokens under chunked prefill (its V0 default)
# A step's prefill, in expected seconds (engine/prefill_budget.py): a request that arrives, or a
# client that leaves, waits about one step (docs/server.md, "Clients that leave")
DEFAULT_MAX_PREFILL_SECONDS = 0.25


def add_serve_parser(commands) -> None:
    from specdec.engine.swap import DEFAULT_SWAP_SPACE_GIB
    from specdec.model_flags import add_model_argument, add_model_arguments
    from specdec.serve.settings import REQUEST_BYTES_PER_TOKEN, SUFFIX_CACHE_SCOPES
    from specdec.serve.tools import TOOL_FORMATS

    p = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        usage="%(prog)s MODEL [options]",
        description="Serve the target (with its drafter) over HTTP: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics.",
    )
    add_model_argument(p)
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default 8000)")
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' with one of the keys given (the flag once for "
        "each key; default: $SPECDEC_API_KEY; none: open)",
    )
    p.add_argument(
        "--suffix-cache-scope",
        choices=SUFFIX_CACHE_SCOPES,
        default="key",
        help="whose answers suffix decoding drafts a request from: key (default), those of requests sent "
        "with the same --api-key, so that no client's speed tells what another's requests were "
        "answered; global, every request's (the same with one key, or none)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("auto", *TOOL_FORMATS),
        default="auto",
        help="the format the model writes tool calls in (vLLM's parser names): hermes (<tool_call> JSON "
        "</tool_call>: Qwen2.5, Hermes, SmolLM), llama3_json (the answer a JSON call with parameters: Llama "
        "3.1-3.3); auto (default): the one its chat template teaches, else hermes",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model's names in the API, as in vLLM: requests may give any, responses carry the first "
        "(default: a registered model's name, else MODEL's directory or file name)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"the most requests run at once (default {DEFAULT_MAX_NUM_SEQS}, at most {MAX_NUM_SEQS_BOUND:,}); "
        "more wait",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="the most requests waiting for a slot; more are answered 429 (default 1024)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="the most prompt tokens one step prefills (rows x the longest chunk): a longer prompt is "
        "prefilled in chunks over several steps, and more new requests start at the next ones, so that a "
        "burst does not stall the running requests and a client that leaves is dropped within a step "
        f"(default {DEFAULT_MAX_PREFILL_TOKENS})",
    )
    p.add_argument(
        "--max-prefill-seconds",
        type=float,
        default=DEFAULT_MAX_PREFILL_SECONDS,
        help="the most seconds one step's prefill is expected to take, from what the prefills so far "
        "cost a token: on a slow machine or a big model a step then prefills fewer tokens than "
        "--max-prefill-tokens, so that a new request or a client that leaves waits about this long "
        f"(default {DEFAULT_MAX_PREFILL_SECONDS})",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the most tokens (prompt + output) of a request (default: the model's context length)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        metavar="GB",
        help="the key/value caches (the target's and a drafter's) may take at most this many GB, in "
        "blocks of 16 positions that requests hold as they use them (default: half the memory free "
        "after loading, or what "
        "--max-num-seqs requests of --max-model-len tokens need where that is less)",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=DEFAULT_SWAP_SPACE_GIB,
        metavar="GIB",
        help="GiB of memory where requests preempted for lack of cache blocks keep their cache entries, "
        f"to resume exactly where they were (default {DEFAULT_SWAP_SPACE_GIB:g}, as vLLM's; 0: a preempted "
        "request is prefilled again instead)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request whose prompt starts with whole 16-token blocks an earlier one computed skips their "
        "prefill (default on, as in vLLM; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="the largest request body taken, in bytes; a larger one is answered 413 before it is read "
        f"(default: 2,000,000, or {REQUEST_BYTES_PER_TOKEN} per token of --max-model-len where that is more)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM (default 10)",
    )
    p.add_argument(
        "--learn",
        metavar="DIR",
        help="record each finished request (its prompt's and answer's token ids) into DIR, for `specdec adapt` "
        "to train the drafter on; owner-only files, at most --learn-max-gb (default: nothing recorded). A "
        "drafter with an EAGLE head also drafts with DIR/heads' current version, swapped in while serving",
    )
    p.add_argument(
        "--learn-max-gb",
        type=float,
        default=1.0,
        help="the most --learn DIR holds, in GB: the oldest requests are deleted first (default 1)",
    )
    p.add_argument(
        "--adapt-every",
        type=int,
        metavar="N",
        help="with --learn: run `specdec adapt` (at the lowest CPU priority) each time N more requests are "
        "recorded; a better head becomes DIR/heads' next version and is swapped in (default: never; run "
        "`specdec adapt MODEL --from DIR` yourself)",
    )
    p.add_argument(
        "--adapt-minutes",
        type=float,
        default=10.0,
        help="with --adapt-every: the most minutes each run trains (default 10)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines serving the model, as a Ray Serve application behind the same routes (default 1: no Ray, "
        'unless --ray-address or --replica-threads is given); needs pip install "specdec[ray]"',
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --replicas: the Ray cluster to join (ray start --head prints it; 'auto': the one on this "
        "machine); default: a Ray instance of this machine's own, started and stopped with the server",
    )
    p.add_argument(
        "--replica-threads",
        type=int,
        help="with --replicas: torch threads (and Ray CPUs) of each replica (default: this machine's cores / "
        "--replicas, at least 1)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default warning)",
    )
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from specdec.model_flags import require_model
    from specdec.serve.app import ServerState
    from specdec.serve.async_engine import AsyncEngine
    from specdec.serve.prom import ServerMetrics
    from specdec.serve.server import run_server
    from specdec.serve.settings import api_keys, max_request_bytes, prepare_llm, served_names, speculation

    if not args.model and args.served_model_name and len(args.served_model_name) > 1:
        raise ValueError(
            f"serve needs a model: --served-model-name took {args.served_model_name} as names; give MODEL "
            "first: specdec serve MODEL --served-model-name NAME ..."
        )
    require_model(args, "serve")
    _check_arguments(args)
    if runs_on_ray(args):
        from specdec.serve.ray_serve import run_replicas  # imports ray: only here

        return run_replicas(args)
    llm, max_model_len = prepare_llm(args)
    recorder = _recorder(args, llm)
    names = served_names(args)
    engine = AsyncEngine(llm, ServerMetrics(names[0]), args.max_waiting)
    watcher = _head_watcher(args, llm, engine, recorder)
    state = ServerState(
        engine,
        names,
        max_model_len,
        api_keys=api_keys(args),
        suffix_cache_scope=args.suffix_cache_scope,
        max_request_bytes=max_request_bytes(args, max_model_len),
        speculation=speculation(llm.speculative_config, llm.draft_choice),
        tool_call_parser=args.tool_call_parser,
    )
    try:
        run_server(
            state, args.host, args.port, args.log_level, args.shutdown_timeout
        )  # returns once the app has shut down
    finally:
        if watcher is not None:
            watcher.stop()
        if recorder is not None:
            recorder.close()
    return 0


def _recorder(args: argparse.Namespace, llm):
    """--learn's Recorder, listening to llm's engine, or None."""
    if args.learn is None:
        return None
    from specdec.serve.recorder import Recorder

    recorder = Recorder(
        args.learn, str(llm.target.path), llm.target.model.config.vocab_size, int(args.learn_max_gb * 1e9)
    )
    llm.engine.finish_listeners.append(recorder.record)
    log.info("recording each finished request into %s (at most %g GB; --learn)", args.learn, args.learn_max_gb)
    return recorder


def _head_watcher(args: argparse.Namespace, llm, engine, recorder):
    """--learn's HeadWatcher, started: DIR/heads' versions swapped into the drafter's EAGLE head
    (and with --adapt-every, adapt runs started); None without --learn or without a head."""
    if args.learn is None:
        return None
    from specdec.serve.head_store import HeadStore
    from specdec.serve.head_watcher import HeadWatcher

    drafter = llm.engine.drafter.adaptable() if llm.engine.drafter is not None else None
    if drafter is None:
        if args.adapt_every is not None:
            raise ValueError(
                "--adapt-every adapts an EAGLE head, and this server drafts with none: serve a model whose "
                "registry entry ships one, or give --speculative-model HEAD"
            )
        log.info("no EAGLE head drafts here: %s/heads is not watched", args.learn)
        return None
    adapt = None if args.adapt_every is None else (str(llm.target.path), args.adapt_minutes, recorder, args.adapt_every)
    watcher = HeadWatcher(HeadStore(args.learn), drafter, engine, adapt=adapt)
    watcher.start()
    log.info("drafting with the newest better head in %s/heads as it appears (--learn)", args.learn)
    return watcher


def runs_on_ray(args: argparse.Namespace) -> bool:
    """Whether serve runs its engines as a Ray Serve application: --replicas N >= 2, or one
    replica given --ray-address or --replica-threads (one engine on a cluster, or behind the same
    ingress and router as several)."""
    return args.replicas > 1 or args.ray_address is not None or args.replica_threads is not None


def _check_arguments(args) -> None:
    from specdec.serve.settings import api_keys

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    for flag, value, least in (
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-waiting", args.max_waiting, 0),
        ("--max-prefill-tokens", args.max_prefill_tokens, 1),
    ):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if not (math.isfinite(args.max_prefill_seconds) and args.max_prefill_seconds > 0):
        raise ValueError(f"--max-prefill-seconds must be a positive number of seconds, got {args.max_prefill_seconds}")
    if args.max_num_seqs > MAX_NUM_SEQS_BOUND:
        raise ValueError(
            f"--max-num-seqs {args.max_num_seqs:,} is more requests at once than one engine runs (at most "
            f"{MAX_NUM_SEQS_BOUND:,}; each step runs them all in one forward); give a smaller number, or "
            "--replicas for more engines"
        )
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if args.kv_cache_memory is not None and not 0 < args.kv_cache_memory <= 1e9:  # 1e9 GB: more than any machine's
        raise ValueError(
            f"--kv-cache-memory must be a number of GB above 0 and at most 1e9 (leave it out for no limit but "
            f"the free memory), got {args.kv_cache_memory}"
        )
    if args.served_model_name is not None and not all(name.strip() for name in args.served_model_name):
        raise ValueError(f"--served-model-name {args.served_model_name}: a name is empty; give names with letters")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.replicas < 1 or (args.replica_threads is not None and args.replica_threads < 1):
        raise ValueError(
            f"--replicas and --replica-threads must be at least 1, got {args.replicas} and {args.replica_threads}"
        )
    api_keys(args)  # each one checked
    if args.learn is not None and not (args.learn.strip() and 0 < args.learn_max_gb < 1e9):
        raise ValueError(
            f"--learn {args.learn!r} --learn-max-gb {args.learn_max_gb:g}: give a directory and a size above 0 GB"
        )
    if args.adapt_every is not None and (args.learn is None or args.adapt_every < 1):
        raise ValueError(f"--adapt-every N needs --learn DIR and N of at least 1, got {args.adapt_every}")
    if not (math.isfinite(args.adapt_minutes) and args.adapt_minutes > 0):
        raise ValueError(f"--adapt-minutes must be above 0, got {args.adapt_minutes:g}")
    if args.learn is not None and runs_on_ray(args):
        raise ValueError(
            "--learn records in the one engine process: it is not built for --replicas, --replica-threads or "
            "--ray-address yet; serve without them to record"
        )
