"""The bench's adaptation row (`specdec bench --llama-cpp --adapt N`): does a head adapted to a
job's own traffic draft that job better?

The job is one prompt set sent one after another (the batch job by default). Its first N
requests are served as a server with `--learn DIR` serves them: specdec's default (auto), each
finished request handed to the same Recorder (serve/recorder.py) through Engine.finish_listeners.
Then `specdec adapt` fine-tunes the head in use (--head) on that record for --adapt-minutes
(training/adapt.py, in this process, after the recording and before any timed run). The
requests after the first N, never recorded, are the held-out ones the comparison measures: the
head as given ("eagle") beside the adapted head ("adapted_eagle"), each alone.

adapt's own held-out estimate (the last quarter of the recorded requests, drafting step by step)
is reported beside the measured one, before and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

Say = Callable[[str], None]

RECORD_MAX_BYTES = 1 << 30


def record_and_adapt(
    model: str,
    head: str,
    runner,
    recorded: list[tuple],
    minutes: float,
    work_dir: Path,
    say: Say,
    seed: int = 0,
) -> tuple[Path | None, dict]:
    """Serve recorded ((prompt, token ids, text) each, in the job's order) with runner (a
    SpecdecRunner), recording them as `serve --learn` does into work_dir/traffic, then adapt head
    on them for minutes into work_dir/head. (the adapted head's directory, None where adapt wrote
    none; what was recorded and what adapt measured, JSON-ready)."""
    from specdec.serve.recorder import Recorder
    from specdec.tools.training.adapt import adapt

    traffic, adapted = work_dir / "traffic", work_dir / "head"
    llm = runner.llm
    recorder = Recorder(traffic, model, llm.target.model.config.vocab_size, RECORD_MAX_BYTES)
    llm.engine.finish_listeners.append(recorder.record)
    start, tokens = time.perf_counter(), 0
    try:
        for index, (prompt, ids, text) in enumerate(recorded):
            say(f"[recording {index + 1}/{len(recorded)}] {prompt.name} ({len(ids)} prompt tokens)")
            tokens += runner(ids, text, seed + index).tokens
    finally:
        llm.engine.finish_listeners.remove(recorder.record)
        recorder.close()
    recording_seconds = time.perf_counter() - start
    say(f"recorded {recorder.num_recorded} requests; adapting {head} on them for at most {minutes:g} min")
    start = time.perf_counter()
    result = adapt(model, traffic, adapted, head=head, minutes=minutes, force=True)
    summary = {
        "requests": len(recorded),
        "recorded": recorder.num_recorded,
        "recorded_prompts": [prompt.name for prompt, _, _ in recorded],
        "recording_tokens": tokens,
        "recording_tokens_per_s": tokens / recording_seconds,
        "minutes": minutes,
        "adapt_seconds": time.perf_counter() - start,
        "steps": result.result.state.step,
        "training_seconds": result.result.state.seconds,
        "before": _estimates(result.before),
        "after": _estimates(result.after),
        "improved": result.improved,
    }
    return result.result.out, summary


def _estimates(evaluation: dict) -> dict:
    """adapt's held-out measures: agreement by drafting step and the tau they predict."""
    keys = sorted(k for k in evaluation if k.startswith("held_out_agreement_"))
    return {
        "agreement_by_step": [evaluation[k] for k in keys],
        "greedy_agreement": evaluation.get("held_out_greedy_agreement"),
        "tau_estimate": evaluation["held_out_tau_estimate"],
    }
