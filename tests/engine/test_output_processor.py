"""The output processor on its own: stops inside an accepted run (EOS, stop tokens, stop strings,
max_tokens), the text cut before a stop string, and streamed text that, joined, is the final
text and never shows what a stop string will cut. The reference for text is the `tokenizers`
library's own decoding of the whole output."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import make_tokenizer
from specdec import SamplingParams
from specdec.engine.output_processor import OutputProcessor
from specdec.models.tokenizer import Tokenizer
from specdec.sequence import Sequence

EOS = 1  # make_tokenizer's "</s>"
TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # three\nclass Stack:\n    pass\n"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(make_tokenizer(320))


def sequence(params: SamplingParams, prompt: list[int] | None = None) -> Sequence:
    return Sequence("r", prompt or [0, 5, 6], params, torch.Generator())


def finish(processor: OutputProcessor, seq: Sequence) -> None:
    seq.text = processor.final_text(seq)  # what the engine does when a sequence finishes


def test_eos_inside_an_accepted_run_stops_it_and_nothing_after_is_kept():
    processor = OutputProcessor(None, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=10))
    assert processor.append(seq, [7, 8, EOS, 9, 10], num_from_draft=3) == 3
    assert seq.output_token_ids == [7, 8, EOS] and seq.finish_reason == "stop"
    assert seq.output_from_draft == [True, True, True]


def test_ignore_eos_runs_on_and_a_stop_token_stops():
    processor = OutputProcessor(None, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(9,)))
    assert processor.append(seq, [7, EOS, 8], num_from_draft=1) == 3
    assert not seq.finished and seq.output_from_draft == [True, False, False]
    assert processor.append(seq, [9, 10], num_from_draft=2) == 1
    assert seq.output_token_ids == [7, EOS, 8, 9] and seq.finish_reason == "stop"


def test_max_tokens_ends_a_run_with_length():
    processor = OutputProcessor(None, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=4))
    assert processor.append(seq, [7, 8], num_from_draft=1) == 2
    assert processor.append(seq, [9, 10, 11], num_from_draft=2) == 2
    assert seq.output_token_ids == [7, 8, 9, 10] and seq.finish_reason == "length"


def test_a_stop_string_stops_at_the_token_that_completes_it_and_the_text_ends_before_it(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "return"
    processor = OutputProcessor(tokenizer, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=200, stop=(stop,)))
    emitted = processor.append(seq, ids, num_from_draft=len(ids))
    # the reference: the fewest tokens whose decoded text holds the stop string
    first = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.backend.decode(ids[:n]))
    assert emitted == first and seq.output_token_ids == ids[:first] and seq.finish_reason == "stop"
    finish(processor, seq)
    full = tokenizer.backend.decode(ids[:first])
    assert seq.text == full[: full.index(stop)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(tokenizer, seed):
    """vLLM's include_stop_str_in_output: the same stop, the text through the stop string (the
    first to start, the shorter of two starting there), whole and streamed."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stops = rng.choice([("return",), ("+ b", "+ b\n\nprint"), ("three", "Stack")])
    processor = OutputProcessor(tokenizer, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=200, stop=stops, include_stop_str_in_output=True))
    seq.stream_text = True
    deltas, at = [], 0
    while not seq.finished:
        at += processor.append(seq, ids[at : at + rng.randint(1, 6)], num_from_draft=0)
        if seq.finished:
            finish(processor, seq)
        output = processor.new_output(seq)
        if output is not None:
            deltas.append(output.outputs[0].text)
    full = tokenizer.backend.decode(ids[:at])
    start = min(full.index(s) for s in stops if s in full)
    stop = min((s for s in stops if full.find(s) == start), key=len)
    assert seq.finish_reason == "stop" and "".join(deltas) == seq.text == full[: start + len(stop)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_text_joins_into_the_final_text_and_never_shows_a_stop_string(tokenizer, seed):
    """Tokens arrive in runs of random length (as rounds accept them); a stop string, when the
    output holds one, is cut; each delta is text that later tokens cannot change."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stops = (rng.choice([" + b", "three", "Stack", "not in the text"]),)
    processor = OutputProcessor(tokenizer, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=len(ids), stop=stops))
    seq.stream_text = True
    deltas, at = [], 0
    while not seq.finished:
        run = ids[at : at + rng.randint(1, 6)]
        at += processor.append(seq, run, num_from_draft=rng.randint(0, len(run)))
        if seq.finished:
            finish(processor, seq)
        output = processor.new_output(seq)
        if output is not None:
            deltas.append(output.outputs[0].text)
            assert not any(stop in "".join(deltas) for stop in stops)
    full = tokenizer.backend.decode(ids[:at])
    cut = min((full.index(s) for s in stops if s in full), default=len(full))
    assert "".join(deltas) == seq.text == full[:cut]
    assert seq.finish_reason == ("stop" if cut < len(full) else "length")


@pytest.mark.parametrize("seed", range(4))
def test_with_min_tokens_a_stop_string_counts_where_it_ends_in_a_later_token(tokenizer, seed):
    """vLLM's rule, computed here from the `tokenizers` library's decoding of each prefix: no stop
    is checked before min_tokens; from the min_tokens-th token on, a stop string counts where it
    ends in that token's text or a later one's (one that ended before does not). The tokens are
    appended in random runs, and the final text is cut before the stop that counted."""
    rng = random.Random(seed)
    raw = make_tokenizer(320)
    output = raw.encode(TEXT * 3, add_special_tokens=False).ids
    stop = rng.choice(["add", "(a", "pass", "return"])
    min_tokens = rng.randint(2, len(output) // 2)
    held = len(raw.decode(output[: min_tokens - 1]))
    want_length, want_text = len(output), raw.decode(output)
    for n in range(min_tokens, len(output) + 1):
        text = raw.decode(output[:n])
        at = text.find(stop, max(0, held - len(stop) + 1))
        if at >= 0:
            want_length, want_text = n, text[:at]
            break
    processor = OutputProcessor(tokenizer, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=len(output), stop=stop, min_tokens=min_tokens), prompt=[])
    position = 0
    while not seq.finished and position < len(output):
        run = output[position : position + rng.randint(1, 5)]
        position += processor.append(seq, run, num_from_draft=0)
    finish(processor, seq)
    assert len(seq.output_token_ids) == want_length
    assert seq.text == want_text
    assert TEXT.count(stop) > 0 and held > 0


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_false_writes_them_in_the_text(tokenizer, skip):
    """vLLM's skip_special_tokens: the text as the tokenizers library decodes the output with and
    without its special tokens (EOS inside an output that ignores it)."""
    ids = (
        tokenizer.encode("def add(a, b):", add_special_tokens=False)
        + [EOS]
        + tokenizer.encode(" return a", add_special_tokens=False)
    )
    processor = OutputProcessor(tokenizer, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip))
    processor.append(seq, ids, num_from_draft=0)
    finish(processor, seq)
    assert seq.text == tokenizer.backend.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in seq.text) == (not skip)


def test_the_time_to_first_token_is_stamped_by_the_first_token_only(monkeypatch):
    processor = OutputProcessor(None, eos_token_ids=(EOS,))
    seq = sequence(SamplingParams(max_tokens=10))
    seq.arrival_time = 10.0
    clock = iter([12.5, 20.0])  # the first token's round, then the finish: read once each
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    processor.append(seq, [], num_from_draft=0)  # a prefill chunk under way: no token yet
    processor.append(seq, [7], num_from_draft=0)
    processor.append(seq, [8, 9], num_from_draft=1)
    processor.finish(seq)
    assert seq.stats.first_token_seconds == 2.5 and seq.stats.seconds == 10.0
