"""The model runner: compiled execution changes no result, falls back cleanly, and the
platform decides the dtype "auto" picks.

References: the eager target alone (greedy, float32) for every compiled run; exact
distributions for sampling stay with test_distribution.py, whose rejection sampler is the
same code whichever way the model ran.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from helpers import save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.platform import Platform, auto_dtype, detect_platform
from specdec.worker import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
AVX2 = Platform("cpu", "AVX2", native_bf16=False, native_fp16=False)
AVX512_BF16 = Platform("cpu", "AVX512", native_bf16=True, native_fp16=False)


@pytest.fixture(scope="module")
def eager_outputs(tiny_pair):
    """Greedy token ids of the eager target alone for three ragged prompts."""
    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="off", speculative_method="none")
    return {tuple(p): llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS}


PROMPTS = [list(torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()) for n in (5, 13, 31)]


@pytest.mark.slow
def test_compiled_target_alone_equals_eager(tiny_pair, eager_outputs):
    """float32 greedy, compiled (static cache, batch padded to its bucket, prompts of 5 and
    13 tokens through the compiled query bucket or eagerly): token for token the eager output."""
    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="on", speculative_method="none")
    outputs = llm.generate(PROMPTS, GREEDY)  # a ragged batch of 3: padded to 4 rows
    assert token_ids(outputs) == [eager_outputs[tuple(p)] for p in PROMPTS]
    assert llm.runner.query_buckets == (1,) and llm.runner.cache.static
    assert llm.runner.cache.max_batch == 4 + 1  # the bucket, and the scratch slot
    assert llm.runner.compile_seconds > 0


@pytest.mark.slow
def test_generating_compiles_nothing_after_warm_up(tiny_pair, eager_outputs):
    """Shapes are static: once the engine is prepared (compiling every forward it will run),
    a generate of ragged prompts traces no new graph, whichever slots its rows hold."""
    from torch._dynamo.utils import counters

    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="on", speculative_method="none")
    llm.generate(PROMPTS, GREEDY)  # prepares and compiles
    graphs_before = counters["stats"]["unique_graphs"]
    assert graphs_before > 0
    outputs = llm.generate(PROMPTS[::-1], GREEDY)  # other slots, other lengths
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert token_ids(outputs) == [eager_outputs[tuple(p)] for p in PROMPTS[::-1]]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "lookup_then_draft"])
def test_compiled_speculation_equals_eager_target_alone(tiny_pair, eager_outputs, method):
    """Target and draft compiled, k=3: the verify forward runs at 4 queries (rounds with fewer
    drafts padded to it), the draft at 1 and 2; the output is the eager target's. The draft
    model is the target itself (compiled at other shapes: its drafts are nearly all accepted)
    at a fixed k, or a different random model behind prompt lookup with k by goodput (whose
    plain rounds run the target's 1-query graph)."""
    draft = tiny_pair["target"] if method == "draft_model" else tiny_pair["draft"]
    k_policy = "fixed" if method == "draft_model" else "goodput"
    llm = LLM(
        str(tiny_pair["target"]),
        speculative_model=str(draft),
        speculative_method=method,
        num_speculative_tokens=3,
        dtype="float32",
        compile="on",
        speculative_k_policy=k_policy,
    )
    assert token_ids(llm.generate(PROMPTS[:1], GREEDY)) == [eager_outputs[tuple(PROMPTS[0])]]  # batch of one
    outputs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outputs) == [eager_outputs[tuple(p)] for p in PROMPTS]
    draft_runner = llm.engine.drafter.drafter.runner if method == "lookup_then_draft" else llm.engine.drafter.runner
    assert llm.runner.query_buckets == ((4,) if k_policy == "fixed" else (1, 4))
    assert draft_runner.query_buckets == (1, 2)
    if method == "draft_model":
        assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0.9 * sum(
            o.metrics.num_draft_tokens for o in outputs
        )


@pytest.mark.slow
def test_two_models_of_one_shape_each_run_their_own_weights(tiny_pair, eager_outputs, tmp_path):
    """Compiled graphs freeze weights as constants: a second model of the same shape must not
    run the first one's."""
    other = save_tiny_model(tmp_path / "other", "llama", seed=14, init_std=0.3)
    first = LLM(str(tiny_pair["target"]), dtype="float32", compile="on", speculative_method="none").generate(
        PROMPTS[:1], GREEDY
    )
    second = LLM(str(other), dtype="float32", compile="on", speculative_method="none").generate(PROMPTS[:1], GREEDY)
    eager_second = LLM(str(other), dtype="float32", compile="off", speculative_method="none").generate(
        PROMPTS[:1], GREEDY
    )
    assert token_ids(first) == [eager_outputs[tuple(PROMPTS[0])]] and token_ids(second) == token_ids(eager_second)
    assert token_ids(first) != token_ids(second)


@pytest.mark.slow
def test_compiled_sampling_with_a_seed_equals_eager(tiny_pair):
    """A seeded sampled request draws the same random numbers either way; in float32 the
    compiled models' probabilities differ from eager ones by rounding only, so the tokens agree."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=3, ignore_eos=True)
    runs = [
        LLM(
            str(tiny_pair["target"]),
            speculative_model=str(tiny_pair["draft"]),
            num_speculative_tokens=3,
            dtype="float32",
            compile=mode,
        ).generate(PROMPTS, params)
        for mode in ("off", "on")
    ]
    assert token_ids(runs[0]) == token_ids(runs[1])


def test_a_compilation_that_fails_falls_back_to_eager_with_one_warning(tiny_pair, eager_outputs, monkeypatch):
    def broken_compile(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("no C compiler found")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="on", speculative_method="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = llm.generate(PROMPTS, GREEDY)
        second = llm.generate(PROMPTS[:1], GREEDY)
    messages = [str(w.message) for w in caught if "could not be compiled" in str(w.message)]
    assert len(messages) == 1 and "no C compiler found" in messages[0] and "eagerly" in messages[0]
    assert token_ids(first) == [eager_outputs[tuple(p)] for p in PROMPTS]
    assert token_ids(second) == [eager_outputs[tuple(PROMPTS[0])]]
    assert not llm.runner.cache.static  # eager from then on, on a cache sized to the work


def test_auto_compiles_only_long_work(tiny_pair):
    """compile="auto": eager for short work; the decision is the runner's, from the work's size."""
    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="auto", speculative_method="none")
    llm.generate(PROMPTS, GREEDY)
    assert not llm.runner.cache.static and llm.runner.compile_seconds == 0


def test_compile_mode_is_validated(tiny_pair):
    with pytest.raises(ValueError, match="compile must be one of"):
        LLM(str(tiny_pair["target"]), compile="yes", speculative_method="none")


@pytest.mark.parametrize(
    "saved, platform, expected",
    [
        (torch.bfloat16, AVX2, torch.float32),
        (torch.bfloat16, AVX512_BF16, torch.bfloat16),
        (torch.float16, AVX512_BF16, torch.float32),
        (torch.float32, AVX512_BF16, torch.float32),
        (torch.float32, Platform("cuda", "AVX2", True, True, (9, 0)), torch.bfloat16),
        (torch.bfloat16, Platform("cuda", "AVX2", False, True, (7, 5)), torch.float16),
    ],
)
def test_auto_dtype_follows_what_the_hardware_runs_natively(saved, platform, expected):
    dtype, why = auto_dtype(saved, platform)
    assert dtype == expected and why


def test_a_bf16_checkpoint_loads_in_float32_where_bf16_is_emulated(tmp_path):
    path = save_tiny_model(tmp_path / "bf16", "llama", seed=13)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    assert LLM(str(path), platform=AVX2, speculative_method="none").target.model.dtype == torch.float32
    assert LLM(str(path), platform=AVX512_BF16, speculative_method="none").target.model.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="emulates"):  # asked for explicitly: it runs, with a warning
        assert (
            LLM(str(path), dtype="bfloat16", platform=AVX2, speculative_method="none").target.model.dtype
            == torch.bfloat16
        )


def test_the_platform_is_detected_once():
    platform = detect_platform("cpu")
    assert platform is detect_platform(torch.device("cpu")) and platform.device_type == "cpu"
    assert platform.cpu_capability == torch.backends.cpu.get_cpu_capability()


def test_eager_runner_with_auto_leaves_the_model_unpacked(tiny_pair):
    """Under "auto" the eager path packs a copy sharing the weights; the model itself stays
    plain for the compiler."""
    llm = LLM(str(tiny_pair["target"]), dtype="bfloat16", compile="auto", speculative_method="none")
    eager = llm.runner.eager_model()
    assert all(type(m) is torch.nn.Linear for m in llm.target.model.modules() if "Linear" in type(m).__name__)
    assert eager.embed_tokens.weight is llm.target.model.embed_tokens.weight
    assert isinstance(llm.runner, ModelRunner)


def test_a_graph_that_computes_wrong_logits_is_caught_and_eager_runs(tiny_pair, eager_outputs, monkeypatch):
    """The warm-up compares each compiled shape with eager on the same input: a compiler that
    returns wrong logits (here: doubled) is caught before any request uses it."""

    def wrong_compile(fn, **options):
        return lambda *args, **kwargs: 2 * fn(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", wrong_compile)
    llm = LLM(str(tiny_pair["target"]), dtype="float32", compile="on", speculative_method="none")
    with pytest.warns(UserWarning, match="differ from eager ones"):
        outputs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outputs) == [eager_outputs[tuple(p)] for p in PROMPTS] and not llm.runner.cache.static


def test_the_warm_up_check_compares_finite_logits_and_catches_nan():
    from specdec.worker.runner import _relative_error

    expected = torch.tensor([[1.0, float("-inf"), -2.0]])
    assert _relative_error(expected.clone(), expected) == 0.0
    assert abs(_relative_error(torch.tensor([[1.0, float("-inf"), -2.1]]), expected) - 0.05) < 1e-6
    assert _relative_error(torch.tensor([[1.0, 0.0, -2.0]]), expected) == float("inf")  # a -inf lost
    nan = _relative_error(torch.tensor([[float("nan"), float("-inf"), -2.0]]), expected)
    assert not nan <= 1.0  # NaN fails every threshold
