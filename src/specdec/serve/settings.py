"""What the serve flags make, for a server (commands.py) and for each engine replica on Ray
(ray_serve.py): the LLM prepared to serve, the model's names in the API, the body limit."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

log = logging.getLogger("specdec")

REQUEST_BYTES_PER_TOKEN = 32  # the default body limit's room per token of context, past 2 MB


def prepare_llm(args: argparse.Namespace, where: str | None = None, engines_sharing: int = 1):
    """(the LLM the flags describe, prepared to serve, and the context length it serves); where:
    what the log says it serves on (default: the address it listens on); engines_sharing: the
    engines splitting the machine's memory without --kv-cache-memory (replicas)."""
    import torch

    from specdec.model_flags import make_llm

    llm = make_llm(
        args,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        swap_space=args.swap_space,
    )
    max_model_len = args.max_model_len or llm.max_model_len
    if max_model_len > llm.max_model_len:
        raise ValueError(
            f"--max-model-len {max_model_len} is more than the model's context length ({llm.max_model_len})"
        )
    budget = None if args.kv_cache_memory is None else int(args.kv_cache_memory * 1e9)
    with torch.inference_mode():
        num_slots = llm.engine.prepare_to_serve(
            max_model_len, budget, args.max_prefill_tokens, engines_sharing, args.max_prefill_seconds
        )
    spec = llm.speculative_config
    log.info(
        "serving %s on %s: %s, up to %d requests at once of up to %d tokens each; the KV cache "
        "holds %s tokens (%.2f GB)%s",
        served_names(args)[0],
        where or f"http://{args.host}:{args.port}",
        f"{spec.method} k={spec.num_speculative_tokens} ({spec.k_policy})" if spec else "no speculation",
        num_slots,
        max_model_len,
        f"{llm.engine.capacity.cache_tokens:,}",
        llm.engine.capacity.cache_tokens * llm.engine.capacity.position_bytes / 1e9,
        ", prefix caching on" if args.enable_prefix_caching else "",
    )
    return llm, max_model_len


def speculation(config, choice) -> dict:
    """What /v1/models says of the server's speculation (config: its SpeculativeConfig or None;
    choice: what speculative_method="auto" chose, or None): the method, the drafter's path (a list
    for stages; None for none) and why."""
    if choice is not None:
        return choice.as_dict()
    if config is None:
        return {"method": "none", "model": None, "reason": "speculation is off (--speculative-method none)"}
    model = list(config.model) if isinstance(config.model, tuple) else config.model
    return {"method": config.method, "model": model, "reason": "given by the server's flags"}


def speculation_from_flags(args: argparse.Namespace) -> dict:
    """speculation() for the flags, without loading a model (Ray's ingress, which loads none):
    "auto" chosen as the replicas choose it, but for a shipped drafter that fails to load there."""
    from specdec.drafters.auto import choose_drafters
    from specdec.model_flags import speculative_config_from_flags
    from specdec.models.registry import resolve_model

    config = speculative_config_from_flags(args)
    choice = choose_drafters(config, resolve_model(args.model)) if config and config.method == "auto" else None
    return speculation(config, choice)


SUFFIX_CACHE_SCOPES = ("key", "global")  # --suffix-cache-scope: ServerState.suffix_cache_scope


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys a client may send: each --api-key, else $SPECDEC_API_KEY, else none (open)."""
    env = os.environ.get("SPECDEC_API_KEY")
    keys = tuple(args.api_key) if args.api_key else (env,) if env is not None else ()
    for key in keys:
        if not key.strip():
            raise ValueError("--api-key (or SPECDEC_API_KEY) is empty: give a key, or leave it out for an open server")
    if len(set(keys)) < len(keys):
        raise ValueError("--api-key: a key is given twice; give each client's key once")
    return keys


def served_names(args: argparse.Namespace) -> list[str]:
    """The model's names in the API, the first the one responses carry."""
    return args.served_model_name or [default_served_name(args.model)]


def max_request_bytes(args: argparse.Namespace, max_model_len: int) -> int:
    """The body limit: --max-request-bytes, else 2 MB or REQUEST_BYTES_PER_TOKEN per token of context."""
    from specdec.serve.app import DEFAULT_MAX_REQUEST_BYTES

    return args.max_request_bytes or max(DEFAULT_MAX_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)


def default_served_name(model: str) -> str:
    """The name a user knows the model by: a registered model's name (`specdec fetch`), given as
    the name or as the path the fetch put it at, else the directory's or file's name."""
    from specdec.models.registry import REGISTRY

    path = Path(str(model).rstrip("/"))
    entry = REGISTRY.get(path.parent.name)
    if entry is not None and path.name in (entry.file_name, entry.converted):
        return entry.name
    return path.name
