"""`specdec bench` on a tiny pair: every configuration measured with sane values, the greedy
exactness check, the report files, and clear errors. Speed is printed by the bench, never
asserted here."""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import random
import re
import shutil
import sys

import pytest
import torch

from helpers import save_random_head, save_tiny_model
from specdec import SamplingParams
from specdec.tools.benchmark import commands
from specdec.tools.benchmark.exactness import compare, first_divergence
from specdec.tools.benchmark.goals import evaluate_goals
from specdec.tools.benchmark.prompts import held_out_code_prompts, repeated_code_prompts
from specdec.tools.benchmark.report import PLOTS, write_report
from specdec.tools.benchmark.run import (
    GREEDY,
    TARGET_ALONE,
    TRANSFORMERS_PLAIN,
    BenchConfig,
    Method,
    Record,
    Run,
    check_greedy_exactness,
    run_benchmark,
    transformers_runners,
)
from specdec.tools.training.corpus import stdlib_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KS = (1, 2)
TINY = dict(max_tokens=6, prompts_per_set=1, max_prompt_chars=200, bandwidth_bytes=16 << 20, step_repeats=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 2-layer target and a 1-layer draft with the same tokenizer (same vocab and text)."""
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model(root / "target", "llama", seed=0, init_std=0.3)
    draft = save_tiny_model(root / "draft", "llama", seed=1, init_std=0.3, num_hidden_layers=1)
    return target, draft


@pytest.fixture(scope="module")
def results(pair):
    target, draft = pair
    head = save_random_head(target, target.parent / "head", seed=2)
    return run_benchmark(
        BenchConfig(
            model=str(target),
            draft=str(draft),
            ks=KS,
            adaptive_confidence=0.5,
            head=str(head),
            trees=("auto", "2,1"),
            early_exit_layer=1,
            **TINY,
        )
    )


@pytest.fixture(scope="module")
def report(results, tmp_path_factory):
    return write_report(results, tmp_path_factory.mktemp("bench_out"))


def expected_methods() -> set[tuple[str, str, int]]:
    speculative = {
        (engine, drafter, k)
        for engine in ("specdec",)
        for drafter in ("draft_model", "ngram", "lookup_then_draft")
        for k in KS
    }
    transformers = {("transformers", "none", 0), ("transformers", "draft_model", 2), ("transformers", "ngram", 2)}
    adaptive = {("specdec", "draft_model_adaptive", max(KS)), ("specdec", "draft_model_goodput", max(KS))}
    # at the comparison k (transformers_k: the largest of KS), the head, the trees and early exit
    self_drafting = {("specdec", method, max(KS)) for method in SELF_DRAFTING}
    return {("specdec", "none", 0)} | speculative | adaptive | transformers | self_drafting


SELF_DRAFTING = ("eagle", "eagle_tree", "draft_model_tree", "early_exit")
TREE_ROWS = 2  # of each *_tree method: one per shape


def formula(alpha: float, k: int, c: float) -> float:
    """(1 - α^(k+1)) / ((1 - α)(k·c + 1)), written out here, apart from specdec.metrics."""
    tokens_per_round = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens_per_round / (k * c + 1)


def test_every_configuration_has_a_row(results):
    for set_name in ("code", "repeat"):
        for sampling in ("greedy", "sampled"):
            rows = [r for r in results["rows"] if (r["prompt_set"], r["sampling"]) == (set_name, sampling)]
            assert {(r["engine"], r["method"], r["k"]) for r in rows} == expected_methods()
            assert len(rows) == len(expected_methods()) + 2 * (TREE_ROWS - 1)
            assert {r["label"] for r in rows if r["method"] == "eagle_tree"} == {
                "specdec eagle head tree auto, 2 nodes",
                "specdec eagle head tree 2,1, 2 nodes",
            }
            assert all(r["prompts"] == 1 and r["tokens"] >= 1 and r["tokens_per_s"] > 0 for r in rows)


def test_speedup_is_relative_to_the_target_alone(results):
    for r in results["rows"]:
        if r["label"] == TARGET_ALONE.label:
            assert r["speedup"] == pytest.approx(1.0, abs=1e-12) and r["tau"] == pytest.approx(1.0)
            assert r["decode_speedup"] == pytest.approx(1.0, abs=1e-12)
            assert r["profile"]["rounds"] == r["tokens"] - r["prompts"]  # one token a round after the prefill
        base = next(
            b
            for b in results["rows"]
            if b["label"] == TARGET_ALONE.label and (b["prompt_set"], b["sampling"]) == (r["prompt_set"], r["sampling"])
        )
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        if r["engine"] == "specdec":
            assert r["decode_speedup"] == pytest.approx(r["decode_tokens_per_s"] / base["decode_tokens_per_s"])
        else:
            assert r["decode_speedup"] is None and r["alpha"] is None and r["profile"] is None


def test_speculative_rows_are_sane(results):
    cost_ratio = results["costs"]["cost_ratio"]
    assert cost_ratio > 0 and results["costs"]["target_step_ms"] > 0
    for r in (r for r in results["rows"] if r["engine"] == "specdec" and r["method"] != "none"):
        if r["method"] in ("draft_model_adaptive", "draft_model_goodput", "lookup_then_draft", *SELF_DRAFTING):
            # k or c varies, or the formula does not model the drafter (a head, a tree, early exit)
            assert r["cost_ratio"] is None and r["predicted_speedup"] is None and 1 <= r["tau"] <= r["k"] + 1
            assert r["cost_ratio_in_rounds"] is None and r["predicted_in_rounds"] is None
            if r["method"] == "draft_model_goodput":  # how many rounds took each k
                assert sum(r["rounds_by_k"]) == r["profile"]["rounds"] and len(r["rounds_by_k"]) <= r["k"] + 1
            continue
        if r["alpha"] is None:  # prompt lookup found no match: nothing proposed, nothing predicted
            assert r["method"] == "ngram" and r["tau"] == 1 and r["acceptance_by_position"] == []
            assert r["predicted_speedup"] is None
            continue
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tau"] <= r["k"] + 1
        assert r["cost_ratio"] == (cost_ratio if r["method"] == "draft_model" else 0.0)
        assert r["predicted_speedup"] == pytest.approx(formula(r["alpha"], r["k"], r["cost_ratio"]))
        if r["method"] == "draft_model":  # the verify forward's measured cost replaces the formula's 1
            v = results["costs"]["verify_cost_ratio"][str(r["k"])]
            assert v > 0.5 and r["predicted_with_verify_cost"] == pytest.approx(
                formula(r["alpha"], r["k"], r["cost_ratio"])
                * (r["k"] * r["cost_ratio"] + 1)
                / (r["k"] * r["cost_ratio"] + v)
            )
        assert r["tokens_per_round"] == pytest.approx((r["tokens"] - 1) / r["profile"]["rounds"])
        assert r["predicted_from_tau"] == pytest.approx(r["tokens_per_round"] / (r["k"] * r["cost_ratio"] + 1))
        target_alone = next(
            t
            for t in results["rows"]
            if t["label"] == "specdec target alone"
            and (t["prompt_set"], t["sampling"]) == (r["prompt_set"], r["sampling"])
        )
        target_step = target_alone["profile"]["seconds"]["target"] / target_alone["profile"]["rounds"]
        draft_step = r["profile"]["seconds"]["draft"] / (r["profile"]["rounds"] * r["k"])
        assert r["cost_ratio_in_rounds"] == pytest.approx(draft_step / target_step) and draft_step > 0
        assert r["predicted_in_rounds"] == pytest.approx(formula(r["alpha"], r["k"], r["cost_ratio_in_rounds"]))
        if r["method"] == "draft_model":  # proposes k tokens every round: every position is measured
            assert len(r["acceptance_by_position"]) == r["k"]
            assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
        seconds = r["profile"]["seconds"]
        assert set(seconds) == {"prefill", "draft", "target", "sampling", "bookkeeping", "other"}
        assert sum(seconds.values()) == pytest.approx(r["seconds"], rel=1e-6) and seconds["target"] > 0
    assert results["roofline"]["ceiling_tokens_per_s"] > 0
    assert 0 < results["rows"][0]["roofline_fraction"] < math.inf


def test_target_as_its_own_draft_accepts_everything(pair):
    target, _ = pair
    results = run_benchmark(
        BenchConfig(
            model=str(target),
            draft=str(target),
            ks=(3,),
            prompt_sets=("code",),
            samplings=(GREEDY,),
            with_transformers=False,
            adaptive_confidence=0.6,
            **TINY,
        )
    )
    row = next(r for r in results["rows"] if r["method"] == "draft_model")
    assert row["alpha"] == 1.0 and row["acceptance_by_position"] == [1.0, 1.0, 1.0] and row["tau"] > 1
    assert row["predicted_speedup"] == pytest.approx(4 / (3 * results["costs"]["cost_ratio"] + 1))
    adaptive = next(r for r in results["rows"] if r["method"] == "draft_model_adaptive")
    assert adaptive["label"] == "specdec draft model adaptive k<=3" and adaptive["alpha"] == 1.0
    assert 1 < adaptive["tau"] < row["tau"]  # it stopped drafting where the draft was unsure
    assert results["exactness"] == {"compared": 5, "identical": 5, "divergences": []}  # 5 speculative rows
    assert not any(r["engine"] == "transformers" for r in results["rows"])


def test_a_goodput_rows_sampled_request_leaves_k_to_goodput_and_seeds_the_shared_stream(pair):
    """A seeded sampled request keeps the fixed k (k_choice.py), so the goodput row's sampled
    runs carry no seed of their own (the seed seeds the stream unseeded requests share): every
    round's k is goodput's."""
    from specdec import LLM
    from specdec.tools.benchmark.run import SAMPLED, SpecdecRunner

    target, draft = pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, dtype="float32")
    runner, policy = SpecdecRunner(llm), llm.engine.k_choice.policy
    params = SAMPLED.params(12, seed=5)
    ids = list(range(3, 20))
    before = sum(policy.k_counts.values())
    first = runner(ids, params)
    assert first.stats is not None
    rounds = first.stats.num_target_forwards - 1
    assert rounds and sum(policy.k_counts.values()) - before == rounds
    assert params.seed == 5  # the caller's params are left as they were


def test_without_transformers_its_rows_are_skipped_with_a_note(pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    notes = []
    assert transformers_runners(BenchConfig(model=str(pair[0])), None, None, notes) == {}
    assert notes == ["transformers is not installed: its rows are skipped (pip install transformers)."]


def test_transformers_baseline_ignores_the_checkpoints_generation_settings_and_stops_at_every_eos(tmp_path):
    """A generation_config.json with a repetition penalty, and EOS ids in config.json only:
    transformers' plain generate still gives the target alone's greedy tokens, and a draft
    with a padded vocabulary gets a note, not a crash, from assisted generation."""
    from specdec import LLM

    target = save_tiny_model(tmp_path / "target", "llama", seed=0, init_std=0.3)
    prompt = [5, 9, 14, 3, 8, 21]
    plain = LLM(str(target), dtype="float32", speculative_method="none").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    generated = plain.outputs[0].token_ids
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = [1, generated[3]]  # the 4th greedy token ends the output
    (target / "config.json").write_text(json.dumps(config))
    generation = json.loads((target / "generation_config.json").read_text())
    generation["repetition_penalty"] = 1.3
    (target / "generation_config.json").write_text(json.dumps(generation))
    draft = save_tiny_model(tmp_path / "draft", "llama", seed=1, init_std=0.3, vocab_size=384, tokenizer=False)
    shutil.copyfile(target / "tokenizer.json", draft / "tokenizer.json")

    config = BenchConfig(model=str(target), draft=str(draft), ks=(2,), **TINY)
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=2, dtype=config.dtype)
    notes = []
    runners = transformers_runners(config, llm, llm.engine.drafter.runner, notes)
    assert set(m.drafter for m in runners) == {"none", "ngram"} and any("vocab_size" in note for note in notes)
    params = SamplingParams(temperature=0, max_tokens=12)
    ours = llm.target_only().generate(prompt, params)[0].outputs[0].token_ids
    assert ours == generated[:4] and runners[TRANSFORMERS_PLAIN](prompt, params).token_ids == ours


def test_greedy_outputs_are_identical(results):
    # each speculative method (adaptive, goodput, the head, trees, early exit too) vs the target alone; the
    # target vs transformers
    per_set = 3 * len(KS) + 3 + len(SELF_DRAFTING) + 2 * (TREE_ROWS - 1)
    assert results["exactness"] == {"compared": 2 * per_set, "identical": 2 * per_set, "divergences": []}


def test_first_divergence():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([], []) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6], [5, 6, 7]) == 2
    assert first_divergence([4], [5]) == 0
    divergence = compare("p.py:f", "ours", [1, 2, 3, 4, 5, 6, 7], "theirs", [1, 2, 9, 4])
    assert (divergence.prompt, divergence.position) == ("p.py:f", 2)
    assert divergence.checked_tokens == (3, 4, 5, 6) and divergence.reference_tokens == (9, 4)
    assert "first differs at token 2" in divergence.describe()
    assert compare("p", "ours", [1, 2], "theirs", [1, 2]) is None


def test_exactness_check_reports_where_outputs_part():
    draft_k2 = Method("specdec", "draft_model", 2)
    runs = {TARGET_ALONE: [1, 2, 3, 4], draft_k2: [1, 2, 8, 4], TRANSFORMERS_PLAIN: [1, 2, 3, 4]}
    records = [Record("code", GREEDY.name, "m.py:f", method, Run(tokens, 0.1)) for method, tokens in runs.items()]
    records.append(Record("code", "sampled", "m.py:f", draft_k2, Run([7, 7, 7], 0.1)))  # sampled: not checked
    exactness = check_greedy_exactness(records)
    assert exactness["compared"] == 2 and exactness["identical"] == 1
    [divergence] = exactness["divergences"]
    assert divergence["checked"] == draft_k2.label and divergence["reference"] == TARGET_ALONE.label
    assert divergence["position"] == 2 and divergence["prompt"] == "m.py:f"
    assert (divergence["checked_tokens"], divergence["reference_tokens"]) == ((8, 4), (3, 4))


def test_report_files(results, report):
    saved = json.loads(report["json"].read_text())
    assert len(saved["rows"]) == len(results["rows"]) and saved["machine"]["cores"] >= 1
    assert {g["met"] for g in saved["goals"]} <= {True, False, None} and len(saved["goals"]) == 5
    text = report["markdown"].read_text()
    for heading in (
        "Verdict: the goals",
        "Costs and roofline",
        "held-out code completion",
        "repeating code",
        "Greedy exactness",
        "Where the time goes",
    ):
        assert heading in text
    assert all(re.search(rf"^\| {re.escape(r['label'])} +\|", text, re.MULTILINE) for r in results["rows"])
    assert all(len(line) <= 100 for line in text.splitlines())
    for name in PLOTS:
        data = report[name].read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_write_docs(results, report, tmp_path):
    from specdec.tools.benchmark.report import KEPT_MARKER, write_docs

    page = write_docs(results, report, tmp_path / "docs", "specdec bench --quick").read_text()
    assert "specdec bench --quick" in page and results["machine"]["cpu"] in page and results["machine"]["torch"] in page
    assert all((tmp_path / "docs" / "benchmarks" / name).read_bytes().startswith(PNG_SIGNATURE) for name in PLOTS)
    hand_written = f"{KEPT_MARKER}\n\n## Another model\n\n| a | b |\n"
    (tmp_path / "docs" / "benchmarks.md").write_text(page + "\n" + hand_written)
    rewritten = write_docs(results, report, tmp_path / "docs", "specdec bench --quick --seed 1").read_text()
    assert rewritten.startswith(page.replace("--quick", "--quick --seed 1", 1)) and rewritten.endswith(hand_written)


# -- the printed report: 100 columns, units in the headers, the verdict first ------------------------

LONG_DRAFTER = "specdec draft model distilled on-policy from the target with a very long name of its own k=8"
LONG_MODEL = "Qwen2.5-Coder-32B-Instruct-abliterated-q4_k_m-imatrix-calibrated-on-the-stack-v2-2026-11"


def long_results() -> dict:
    """A results dict as run_benchmark gives, with realistic values and long names: every k up
    to 8, every drafter (a tree of many levels, early exit at the default depth, a drafter with
    a long name), long model names, a divergence, quantization quality and the notes."""
    from specdec.tools.benchmark.run import _method_notes

    methods = (
        [TARGET_ALONE]
        + [Method("specdec", "draft_model", k) for k in range(1, 9)]
        + [Method("specdec", "draft_model_adaptive", 8), Method("specdec", "draft_model_goodput", 8)]
        + [Method("specdec", "ngram", k) for k in range(1, 9)]
        + [Method("specdec", "lookup_then_draft", k) for k in range(1, 9)]
        + [
            Method("specdec", "eagle", 5),
            Method("specdec", "eagle_tree", 5, "4,3,3,2,2,1,1,1,1,1"),
            Method("specdec", "draft_model_tree", 5, "auto"),
            Method("specdec", "early_exit", 5),
        ]
        + [TRANSFORMERS_PLAIN, Method("transformers", "draft_model", 5), Method("transformers", "ngram", 5)]
    )
    rows = []
    for set_name in ("code", "repeat"):
        for sampling in ("greedy", "sampled"):
            for n, method in enumerate(methods + [Method("specdec", "draft_model_goodput", 8)]):
                label = LONG_DRAFTER if n == len(methods) else method.label
                speculative = method.engine == "specdec" and method.drafter != "none"
                fixed_k = method.engine == "specdec" and method.drafter in ("draft_model", "ngram")
                k = method.k
                row = {
                    "prompt_set": set_name,
                    "sampling": sampling,
                    "engine": method.engine,
                    "method": method.drafter,
                    "k": k,
                    "label": label,
                    "prompts": 8,
                    "tokens": 1024,
                    "seconds": 1024 / (12345.6 - 97 * n),
                    "tokens_per_s": 12345.6 - 97 * n,
                    "speedup": 10.25 - 0.1 * n,
                    "decode_speedup": 11.5 - 0.1 * n if method.engine == "specdec" else None,
                    "alpha": 0.812 if speculative else None,
                    "tau": (4.23 if speculative else 1.0) if method.engine == "specdec" else None,
                    "acceptance_by_position": [0.78, 0.63, 0.46, 0.39, 0.35, 0.32, 0.27, 0.23][:k]
                    if speculative
                    else None,
                    "rounds_by_k": [5, 11, 20, 24, 55, 0, 3, 0, 31]
                    if method.drafter == "draft_model_goodput"
                    else None,
                    "cost_ratio": 0.092 if fixed_k else None,
                    "predicted_speedup": 12.63 if fixed_k else None,
                    "predicted_with_verify_cost": 2.32 if fixed_k else None,
                    "tokens_per_round": 4.2 if fixed_k else None,
                    "predicted_from_tau": 2.5 if fixed_k else None,
                    "cost_ratio_in_rounds": 10.137 if fixed_k else None,
                    "predicted_in_rounds": 2.18 if fixed_k else None,
                    "decode_tokens_per_s": 13456.7 if method.engine == "specdec" else None,
                    "roofline_fraction": 0.48 if method.engine == "specdec" else None,
                    "profile": {
                        "rounds": 12345,
                        "seconds": {
                            "prefill": 0.4,
                            "draft": 123.4,
                            "target": 1234.5,
                            "sampling": 12.3,
                            "bookkeeping": 1.2,
                            "other": 0.1,
                        },
                    }
                    if method.engine == "specdec"
                    else None,
                }
                rows.append(row)
    model = {
        "path": f"/home/someone/models/{LONG_MODEL}",
        "parameters": 32_763_876_352,
        "dtype": "torch.bfloat16",
        "quantization": "q4_k_m",
    }
    results = {
        "machine": {
            "cpu": "AMD EPYC 9654 96-Core Processor",
            "cores": 192,
            "torch_threads": 192,
            "gpu": None,
            "torch": "2.13.0+cpu",
            "python": "3.11.7",
            "date": "2026-11-26 03:34 UTC",
        },
        "config": {
            "ks": list(range(1, 9)),
            "transformers_k": 5,
            "max_tokens": 128,
            "device": "cpu",
            "samplings": [
                {"name": "greedy", "temperature": 0.0, "top_p": 1.0},
                {"name": "sampled", "temperature": 0.8, "top_p": 0.95},
            ],
        },
        "models": {"target": model, "draft": {**model, "path": f"/models/{LONG_MODEL}-draft"}},
        "prompt_sets": {
            "code": {"title": "held-out code completion", "prompts": ["a"] * 8},
            "repeat": {"title": "repeating code already in the prompt", "prompts": ["b"] * 8},
        },
        "costs": {
            "target_step_ms": 1234.567,
            "draft_step_ms": 123.456,
            "cost_ratio": 0.1,
            "verify_cost_ratio": {str(k): 1.0 + k / 10 for k in range(1, 9)},
        },
        "roofline": {
            "buffer_bytes": 1 << 30,
            "read_bandwidth_gb_per_s": 1234.5,
            "decode_weight_bytes": 19e9,
            "step_floor_ms": 15.39,
            "ceiling_tokens_per_s": 65.0,
        },
        "rows": rows,
        "exactness": {
            "compared": 120,
            "identical": 119,
            "divergences": [
                {
                    "checked": LONG_DRAFTER,
                    "reference": "specdec target alone",
                    "prompt": "_pydecimal.py:_round_half_even",
                    "position": 117,
                    "checked_tokens": [151643, 13, 262, 470, 1131, 7, 87, 1215],
                    "reference_tokens": [151643, 13, 262, 470, 1131, 7, 88, 1215],
                }
            ],
        },
        "quantization_quality": {
            "quantization": "q4_k_m",
            "prompts": 16,
            "greedy_identical": 11,
            "greedy_agreement": 0.912,
            "perplexity": 3.456,
            "reference_perplexity": 3.401,
            "perplexity_difference": 0.055,
            "tokens_per_s": 23.4,
            "reference_tokens_per_s": 9.8,
            "speedup_over_reference": 2.39,
        },
        "notes": _method_notes(torch.bfloat16) + [f"A note naming {LONG_MODEL} and {LONG_DRAFTER}."],
    }
    results["goals"] = evaluate_goals(results)
    return results


def _long_llama_cpp_results() -> dict:
    from test_llama_cpp import _results

    results = _results("native", "avx2")
    results["config"].update(model=f"/models/{LONG_MODEL}.gguf", draft=f"/models/{LONG_MODEL}-draft.gguf")
    for kind in results["cpu_kinds"]:
        kind["machine"]["cpu"] = "AMD EPYC 9654 96-Core Processor"
        for row in kind["rows"]:
            row["label"] += " (llama-speculative-simple --spec-type draft-simple, k=5)"
    return results


def _renderings():
    from specdec.tools.benchmark import report

    results = long_results()
    code = report._rows(results, "code", "greedy")
    return {
        "markdown": report.markdown(results),
        "verdict and goals": report.verdict(results),
        "speed": report.speed_table(code),
        "formula": report.formula_table([r for r in code if r["engine"] == "specdec" and r["method"] == "draft_model"]),
        "acceptance": report.acceptance_table([r for r in code if r["engine"] == "specdec"]),
        "costs": report.costs_table(results),
        "quality": report.quality_table(results["quantization_quality"]),
        "exactness": report.exactness_text(results["exactness"]),
        "profile": report.profile_tables(results),
        "llama.cpp": report.llama_cpp_markdown(_long_llama_cpp_results()),
    }


@pytest.mark.parametrize(
    "name",
    [
        "markdown",
        "verdict and goals",
        "speed",
        "formula",
        "acceptance",
        "costs",
        "quality",
        "exactness",
        "profile",
        "llama.cpp",
    ],
)
def test_every_table_fits_100_columns_with_long_names(name):
    text = _renderings()[name]
    too_wide = [line for line in text.splitlines() if len(line) > 100]
    assert too_wide == [], "\n".join(too_wide)
    assert ("|" in text) == (name != "exactness")  # a divergence is a line of its own


def test_long_names_are_wrapped_not_cut():
    """A label too long for its column goes on over continuation rows: all of its words are
    there, in order, in the first column."""
    text = _renderings()["speed"]
    first_column = []
    for line in text.splitlines():
        if line.startswith("| ") and LONG_DRAFTER.split()[0] in " ".join(first_column + [line]):
            first_column.append(line.split("|")[1].strip())
    assert " ".join(first_column).endswith(LONG_DRAFTER) and len(first_column) >= 2


def test_the_verdict_comes_first_and_the_headers_have_units():
    text = _renderings()["markdown"]
    lines = text.splitlines()
    first_table = next(n for n, line in enumerate(lines) if line.startswith("|"))
    assert lines[first_table].startswith("| goal ") and "verdict" in lines[first_table]  # the goals' table
    assert lines.index("## Verdict: the goals, on held-out code prompts") < first_table
    assert "goals met**" in "\n".join(lines[:first_table]) and "not measured" not in lines[2]
    assert text.index("goals met") < text.index("## Costs and roofline") < text.index("## held-out code")
    headers = [line for line in lines if line.startswith("|") and lines[lines.index(line) + 1].startswith("|-")]
    for unit in ("tok/s", "x plain", "decode x plain", "ms/round", "draft ms", "roofline %", "prefill %", "unit"):
        assert any(unit in header for header in headers), unit
    llama = _renderings()["llama.cpp"]
    assert llama.index("## Verdict: the fastest of each") < llama.index("|")
    assert "x llama.cpp plain" in llama and "prompt tok/s" in llama and "7-token forward ms" in llama


def test_a_table_too_wide_is_wrapped_then_split_with_its_first_column_in_each():
    from specdec.tools.benchmark.report import table

    narrow = table(["method", "tok/s"], [["a", "1.0"], ["bb", "22.0"]])
    assert narrow.splitlines() == [
        "| method | tok/s |",
        "|--------|------:|",
        "| a      |   1.0 |",
        "| bb     |  22.0 |",
    ]
    headers = ["method"] + [f"measure {n} in its unit" for n in range(8)]
    rows = [[f"method number {n} with a name of some length"] + [f"{n}.{m}" for m in range(8)] for n in range(3)]
    text = table(headers, rows)
    tables = text.split("\n\n")
    assert len(tables) == 3 and all(t.startswith("| method ") for t in tables)  # 3 columns in each
    assert all(len(line) <= 100 for line in text.splitlines())
    for header in headers[1:]:
        assert sum(header in t for t in tables) == 1  # each column once
    for row in rows:
        assert all(f" {cell} |" in text for cell in row[1:])
    assert len({len(line) for line in tables[0].splitlines()}) == 1  # padded into columns


@pytest.mark.parametrize("name", PLOTS)
def test_the_plots_legend_covers_no_data(name):
    """One legend for all panels, outside every panel, inside the figure."""
    import matplotlib.pyplot as plt

    from specdec.tools.benchmark.report import plot_figure

    figure = plot_figure(long_results(), name)
    try:
        figure.canvas.draw()
        assert all(axes.get_legend() is None for axes in figure.axes)
        if name == "tokens_per_second.png":  # bars, no legend
            assert figure.legends == []
            return
        [legend] = figure.legends
        box = legend.get_window_extent()
        assert not any(box.overlaps(axes.get_window_extent()) for axes in figure.axes)
        assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 and figure.bbox.y0 <= box.y0
        assert len(legend.get_texts()) >= 7  # every drafter's line
    finally:
        plt.close(figure)


def goal_rows(greedy: float, sampled: float, theirs: float, decode: float, predicted: float) -> list[dict]:
    common = dict(prompt_set="code", k=5, decode_speedup=None, predicted_speedup=None, label="specdec draft model k=5")
    return [
        dict(
            common,
            engine="specdec",
            method="draft_model",
            sampling="greedy",
            speedup=greedy,
            tokens_per_s=100 * greedy,
            decode_speedup=decode,
            predicted_in_rounds=predicted,
            predicted_speedup=2 * predicted,
        ),
        dict(
            common,
            engine="specdec",
            method="draft_model",
            sampling="sampled",
            speedup=sampled,
            tokens_per_s=100 * sampled,
        ),
        dict(
            common,
            engine="transformers",
            method="draft_model",
            sampling="greedy",
            speedup=theirs,
            tokens_per_s=100 * theirs,
        ),
    ]


def test_goals_say_met_missed_or_unmeasured():
    goals = evaluate_goals({"config": {"transformers_k": 5}, "rows": goal_rows(3.0, 1.5, 1.0, 2.0, 2.2)})
    greedy, sampled, vs_greedy, vs_sampled, prediction = goals
    assert greedy["met"] is True and greedy["measured"] == 3.0
    assert sampled["met"] is False and "missed by 0.30x" in sampled["detail"]
    assert vs_greedy["met"] is True and vs_greedy["measured"] == pytest.approx(3.0)
    assert vs_sampled["met"] is None and vs_sampled["detail"].startswith("not measured")
    assert prediction["met"] is True and prediction["measured"] == pytest.approx(abs(2.0 / 2.2 - 1))
    assert "with the isolated step's c: worst 55% off" in prediction["detail"]  # judged on c in the rounds
    off = evaluate_goals({"config": {"transformers_k": 5}, "rows": goal_rows(3.0, 2.0, 1.0, 1.0, 2.0)})[-1]
    assert off["met"] is False and off["measured"] == pytest.approx(0.5) and "missed by 35% points" in off["detail"]


def test_speedup_goals_take_the_best_row_drafting_with_the_draft_model_and_name_each():
    rows = goal_rows(2.0, 1.5, 1.0, 2.0, 2.2)
    hybrid = dict(
        rows[0],
        method="lookup_then_draft",
        k=4,
        speedup=2.6,
        tokens_per_s=260,
        label="specdec prompt lookup, else draft model k=4",
    )
    lookup = dict(rows[0], method="ngram", k=6, speedup=9.0, tokens_per_s=900, label="specdec prompt lookup k=6")
    greedy = evaluate_goals({"config": {"transformers_k": 5}, "rows": rows + [hybrid, lookup]})[0]
    assert greedy["met"] is True and greedy["measured"] == 2.6  # prompt lookup alone does not count
    assert "best draft model k=5: 2.00x" in greedy["detail"]
    assert "best prompt lookup, else draft model k=4: 2.60x" in greedy["detail"]


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="specdec")
    commands.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench"] + argv)


def test_quick_sizes_and_flags_that_override_them(pair):
    target, draft = pair
    quick = commands.bench_config(parse(["--model", str(target), "--draft", str(draft), "--quick"]))
    assert (quick.ks, quick.max_tokens, quick.prompts_per_set) == ((1, 3, 5), 32, 4)
    mine = commands.bench_config(
        parse(
            [
                "--model",
                str(target),
                "--quick",
                "--ks",
                "2,4",
                "--max-tokens",
                "7",
                "--prompts",
                "3",
                "--no-transformers",
            ]
        )
    )
    assert (mine.ks, mine.max_tokens, mine.prompts_per_set, mine.draft, mine.with_transformers) == (
        (2, 4),
        7,
        3,
        None,
        False,
    )
    args = parse(["--model", str(target), "--quick", "--ks", "2,4", "--write-docs"])
    assert parse(commands.command_line(args).split()[2:]) == args
    assert (mine.head, mine.trees, mine.early_exit_layer) == (None, (), None)  # a model of one's own: asked for
    shipped = commands.bench_config(parse(["--quick"]))  # the shipped pair: its head, auto trees, early exit
    assert (shipped.head, shipped.trees, shipped.early_exit_layer) == (str(commands.SHIPPED_HEAD), ("auto",), 6)
    args = parse(["--model", str(target), "--tree", "auto", "--tree", "3,2,1", "--early-exit", "1"])
    assert (commands.bench_config(args).trees, commands.bench_config(args).early_exit_layer) == (("auto", "3,2,1"), 1)
    assert parse(commands.command_line(args).split()[2:]) == args
    args = parse(["--model", str(target), "--prompt-sets", "chat,edit"])
    assert commands.bench_config(args).prompt_sets == ("chat", "edit")
    assert parse(commands.command_line(args).split()[2:]) == args


def test_the_batch_job_is_one_instruction_over_functions_no_chat_set_uses():
    """The batch set: every prompt the same instruction over one held-out function, each function
    once, none of those the write, edit or chat sets ask about."""
    from specdec.tools.benchmark.prompts import BATCH_INSTRUCTION, batch_job_prompts, held_out_chat_prompts
    from specdec.tools.training.corpus import HELD_OUT_MODULES

    batch = batch_job_prompts()
    assert len(batch) >= 32 and all(p.chat and p.text.startswith(BATCH_INSTRUCTION + "\n\n```python\n") for p in batch)
    functions = [p.name.removesuffix(" (batch)") for p in batch]
    assert len(set(functions)) == len(functions) and all(f.split(":")[0] in HELD_OUT_MODULES for f in functions)
    for kinds in (("write",), ("edit",), ("write", "edit", "explain")):
        asked = {p.name.rpartition(" (")[0] for p in held_out_chat_prompts(kinds=kinds)}
        assert asked and not asked & set(functions)


def test_chat_prompt_sets_are_rendered_with_the_chat_template(pair, tmp_path):
    """A chat prompt is a held-out module's function in a user message, encoded as the model's
    template renders it; a model without a template is refused for those sets."""
    import json
    import shutil

    from specdec import LLM
    from specdec.tools.benchmark.prompts import held_out_chat_prompts, held_out_edit_prompts
    from specdec.tools.benchmark.run import encode_prompts
    from specdec.tools.training.corpus import HELD_OUT_MODULES

    prompts = held_out_chat_prompts(per_module=1)
    assert prompts and all(p.chat and p.name.split(":")[0] in HELD_OUT_MODULES for p in prompts)
    assert {p.name.rsplit("(", 1)[1] for p in held_out_edit_prompts(per_module=1)} == {"edit)"}
    chat_model = tmp_path / "chat"
    shutil.copytree(pair[0], chat_model)
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}<s>"
    (chat_model / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(chat_model), dtype="float32", speculative_method="none")
    bench = BenchConfig(model=str(chat_model), prompt_sets=("edit",), ks=KS, **TINY)
    [(prompt, ids)] = encode_prompts(llm, bench, "edit", [])
    assert ids == llm.tokenizer.encode(f"<s>{prompt.text}</s><s>", add_special_tokens=False)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(LLM(str(pair[0]), dtype="float32", speculative_method="none"), bench, "chat", [])


def test_missing_model_directory_is_a_clear_error(pair, tmp_path):
    args = parse(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    with pytest.raises(FileNotFoundError, match="target model directory .*nowhere.* does not exist"):
        args.run(args)
    assert not (tmp_path / "out").exists()  # nothing half-done
    with pytest.raises(FileNotFoundError, match="draft model directory"):
        commands.bench_config(parse(["--model", str(pair[0]), "--draft", str(tmp_path / "nowhere")]))


def test_an_out_that_cannot_be_written_is_refused_before_measuring(pair, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    args = parse(["--model", str(pair[0]), "--no-transformers", "--out", str(tmp_path / "a_file")])
    monkeypatch.setattr("specdec.tools.benchmark.run.run_benchmark", lambda *a, **k: pytest.fail("measured first"))
    with pytest.raises(ValueError, match="is a file"):
        args.run(args)


def test_results_are_written_whole_and_an_earlier_benchs_replaced(pair, results, tmp_path, monkeypatch, capsys):
    """--out gets results.json, results.md and the plots only once the run is done (staged in
    OUT.incomplete/ until then); rerunning into it replaces the earlier results."""
    monkeypatch.setattr("specdec.tools.benchmark.run.run_benchmark", lambda *a, **k: results)
    out = tmp_path / "out"
    for _ in range(2):
        args = parse(["--model", str(pair[0]), "--no-transformers", "--out", str(out)])
        assert args.run(args) == 0
        assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "results.md", *PLOTS])
        assert not (tmp_path / "out.incomplete").exists()
    assert json.loads((out / "results.json").read_text())["prompt_sets"]
    assert f"wrote {out.resolve() / 'results.json'}" in capsys.readouterr().err


def test_missing_shipped_pair_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(commands, "SHIPPED_TARGET", tmp_path / "models" / "code-target")
    monkeypatch.setattr(commands, "SHIPPED_DRAFT", tmp_path / "models" / "code-draft")
    with pytest.raises(FileNotFoundError, match=r"shipped model pair is missing.*--model DIR.*specdec train"):
        commands.bench_config(parse([]))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ks": (0, 2)}, "ks must be distinct integers >= 1"),
        ({"ks": (2, 2)}, "ks must be distinct"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_sets": ("code", "poetry")}, "prompt sets must be among"),
        ({"device": "tpu"}, "device"),
        ({"device": "cpu:x"}, "device must be cpu, cuda or cuda:N"),
        ({"step_repeats": 0}, "step_repeats"),
        ({"bandwidth_bytes": 0}, "bandwidth_bytes"),
        ({"trees": ("chain",)}, "tree shapes"),
        ({"trees": ("3,x",)}, "speculative_tree"),
        ({"head": "."}, "not an EAGLE head directory"),
        ({"early_exit_layer": 0}, "early_exit_layer"),
    ],
)
def test_bad_configuration_values(pair, changes, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(model=str(pair[0]), **changes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(pair):
    with pytest.raises(ValueError, match="device 'cuda': CUDA is not available on this machine"):
        BenchConfig(model=str(pair[0]), device="cuda")


def test_bad_ks_flag_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse(["--ks", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_repeated_code_prompts_end_with_the_renamed_signature():
    prompts = repeated_code_prompts(per_module=1, max_chars=1200)
    assert len(prompts) >= 8
    for prompt in prompts:
        function, comment_and_signature = prompt.text.split("\n\n\n# ")
        name = prompt.name.split(":")[1].removesuffix(" (repeat)")
        assert function.startswith(f"def {name}(") or function.startswith(f"async def {name}(")
        comment, signature = comment_and_signature.split("\n", 1)
        assert comment.endswith(f"renamed from {name} to {name}_copy:")
        assert signature.endswith(":") and f"def {name}_copy(" in signature  # no bare line break at the end
        assert function.startswith(signature.replace(f"{name}_copy(", f"{name}("))  # the same signature
        assert len(prompt.text) <= 1200 and function.count("\n") >= len(signature.splitlines()) + 2


def _original_body(prompt) -> tuple[str, ast.FunctionDef]:
    """The stdlib's own body for a held-out prompt's function (the file's text from the prompt's
    end to the function's last line), and the function's syntax tree."""
    module, name = prompt.name.split(":")
    source = (stdlib_path() / module).read_text(encoding="utf-8")
    cut = len(prompt.before + prompt.text)
    assert source[:cut] == prompt.before + prompt.text
    line_ends = list(itertools.accumulate(len(line) for line in source.splitlines(keepends=True)))
    enclosing = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name == name
        and line_ends[node.lineno - 2] < cut < line_ends[node.end_lineno - 1]
    ]
    function = max(enclosing, key=lambda node: node.lineno)  # the innermost
    return source[cut : line_ends[function.end_lineno - 1]], function


def test_the_stdlibs_own_bodies_are_valid_python_after_their_prompts_and_a_bad_line_stops_the_count():
    prompts = held_out_code_prompts(per_module=1, max_chars=800)
    assert len(prompts) >= 8 and sum(bool(prompt.before) for prompt in prompts) >= 4  # files cut to 800 characters
    rng, checked = random.Random(0), 0
    for prompt in prompts:
        body, function = _original_body(prompt)
        num_lines = sum(1 for line in body.splitlines() if line.strip())
        assert prompt.lines_that_parse(body) == (num_lines, num_lines)
        unfinished = body.rstrip("\n")[:-1]  # its last line is left out
        assert prompt.lines_that_parse(unfinished) == (num_lines - 1, num_lines - 1)

        if len(function.body) < 2:
            continue
        statement = rng.choice(function.body[1:])  # a bad line goes just before it
        checked += 1
        lines = body.splitlines(keepends=True)
        first_body_line = (prompt.before + prompt.text).count("\n") + 1  # 1-based: the signature's last line
        at = statement.lineno - first_body_line  # index into lines: the statement's first line
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
        broken = "".join(lines[:at]) + f"{indent}x = = 1\n" + "".join(lines[at:])
        valid_before = sum(1 for line in lines[:at] if line.strip())
        assert prompt.lines_that_parse(broken) == (valid_before, num_lines + 1), prompt.name
    assert checked >= 8


def test_a_body_at_the_wrong_indentation_is_not_valid_python_and_an_open_docstring_is():
    prompt = next(prompt for prompt in held_out_code_prompts(per_module=1) if "    def " in prompt.text[-200:])
    assert prompt.lines_that_parse("\nreturn 1\n") == (0, 1)
    assert prompt.lines_that_parse("\n" + " " * 12 + "'''An open docstring\n" + " " * 12 + "more") == (1, 1)
