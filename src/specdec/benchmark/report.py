"""The benchmark's results on paper: results.json, results.md (Markdown tables), PNG plots,
and docs/benchmarks.md. Everything here reads the JSON-ready results dict of run.py, so a
report can be rebuilt from a saved results.json."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from specdec.metrics import rounds_by_k_text


PLOTS = ("speedup_vs_k.png", "acceptance_by_position.png", "tokens_per_second.png")
ROUND_PARTS = ("draft", "target", "sampling", "bookkeeping")


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """results.json, results.md and the plots under out_dir; returns their paths by name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    paths["markdown"].write_text(markdown(results))
    for name, path in zip(PLOTS, write_plots(results, out_dir)):
        paths[name] = path
    return paths


# In docs/benchmarks.md, what follows this line is written by hand (other models' results) and
# kept when --write-docs rewrites the page above it.
KEPT_MARKER = "<!-- written by hand below: kept by specdec bench --write-docs -->"


def write_docs(results: dict, plots: dict[str, Path], docs_dir: str | Path, command: str) -> Path:
    """docs/benchmarks.md: the latest results with the machine they came from; the plots are
    copied to docs/benchmarks/. A part of the old page from KEPT_MARKER on is kept, at the end."""
    docs_dir = Path(docs_dir)
    image_dir = docs_dir / "benchmarks"
    image_dir.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:
        shutil.copyfile(plots[name], image_dir / name)
    images = "\n".join(f"![{name[:-4].replace('_', ' ')}](benchmarks/{name})" for name in PLOTS)
    page = (f"# Benchmarks\n\nThe latest `specdec bench` results, reproduced with\n\n```\n{command}\n```\n\n"
            f"{markdown(results, title_level=2)}\n## Plots\n\n{images}\n")
    path = docs_dir / "benchmarks.md"
    old = path.read_text() if path.is_file() else ""
    kept = old[old.index(KEPT_MARKER):] if KEPT_MARKER in old else ""
    path.write_text(page + ("\n" + kept if kept else ""))
    return path


# -- Markdown ------------------------------------------------------------------------------

def markdown(results: dict, title_level: int = 1) -> str:
    h = "#" * title_level
    sections = [f"{h} specdec bench\n\n{_machine_line(results)}\n\n{_setup_line(results)}\n",
                f"{h}# Costs and roofline\n\n{costs_table(results)}\n\n{TABLE_LEGEND}\n"]
    for set_name, prompt_set in results["prompt_sets"].items():
        for sampling in results["config"]["samplings"]:
            title = f"{h}# {prompt_set['title']} ({set_name}), {_sampling_words(sampling)}"
            sections.append(f"{title}\n\n{method_table(results, set_name, sampling['name'])}\n")
    if results.get("quantization_quality"):
        sections.append(f"{h}# What quantization costs\n\n{quality_table(results['quantization_quality'])}\n")
    sections += [f"{h}# Greedy exactness\n\n{exactness_text(results['exactness'])}\n",
                 f"{h}# Goals (held-out code prompts)\n\n{goals_table(results['goals'])}\n",
                 f"{h}# Where the time goes\n\n{profile_table(results)}\n"]
    if results["notes"]:
        sections.append(f"{h}# Notes\n\n" + "\n".join(f"- {note}" for note in results["notes"]) + "\n")
    return "\n".join(sections)


TABLE_LEGEND = (
    "Speedup: tokens/s over the target alone's, prefill included; decode speedup: after the prefill, "
    "what the formula predicts. Predicted: (1 − α^(k+1)) / ((1 − α)(k·c + 1)), with c in rounds (the "
    "drafter's time per draft step inside the rounds, catch-up and bookkeeping included, ÷ the target "
    "alone's time per forward in its own decoding) or the isolated c (one draft step ÷ one target step, "
    "each timed alone, back to back). Predicted from τ: the measured tokens per round ÷ (k·c + 1), "
    "isolated c; with verify cost: the verify forward's measured cost v_k in place of the formula's 1.")


def method_table(results: dict, set_name: str, sampling: str) -> str:
    lines = ["| method | tokens/s | speedup | decode speedup | predicted (c in rounds) | predicted (isolated c) "
             "| predicted from τ | predicted with verify cost | α | τ | c in rounds | isolated c "
             "| acceptance by position | of roofline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in _rows(results, set_name, sampling):
        by_position = " ".join(_number(a, 2) for a in r["acceptance_by_position"] or [])
        label = r["label"]
        if r.get("rounds_by_k"):  # goodput: how many rounds took each k
            label += f" (rounds by k: {rounds_by_k_text(r['rounds_by_k'])})"
        lines.append(f"| {label} | {_number(r['tokens_per_s'], 1)} | {_times(r['speedup'])} | "
                     f"{_times(r['decode_speedup'])} | {_times(r.get('predicted_in_rounds'))} | "
                     f"{_times(r['predicted_speedup'])} | "
                     f"{_times(r['predicted_from_tau'])} | {_times(r.get('predicted_with_verify_cost'))} | "
                     f"{_number(r['alpha'], 3)} | {_number(r['tau'], 2)} | "
                     f"{_number(r.get('cost_ratio_in_rounds'), 3)} | "
                     f"{_number(r['cost_ratio'], 3)} | {by_position} | {_number(r['roofline_fraction'], 2)} |")
    return "\n".join(lines)


def costs_table(results: dict) -> str:
    costs, roof = results["costs"], results["roofline"]
    greedy_targets = [r for r in results["rows"] if r["engine"] == "specdec" and r["method"] == "none"
                      and r["sampling"] == "greedy"]
    lines = ["| measure | value |", "|---|---:|",
             f"| target step (1 token after 64) | {_number(costs['target_step_ms'], 3)} ms |",
             f"| draft step (1 token after 64) | {_number(costs['draft_step_ms'], 3)} ms |",
             f"| cost ratio c = draft step ÷ target step | {_number(costs['cost_ratio'], 3)} |",
             "| verify forward of k+1 tokens ÷ target step, v_k | "
             + ", ".join(f"k={k}: {_number(v, 2)}" for k, v in costs.get("verify_cost_ratio", {}).items()) + " |",
             f"| streaming read bandwidth ({roof['buffer_bytes'] / 2**20:.0f} MiB buffer) | "
             f"{roof['read_bandwidth_gb_per_s']:.1f} GB/s |",
             f"| target weight bytes read per decode step | {roof['decode_weight_bytes'] / 1e6:.1f} MB |",
             f"| roofline: step floor / ceiling | {roof['step_floor_ms']:.3f} ms / "
             f"{roof['ceiling_tokens_per_s']:.0f} tokens/s |"]
    for r in greedy_targets:
        lines.append(f"| target alone, {r['prompt_set']} greedy, decode tokens/s (fraction of the ceiling) | "
                     f"{_number(r['decode_tokens_per_s'], 1)} ({_number(r['roofline_fraction'], 2)}) |")
    return "\n".join(lines)


def quality_table(quality: dict) -> str:
    """The quantized target against the unquantized one (benchmark/quality.py)."""
    q = quality["quantization"]
    return "\n".join([
        f"| {q} target against the unquantized one | value |", "|---|---:|",
        f"| greedy outputs identical | {quality['greedy_identical']} of {quality['prompts']} |",
        f"| greedy agreement (tokens before the first difference ÷ output length) | "
        f"{_number(quality['greedy_agreement'], 3)} |",
        f"| perplexity on held-out modules, {q} / unquantized | {_number(quality['perplexity'], 3)} / "
        f"{_number(quality['reference_perplexity'], 3)} ({quality['perplexity_difference']:+.3f}) |",
        f"| target alone, greedy tokens/s, {q} / unquantized | {_number(quality['tokens_per_s'], 1)} / "
        f"{_number(quality['reference_tokens_per_s'], 1)} ({_times(quality['speedup_over_reference'])}) |"])


def exactness_text(exactness: dict) -> str:
    text = (f"Greedy outputs identical in {exactness['identical']} of {exactness['compared']} comparisons "
            "(every specdec method against the specdec target alone; the target alone against "
            "transformers' greedy generate).")
    if exactness["divergences"]:
        text += "\n\n| checked | against | prompt | first different token | tokens there |\n|---|---|---|---:|---|"
        for d in exactness["divergences"]:
            text += (f"\n| {d['checked']} | {d['reference']} | {d['prompt']} | {d['position']} | "
                     f"{list(d['checked_tokens'])} vs {list(d['reference_tokens'])} |")
    return text


def goals_table(goals: list[dict]) -> str:
    lines = ["| goal | measured | met | detail |", "|---|---:|---|---|"]
    for g in goals:
        met = {True: "yes", False: "**no**", None: "–"}[g["met"]]
        lines.append(f"| {g['goal']} | {_number(g['measured'], 2)} | {met} | {g['detail']} |")
    return "\n".join(lines)


def profile_table(results: dict) -> str:
    """Per round (ms): draft, target forward, sampling/verification, bookkeeping; and the share
    of the wall time in prefill and outside the engine; for the target alone and the rows at
    transformers_k."""
    k = results["config"]["transformers_k"]
    lines = ["| prompts, sampling | method | rounds | ms/round | draft | target | sampling | bookkeeping | "
             "prefill | other |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        if r["profile"] is None or r["k"] not in (0, k):
            continue
        rounds, seconds = r["profile"]["rounds"], r["profile"]["seconds"]
        per_round = {part: seconds[part] / rounds * 1e3 if rounds else float("nan") for part in ROUND_PARTS}
        total = sum(seconds.values())
        lines.append(f"| {r['prompt_set']}, {r['sampling']} | {r['label']} | {rounds} | "
                     f"{_number(sum(per_round.values()), 2)} | "
                     + " | ".join(_number(per_round[part], 2) for part in ROUND_PARTS)
                     + f" | {seconds['prefill'] / total:.0%} | {seconds['other'] / total:.0%} |")
    return ("Milliseconds per round (one propose → verify → accept step) in each part; prefill and other "
            "(outside the engine's loop) as shares of the wall time.\n\n" + "\n".join(lines))


def _machine_line(results: dict) -> str:
    m = results["machine"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads)"
    return f"Machine: {where}; torch {m['torch']}, Python {m['python']}; {m['date']}."


def _setup_line(results: dict) -> str:
    models, config = results["models"], results["config"]
    pair = f"target {_model_words(models['target'])}"
    if models["draft"]:
        pair += f", draft {_model_words(models['draft'])}"
    sets = ", ".join(f"{len(s['prompts'])} {name}" for name, s in results["prompt_sets"].items())
    return (f"Models: {pair}. Prompts: {sets}; {config['max_tokens']} new tokens each; k in "
            f"{{{', '.join(map(str, config['ks']))}}}; transformers at k={config['transformers_k']}; "
            f"device {config['device']}; every method interleaved prompt by prompt in one run.")


def _model_words(model: dict) -> str:
    dtype = model["dtype"].replace("torch.", "")
    if model.get("quantization"):
        dtype += f", {model['quantization']} weights"
    return f"{Path(model['path']).name} ({model['parameters'] / 1e6:.1f}M parameters, {dtype})"


def _sampling_words(sampling: dict) -> str:
    if sampling["temperature"] == 0:
        return "greedy"
    return f"sampled (temperature {sampling['temperature']}, top_p {sampling['top_p']})"


def _rows(results: dict, set_name: str, sampling: str) -> list[dict]:
    return [r for r in results["rows"] if r["prompt_set"] == set_name and r["sampling"] == sampling]


def _number(x, digits: int) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _times(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _json_safe(value):
    """NaN and infinity become null (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# -- plots ---------------------------------------------------------------------------------

def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """The three PNGs of PLOTS, one panel per (prompt set, sampling) in each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_per_panel = len(_rows(results, *next(iter(_panel_keys(results)))))
    heights = (4, 4, max(4, 0.3 * rows_per_panel))  # the bar chart grows with its rows
    paths = []
    for name, draw, height in zip(PLOTS, (_plot_speedup_vs_k, _plot_acceptance, _plot_tokens_per_second), heights):
        figure, panels = _panels(plt, results, height)
        for (set_name, sampling), axes in panels:
            draw(axes, _rows(results, set_name, sampling))
            axes.set_title(f"{results['prompt_sets'][set_name]['title']}, {sampling}", fontsize=10)
            if axes.get_legend_handles_labels()[0]:
                axes.legend(fontsize=7)
        figure.tight_layout()
        path = out_dir / name
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def _panel_keys(results: dict) -> list[tuple[str, str]]:
    return [(s, m["name"]) for s in results["prompt_sets"] for m in results["config"]["samplings"]]


def _panels(plt, results: dict, height: float):
    num_sets, num_samplings = len(results["prompt_sets"]), len(results["config"]["samplings"])
    figure, grid = plt.subplots(num_sets, num_samplings, figsize=(6.5 * num_samplings, height * num_sets),
                                squeeze=False)
    return figure, [(key, grid[i // num_samplings][i % num_samplings]) for i, key in enumerate(_panel_keys(results))]


def _plot_speedup_vs_k(axes, rows: list[dict]) -> None:
    lines = (("specdec", "draft_model", "o-", "C0"), ("specdec", "ngram", "s-", "C1"),
             ("specdec", "lookup_then_draft", "v-", "C4"),
             ("transformers", "draft_model", "D", "C2"), ("transformers", "ngram", "^", "C3"))
    for engine, method, style, color in lines:
        chosen = [r for r in rows if r["engine"] == engine and r["method"] == method]
        if chosen:
            axes.plot([r["k"] for r in chosen], [r["speedup"] for r in chosen], style, color=color,
                      label=chosen[0]["label"].rsplit(" k=", 1)[0])
    drafted = [r for r in rows if r["engine"] == "specdec" and r["method"] == "draft_model"
               and r.get("predicted_in_rounds") and r["decode_speedup"]]
    if drafted:
        ks = [r["k"] for r in drafted]
        axes.plot(ks, [r["decode_speedup"] for r in drafted], "o-.", color="C0", alpha=0.6,
                  label="specdec draft model, after the prefill")
        axes.plot(ks, [r["predicted_in_rounds"] for r in drafted], "o--", color="C0", alpha=0.3,
                  label="specdec draft model, predicted (c in rounds)")
    single_k = (("eagle", "*", "C5"), ("eagle_tree", "P", "C6"), ("draft_model_tree", "X", "C7"),
                ("early_exit", "h", "C8"))  # rows at the comparison k only, each its own point
    for method, style, color in single_k:
        for shade, r in enumerate(r for r in rows if r["method"] == method):
            axes.plot([r["k"]], [r["speedup"]], style, color=color, alpha=1.0 - 0.25 * min(shade, 3),
                      markersize=9, label=r["label"])
    for r in rows:
        if r["method"] == "none":
            axes.axhline(r["speedup"], linestyle=":" if r["engine"] == "transformers" else "-", color="gray",
                         linewidth=1, label=r["label"])
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("k (draft tokens per round)")
    axes.set_ylabel("speedup over the target alone")


def _plot_acceptance(axes, rows: list[dict]) -> None:
    for method, color in (("draft_model", "C0"), ("ngram", "C1"), ("lookup_then_draft", "C4")):
        chosen = [r for r in rows if r["engine"] == "specdec" and r["method"] == method and r["acceptance_by_position"]]
        if chosen:
            r = max(chosen, key=lambda row: row["k"])
            values = [math.nan if a is None else a for a in r["acceptance_by_position"]]
            axes.plot(range(1, len(values) + 1), values, "o-", color=color, label=r["label"])
    for method, style, color in (("eagle", "*-", "C5"), ("eagle_tree", "P--", "C6"), ("draft_model_tree", "X--", "C7"),
                                 ("early_exit", "h-", "C8")):
        for r in rows:
            if r["method"] == method and r["acceptance_by_position"]:
                values = [math.nan if a is None else a for a in r["acceptance_by_position"]]
                axes.plot(range(1, len(values) + 1), values, style, color=color, label=r["label"])
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("draft position (a tree's: depth)")
    axes.set_ylabel("acceptance (accepted ÷ proposed)")


def _plot_tokens_per_second(axes, rows: list[dict]) -> None:
    axes.barh(range(len(rows)), [r["tokens_per_s"] for r in rows],
              color=["C0" if r["engine"] == "specdec" else "C1" for r in rows])
    axes.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("tokens/s (blue: specdec, orange: transformers)")


# -- against llama.cpp (specdec bench --llama-cpp: llama_cpp.py) ----------------------------

LLAMA_CPP_START = "<!-- against llama.cpp: written by specdec bench --llama-cpp --write-docs -->"
LLAMA_CPP_END = "<!-- /against llama.cpp -->"
LLAMA_CPP_DIR = "llama_cpp"  # docs/benchmarks/llama_cpp/<cpu kind>.json: each CPU kind's latest results


def write_llama_cpp_report(results: dict, out_dir: str | Path) -> list[Path]:
    """results.json and results.md of a `specdec bench --llama-cpp` run under out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    (out_dir / "results.md").write_text(llama_cpp_markdown(results))
    return [out_dir / "results.json", out_dir / "results.md"]


def llama_cpp_markdown(results: dict, title_level: int = 1) -> str:
    """The tables of a `specdec bench --llama-cpp` run, every CPU kind it measured."""
    kinds = [{**measured, "config": results["config"], "command": results.get("command")}
             for measured in results["cpu_kinds"]]
    return llama_cpp_section(kinds, title_level)


def llama_cpp_section(kinds: list[dict], title_level: int = 2) -> str:
    h = "#" * title_level
    parts = [f"{h} Against llama.cpp\n\n{LLAMA_CPP_INTRO}\n"]
    for kind in kinds:
        parts.append(llama_cpp_kind_markdown(kind, h + "#"))
    return "\n".join(parts)


LLAMA_CPP_INTRO = (
    "specdec and llama.cpp's own tools (built from the source llama-cpp-python 0.3.36 vendors) on the same GGUF "
    "file, the same prompt text (a chat prompt rendered with the target's chat template by specdec, handed to "
    "llama.cpp as raw text; the prompt token counts both report are checked), the same threads, greedy, up to "
    "the same number of new tokens, both stopping at an end-of-sequence token; every system interleaved prompt "
    "by prompt in one run. Tokens/s: the tokens each generated over its time with the prefill (llama.cpp's own "
    "timing lines: prompt eval + eval, or its speculative tools' encoded + decoded; model loading left out on "
    "both sides). Accepted ÷ drafted: llama.cpp's n_accept ÷ n_drafted, specdec's accepted ÷ proposed draft "
    "tokens, the same measure; τ: tokens per target forward, tokens ÷ (tokens − accepted). specdec runs as "
    "`LLM` does by default: the file's quantized weights, k chosen by goodput up to k; llama.cpp drafts k "
    "tokens every round. Same text: outputs that agree with specdec plain's as far as the shorter goes.")


def llama_cpp_kind_markdown(kind: dict, h: str) -> str:
    """One CPU kind's measurement: a table per prompt set, and what a verify forward costs."""
    parts = [f"{h} {_cpu_kind_title(kind)}\n\n{_llama_cpp_setup(kind)}\n"]
    for set_name, prompt_set in kind["prompt_sets"].items():
        parts.append(f"{h}# {prompt_set['title']} ({set_name})\n\n{llama_cpp_table(kind, set_name)}\n\n"
                     f"{_fastest_line(kind, set_name)}\n")
    parts.append(f"{h}# What a verify forward costs\n\n{verify_cost_table(kind['verify_cost'])}\n")
    if kind["notes"]:
        parts.append("\n".join(f"- {note}" for note in kind["notes"]) + "\n")
    return "\n".join(parts)


def llama_cpp_table(kind: dict, set_name: str) -> str:
    lines = ["| system | tokens/s | ÷ llama.cpp plain | prompt tokens/s | decode tokens/s | accepted ÷ drafted "
             "| τ | tokens | same text as specdec plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in kind["rows"]:
        if r["prompt_set"] == set_name:
            lines.append(f"| {r['label']} | {_number(r['tokens_per_s'], 1)} | {_times(r['ratio_to_llama_cpp_plain'])} "
                         f"| {_number(r['prompt_tokens_per_s'], 1)} | {_number(r['decode_tokens_per_s'], 1)} | "
                         f"{_number(r['acceptance'], 2)} | {_number(r['tau'], 2)} | {r['tokens']} | "
                         f"{r['same_text_as_specdec_plain']} of {r['prompts']} |")
    return "\n".join(lines)


def _fastest_line(kind: dict, set_name: str) -> str:
    """specdec's fastest system against llama.cpp's fastest, on the prompt set."""
    rows = [r for r in kind["rows"] if r["prompt_set"] == set_name]
    fastest = {engine: max((r for r in rows if r["engine"] == engine), key=lambda r: r["tokens_per_s"])
               for engine in ("specdec", "llama.cpp")}
    ours, theirs = fastest["specdec"], fastest["llama.cpp"]
    return (f"Fastest of each: {ours['label']}, {_number(ours['tokens_per_s'], 1)} tokens/s, against "
            f"{theirs['label']}, {_number(theirs['tokens_per_s'], 1)}: "
            f"**{_times(ours['tokens_per_s'] / theirs['tokens_per_s'])}**.")


def verify_cost_table(costs: dict) -> str:
    lines = ["| engine | forward of 7 tokens | 1-token step | verify ÷ step |", "|---|---:|---:|---:|"]
    how = {"llama.cpp": "llama-bench -p 7 -n 32 -d 64: pp7 ÷ tg per token",
           "specdec": "its runner, median of 3 × 20 forwards each"}
    for engine, cost in costs.items():
        lines.append(f"| {engine} ({how.get(engine, '')}; after {cost['depth']} tokens) | "
                     f"{_number(cost['verify_ms'], 2)} ms | {_number(cost['step_ms'], 2)} ms | "
                     f"{_number(cost['verify_cost'], 2)} |")
    return "\n".join(lines)


def _cpu_kind_title(kind: dict) -> str:
    held = "held to AVX2" if kind["cpu_kind"] == "avx2" else "as it is"
    return f"{kind['machine']['cpu']}, {kind['cpu_capability']} ({held})"


def _llama_cpp_setup(kind: dict) -> str:
    config, m = kind["config"], kind["machine"]
    model = Path(config["model"]).name + (f", draft {Path(config['draft']).name}" if config["draft"] else "")
    sets = ", ".join(f"{len(s['prompts'])} {name}" for name, s in kind["prompt_sets"].items())
    text = (f"{m['date']}; {m['cores']} cores, {kind['threads']} threads each; torch {m['torch']} (instruction set "
            f"{kind['cpu_capability']}); llama.cpp {kind['llama_cpp'].get('commit') or ''} built with "
            f"`{' '.join(kind['llama_cpp']['flags'])}`, which reports "
            f"`{kind['llama_cpp']['system_info']}`. Target {model}; prompts: {sets}; at most {config['max_tokens']} "
            f"new tokens; k = {config['k']}.")
    load = kind.get("load_average")
    if load:
        text += (f" The machine's 1-minute load average was {load['before']:.1f} before the timed runs and "
                 f"{load['after']:.1f} after them, on {m['cores']} cores.")
    return text + (f" Command: `{kind['command']}`." if kind.get("command") else "")


def write_llama_cpp_docs(results: dict, docs_dir: str | Path) -> Path:
    """docs/benchmarks/llama_cpp/<cpu kind>.json for each CPU kind measured, then the section of
    docs/benchmarks.md between LLAMA_CPP_START and LLAMA_CPP_END from every kind's latest file
    (placed after KEPT_MARKER the first time, so the main bench's --write-docs keeps it)."""
    docs_dir = Path(docs_dir)
    data_dir = docs_dir / "benchmarks" / LLAMA_CPP_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    for measured in results["cpu_kinds"]:
        kind = {**measured, "config": results["config"], "command": results.get("command")}
        (data_dir / f"{measured['cpu_kind']}.json").write_text(json.dumps(_json_safe(kind), indent=2) + "\n")
    kinds = [json.loads((data_dir / f"{name}.json").read_text()) for name in ("native", "avx2")
             if (data_dir / f"{name}.json").is_file()]
    section = f"{LLAMA_CPP_START}\n{llama_cpp_section(kinds)}\n{LLAMA_CPP_END}"
    path = docs_dir / "benchmarks.md"
    path.write_text(_with_section(path.read_text() if path.is_file() else "", section))
    return path


def _with_section(page: str, section: str) -> str:
    """page with its llama.cpp section replaced, or placed just after KEPT_MARKER (at the end
    when there is none)."""
    if LLAMA_CPP_START in page and LLAMA_CPP_END in page:
        before, rest = page.split(LLAMA_CPP_START, 1)
        return before + section + rest.split(LLAMA_CPP_END, 1)[1]
    if KEPT_MARKER in page:
        before, after = page.split(KEPT_MARKER, 1)
        return before + KEPT_MARKER + "\n\n" + section + "\n" + after
    return page.rstrip("\n") + ("\n\n" if page else "") + section + "\n"


def is_bench_output(path: Path) -> bool:
    """Whether path holds an earlier `specdec bench`'s results."""
    try:
        return "prompt_sets" in json.loads((path / "results.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
