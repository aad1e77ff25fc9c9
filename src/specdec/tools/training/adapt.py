"""`specdec adapt MODEL --from DIR [--head HEAD] --out NEW [--minutes M]`: an EAGLE-3 head fine-
tuned on the traffic a server recorded (`specdec serve MODEL --learn DIR`, serve/recorder.py),
starting from the head in use (HEAD; by default the one the registry ships for MODEL), with
train-heads --eagle3's training-time test over the target's features of the recorded text
(eagle3.py: the same feature pass, checkpoints, resumption and output directory).

  training    the recorded requests but the last quarter: the prompt and the answer, the head
              taught to draft the answer's tokens
  held out    the last quarter of the requests (at least one), never trained on: the head's
              agreement with the target there, drafting step by step, and the tau it predicts
              (eagle3.tau_estimate), measured before (the head as given, step 0) and after

The run ends after --minutes of training (TrainConfig.max_seconds, over all its sessions) or
--steps, whichever comes first, at a flat learning rate. NEW is written whatever it scores; the
command says whether it beats HEAD on the held-out requests and exits 1 where it does not (a head
that scores worse should not be served). A run killed part way resumes with the same command;
NEW appears only once a run has finished.

Without --out, the run adapts into DIR's head store (serve/head_store.py), from --head, else the
store's current version, else the registry's head: a new head that beats the one it started
from becomes the next version, which servers learning into DIR swap in; one that does not is
deleted, and the current version stays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specdec.models.eagle import is_head_directory, read_head_config
from specdec.models.registry import registered_as
from specdec.paths import ROOT
from specdec.serve.head_store import HeadStore, HeadVersion
from specdec.serve.recorder import MANIFEST, read_requests
from specdec.tools.training.eagle3 import MIN_CONTEXT, Eagle3Config, SourceDocument, train_eagle3
from specdec.tools.training.loop import TrainConfig, log
from specdec.tools.training.train import TrainResult

HELD_OUT_SHARE = 0.25
DEFAULT_CONTEXT = 512  # tokens per training window, as train-heads --eagle3's; fewer where the traffic is short
# A run has minutes, not hours: on 2 cores a step of 2 windows of 512 tokens takes ~14 s for the
# 1.5B target's head (float32, as on a CPU without native bfloat16), so 10 minutes are ~40 steps.
# Small batches give those minutes more updates, at a flat rate with no warm-up (a warm-up of the
# default 100 steps left a 10-minute run at a tenth of its rate: its head barely moved).
ADAPT_TRAINING = TrainConfig(
    lr=5e-4, min_lr_ratio=1.0, warmup=0, batch_size=2, eval_every=0, checkpoint_every=10, log_every=5
)


@dataclass(frozen=True)
class AdaptResult:
    """A run's result and the held-out measures of the head before and after."""

    result: TrainResult
    before: dict
    after: dict

    @property
    def improved(self) -> bool:
        return self.after["held_out_tau_estimate"] > self.before["held_out_tau_estimate"]


def default_head(model: str) -> Path:
    """The EAGLE head the registry ships for model, or an error saying to give --head."""
    entry = registered_as(model)
    heads = [ROOT / path for path in (entry.drafters if entry else ()) if is_head_directory(ROOT / path)]
    if not heads:
        raise ValueError(f"no EAGLE head is registered for {model}: give the head to start from with --head")
    return heads[0]


def traffic_documents(requests: list[dict]) -> dict[str, list[SourceDocument]]:
    """The recorded requests as the feature pass's documents: the prompt then the answer, the
    answer's tokens the ones drafted; the last HELD_OUT_SHARE of them held out."""
    if len(requests) < 2:
        raise ValueError(
            f"the recorded traffic holds {len(requests)} request(s): adapting needs at least 2 (one to train on, "
            "one held out); serve longer with --learn"
        )
    held_out = max(1, round(len(requests) * HELD_OUT_SHARE))

    def document(index: int, request: dict) -> SourceDocument:
        ids = list(request["prompt"]) + list(request["output"])
        return SourceDocument(f"request-{index}", lambda: (ids, len(request["prompt"])))

    documents = [document(i, r) for i, r in enumerate(requests)]
    return {"train": documents[:-held_out], "held_out": documents[-held_out:]}


def adapt(
    model: str,
    traffic: str | Path,
    out: str | Path,
    head: str | Path | None = None,
    minutes: float = 10.0,
    steps: int = 1000,
    config: TrainConfig | None = None,
    force: bool = False,
    arguments: dict | None = None,
) -> AdaptResult:
    """Fine-tune head (None: default_head(model)) on the traffic recorded in traffic for at most
    minutes (or steps); the new head in out. config: the rest of the optimisation (its steps and
    max_seconds are these)."""
    head = Path(head).expanduser() if head is not None else default_head(model)
    if not is_head_directory(head):
        raise ValueError(f"--head {head} is not an EAGLE head's directory (no head.json in it)")
    shape, layers = read_head_config(head)
    requests = read_requests(traffic)
    documents = traffic_documents(requests)
    held_out_tokens = sum(len(r["prompt"]) + len(r["output"]) for r in requests[-len(documents["held_out"]) :])
    train_tokens = sum(len(r["prompt"]) + len(r["output"]) for r in requests) - held_out_tokens
    context, least = min(DEFAULT_CONTEXT, held_out_tokens, train_tokens), MIN_CONTEXT + Eagle3Config().ttt_steps
    if context < least:
        raise ValueError(
            f"the recorded traffic is too short to adapt on: {train_tokens} tokens to train on and {held_out_tokens} "
            f"held out, each needing at least {least}; serve longer with --learn"
        )
    eagle3 = Eagle3Config(
        feature_layers=layers,
        output_vocab=shape.output_vocab_size or 0,
        intermediate_size=shape.intermediate_size,
        context=context,
    )
    base = config or ADAPT_TRAINING
    config = dataclasses.replace(base, steps=steps, max_seconds=minutes * 60, warmup=min(base.warmup or 0, steps - 1))
    log(
        f"adapting {head} on {len(documents['train'])} recorded requests ({train_tokens:,} tokens), "
        f"{len(documents['held_out'])} held out ({held_out_tokens:,} tokens), for at most {minutes:g} min"
    )
    # the record's manifest stands for it as the run's input: an output may not replace it, but it
    # may lie inside the record's directory (the head store, DIR/heads, does), which the recorder
    # writes only its own files into
    result = train_eagle3(
        model,
        Path(traffic).expanduser() / MANIFEST,
        out,
        config,
        eagle3,
        init_head=head,
        documents=documents,
        data_flag="--from",
        force=force,
        arguments=arguments,
    )
    evaluations = result.state.evaluations
    return AdaptResult(result, evaluations[0], evaluations[-1])


def adapt_into_store(
    model: str,
    traffic: str | Path,
    head: str | Path | None = None,
    minutes: float = 10.0,
    steps: int = 1000,
    config: TrainConfig | None = None,
    arguments: dict | None = None,
) -> tuple[AdaptResult, HeadVersion | None]:
    """adapt() into traffic's head store, from head (None: the store's current version, else
    default_head(model)): the run's result, and the version it published (None: the new head was
    not better and is deleted, or the run stopped before its end and its candidate waits to resume)."""
    store = HeadStore(traffic)
    current = store.current()
    start = Path(head).expanduser() if head is not None else current.path if current else default_head(model)
    with store.adapting() as candidate:
        adapted = adapt(model, traffic, candidate, start, minutes, steps, config, force=True, arguments=arguments)
        if adapted.result.out is None:
            return adapted, None
        store.drop_features(candidate)
        if not adapted.improved:
            store.discard(candidate)
            return adapted, None
        report = {
            "started_from": str(start),
            "steps": adapted.result.state.step,
            "before": adapted.before,
            "after": adapted.after,
        }
        return adapted, store.publish(candidate, report)
