"""The server's Prometheus metrics, named once, in vLLM's names under the `specdec:` prefix.

Every metric has the label model_name (the served model's name), as vLLM's do. Latencies:
  time_to_first_token_seconds   from a request's arrival at the engine to its first token
  inter_token_latency_seconds   per output token after the first: a step that brings a request n
                                tokens (speculation accepts several at once) counts n latencies
                                of (time since the request's last tokens) / n
  e2e_request_latency_seconds   from arrival to the last token
request_success counts requests that finished (by finish reason); request_aborted those whose
client left first (by stage: waiting or running), which are never counted as a success.
The speculative counters follow vLLM's: a draft is one round in which a request was given a k of
at least 1; accepted tokens per position count, for each draft position, the rounds that
accepted it. specdec adds spec_decode_rounds_by_k: request-rounds by the k chosen (0 = plain);
and, for a server that swaps in adapted heads (serve --learn: head_watcher.py), draft_head_version
and the draft and accepted tokens of the rounds drafted while each version was in use
(spec_decode_num_draft_tokens_by_head / ..._accepted_tokens_by_head, label head_version; every
drafter of those rounds counted, suffix decoding's too).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.metrics import SpecStats
from specdec.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"specdec:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc, extra=()):
            metric = Counter(f"specdec:{name}", doc, labels + list(extra), registry=self.registry)
            return metric if extra else metric.labels(model_name)

        def histogram(name, doc):
            return Histogram(f"specdec:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Requests in the batch (holding a cache slot).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self.aborted_by_stage = counter(
            "request_aborted",
            "Requests aborted because their client left, by stage: waiting (for a slot: dropped before any "
            "prefill, unless preempted) or running (dropped from the batch at the next step).",
            ["stage"],
        )
        self.drafts = counter("spec_decode_num_drafts", "Rounds in which a request proposed draft tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ["position"],
        )
        self.rounds_by_k = counter(
            "spec_decode_rounds_by_k",
            "Request-rounds by the k chosen for them (0: a plain decoding step; goodput.py chooses k per round).",
            ["k"],
        )
        self.head_version = gauge(
            "draft_head_version",
            "The version of the adapted head drafting (serve --learn DIR: DIR/heads); 0: the head the server "
            "started with.",
        )
        self.draft_tokens_by_head = counter(
            "spec_decode_num_draft_tokens_by_head",
            "Draft tokens proposed while each head version was in use.",
            ["head_version"],
        )
        self.accepted_tokens_by_head = counter(
            "spec_decode_num_accepted_tokens_by_head",
            "Draft tokens accepted while each head version was in use.",
            ["head_version"],
        )
        self.cache_usage = gauge("kv_cache_usage_perc", "Fraction of the key/value cache's blocks held by requests.")
        self.blocks_held = gauge(
            "kv_cache_blocks_held",
            "Key/value cache blocks held by requests, by the block manager's count (0 when idle: blocks "
            "kept only for the prefix cache are not held).",
        )
        self.step_failures = counter(
            "engine_step_failures", "Engine steps that raised; the requests in their batch got an error."
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of cache blocks (recomputed later).")
        self.ttft = histogram("time_to_first_token_seconds", "Seconds from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Seconds per output token after the first.")
        self.e2e = histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.")
        self._last_token_time: dict[str, float] = {}
        self._seen = SpecStats()  # the engine's totals at the last observation
        self._version = 0  # the head version drafting
        self._seen_cache = (0, 0, 0)  # prefix queries, hits and preemptions at the last observation

    def observe_step(
        self,
        outputs: list[RequestOutput],
        arrivals: dict[str, float],
        num_running: int,
        num_waiting: int,
        totals: SpecStats,
    ) -> None:
        """After an engine step: its outputs (arrival time of each request, perf_counter), the
        batch's size and queue, and the engine's speculation totals so far."""
        now = time.perf_counter()
        for output in outputs:
            request_id = output.request_id
            num_new = sum(len(completion.token_ids) for completion in output.outputs)  # n completions: all
            last = self._last_token_time.get(request_id)
            if last is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.ttft.observe(now - arrivals[request_id])
                num_later = num_new - 1  # the first token's latency is the TTFT
                last = now
            else:
                num_later = num_new
            for _ in range(num_later):
                self.itl.observe((now - last) / num_later)
            self.generation_tokens.inc(num_new)
            self._last_token_time[request_id] = now
            if output.finished:
                self.e2e.observe(now - arrivals[request_id])
                reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "stop")
                self.success.labels(self.model_name, reason).inc()
                del self._last_token_time[request_id]
        self.observe_queue(num_running, num_waiting)
        self._observe_speculation(totals)

    def observe_queue(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def observe_cache(
        self, usage: float, blocks_held: int, prefix_queries: int, prefix_hits: int, preemptions: int
    ) -> None:
        """The cache's use (after a step or an abort), and the engine's prefix-cache and
        preemption totals so far."""
        self.cache_usage.set(usage)
        self.blocks_held.set(blocks_held)
        queries, hits, preempted = self._seen_cache
        self.prefix_queries.inc(max(0, prefix_queries - queries))
        self.prefix_hits.inc(max(0, prefix_hits - hits))
        self.preemptions.inc(max(0, preemptions - preempted))
        self._seen_cache = (prefix_queries, prefix_hits, preemptions)

    def forget(self, request_id: str) -> None:
        """A request that ended without finishing (aborted, or failed): no more latencies."""
        self._last_token_time.pop(request_id, None)

    def aborted(self, request_id: str, stage: str) -> None:
        """A request aborted because its client left, where it was: "waiting" or "running"."""
        self.forget(request_id)
        self.aborted_by_stage.labels(self.model_name, stage).inc()

    def head_swapped(self, version: int, totals: SpecStats) -> None:
        """Head version drafts from now on; the engine's totals so far (SpecStats) go to the one before."""
        self._observe_speculation(totals)
        self._version = version
        self.head_version.set(version)

    def _observe_speculation(self, totals: SpecStats) -> None:
        seen = self._seen
        version = str(self._version)
        drafted = totals.num_draft_tokens - seen.num_draft_tokens
        accepted = totals.num_accepted_tokens - seen.num_accepted_tokens
        self.drafts.inc(sum(totals.rounds_by_k[1:]) - sum(seen.rounds_by_k[1:]))
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.draft_tokens_by_head.labels(self.model_name, version).inc(drafted)
        self.accepted_tokens_by_head.labels(self.model_name, version).inc(accepted)
        for position, accepted in enumerate(totals.accepted_by_position):
            before = seen.accepted_by_position[position] if position < len(seen.accepted_by_position) else 0
            self.accepted_per_pos.labels(self.model_name, str(position)).inc(accepted - before)
        for k, rounds in enumerate(totals.rounds_by_k):
            before = seen.rounds_by_k[k] if k < len(seen.rounds_by_k) else 0
            if rounds > before:
                self.rounds_by_k.labels(self.model_name, str(k)).inc(rounds - before)
        self._seen = SpecStats(
            num_draft_tokens=totals.num_draft_tokens,
            num_accepted_tokens=totals.num_accepted_tokens,
            accepted_by_position=list(totals.accepted_by_position),
            rounds_by_k=list(totals.rounds_by_k),
        )
