"""The benchmark's results on paper: results.json, results.md (Markdown tables), PNG plots,
and docs/benchmarks.md. Everything here reads the JSON-ready results dict of run.py, so a
report can be rebuilt from a saved results.json."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from pathlib import Path

from specdec.metrics import rounds_by_k_text

PLOTS: tuple[str, ...] = ("speedup_vs_k.png", "acceptance_by_position.png", "tokens_per_second.png")
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
    page = (
        f"# Benchmarks\n\nThe latest `specdec bench` results, reproduced with\n\n```\n{command}\n```\n\n"
        f"{markdown(results, title_level=2)}\n## Plots\n\n{images}\n"
    )
    path = docs_dir / "benchmarks.md"
    old = path.read_text() if path.is_file() else ""
    kept = old[old.index(KEPT_MARKER) :] if KEPT_MARKER in old else ""
    path.write_text(page + ("\n" + kept if kept else ""))
    return path


# -- Markdown ------------------------------------------------------------------------------
#
# The report is Markdown that reads as plain text too (specdec bench prints it): every line fits
# WIDTH columns, tables are padded into columns with their units in the headers, and the verdict
# (the goals met or missed) comes before the tables it rests on.

WIDTH = 100  # the columns of the terminal the printed report fits


def markdown(results: dict, title_level: int = 1) -> str:
    h = "#" * title_level
    sections = [
        f"{h} specdec bench\n",
        f"{h}# Verdict: the goals, on held-out code prompts\n\n{verdict(results)}\n",
        f"{_wrap(_machine_line(results))}\n\n{_wrap(_setup_line(results))}\n",
        f"{h}# Costs and roofline\n\n{costs_table(results)}\n\n{_wrap(TABLE_LEGEND)}\n",
    ]
    for set_name, prompt_set in results["prompt_sets"].items():
        for sampling in results["config"]["samplings"]:
            title = f"{h}# {prompt_set['title']} ({set_name}), {_sampling_words(sampling)}"
            sections.append(f"{title}\n\n{method_tables(results, set_name, sampling['name'])}\n")
    if results.get("quantization_quality"):
        sections.append(f"{h}# What quantization costs\n\n{quality_table(results['quantization_quality'])}\n")
    sections += [
        f"{h}# Greedy exactness\n\n{exactness_text(results['exactness'])}\n",
        f"{h}# Where the time goes\n\n{profile_tables(results)}\n",
    ]
    if results["notes"]:
        sections.append(f"{h}# Notes\n\n" + "\n".join(_bullet(note) for note in results["notes"]) + "\n")
    return "\n".join(sections)


TABLE_LEGEND = (
    "x plain: times the tokens/s of the specdec target alone (plain decoding) on the same prompts and "
    "sampling, prefill included; decode x plain: the same after the prefill, what the formula predicts. "
    "Predicted: (1 − α^(k+1)) / ((1 − α)(k·c + 1)), with c in rounds (the drafter's time per draft step "
    "inside the rounds, catch-up and bookkeeping included, ÷ the target alone's time per forward in its own "
    "decoding) or the isolated c (one draft step ÷ one target step, each timed alone, back to back). "
    "Predicted from τ: the measured tokens per round ÷ (k·c + 1), isolated c; with v_k: the verify "
    "forward's measured cost v_k in place of the formula's 1. α: accepted ÷ judged draft tokens; τ: tokens "
    "per target forward."
)


def verdict(results: dict) -> str:
    """How many goals were met, missed or not measured, and the greedy exactness, in a sentence;
    the goals' table; what each goal is and how it was judged."""
    goals, exactness = results["goals"], results["exactness"]
    counts = [sum(g["met"] is value for g in goals) for value in (True, False, None)]
    words = [f"**{counts[0]} of {len(goals)} goals met**", f"{counts[1]} missed"]
    if counts[2]:
        words.append(f"{counts[2]} not measured")
    line = (
        ", ".join(words) + f"; greedy outputs identical in {exactness['identical']} of "
        f"{exactness['compared']} comparisons."
    )
    details = "\n".join(_bullet(f"{_goal_name(g)}: {g['goal']}. {g['detail']}.") for g in goals)
    return f"{_wrap(line)}\n\n{goals_table(goals)}\n\n{details}"


def goals_table(goals: list[dict]) -> str:
    rows = [
        [
            _goal_name(g),
            _goal_value(g, g["bar"], bar=True),
            _goal_value(g, g["measured"]),
            {True: "met", False: "**missed**", None: "not measured"}[g["met"]],
        ]
        for g in goals
    ]
    return table(["goal", "bar", "measured", "verdict"], rows, left=(0, 3))


def _goal_name(goal: dict) -> str:
    return goal.get("name") or goal["goal"]  # results.json written before goals had names


def _goal_value(goal: dict, value, bar: bool = False) -> str:
    if value is None:
        return "–"
    unit = goal.get("unit") or ("% off" if "prediction" in goal["goal"] else None)  # results.json before units
    if unit == "% off":
        return f"{'≤ ' if bar else ''}{value:.0%} off"
    return f"{'≥ ' if bar else ''}{value:.2f}{unit or 'x'}"  # unit: "x plain", "x transformers"


def method_tables(results: dict, set_name: str, sampling: str) -> str:
    """A prompt set's tables at one sampling setting: every method's speed; the draft model's and
    prompt lookup's decode speedup at each k against the formula; acceptance by position."""
    rows = _rows(results, set_name, sampling)
    parts = [speed_table(rows)]
    goodput = [r for r in rows if r.get("rounds_by_k")]
    if goodput:
        parts.append(
            "\n".join(_bullet(f"Rounds by k, {r['label']}: {rounds_by_k_text(r['rounds_by_k'])}.") for r in goodput)
        )
    for method, name in (("draft_model", "draft model"), ("ngram", "prompt lookup")):
        swept = [r for r in rows if r["engine"] == "specdec" and r["method"] == method and r["cost_ratio"] is not None]
        if swept:
            parts.append(f"specdec {name} at each k, against the formula:\n\n{formula_table(swept)}")
    speculative = [r for r in rows if r["engine"] == "specdec"]
    parts.append(acceptance_table(speculative))
    return "\n\n".join(parts)


def speed_table(rows: list[dict]) -> str:
    """Every method: tokens/s, speedups over the target alone, α and τ."""
    return table(
        ["method", "tok/s", "x plain", "decode x plain", "α", "τ"],
        [
            [
                r["label"],
                _number(r["tokens_per_s"], 1),
                _times(r["speedup"]),
                _times(r["decode_speedup"]),
                _number(r["alpha"], 3),
                _number(r["tau"], 2),
            ]
            for r in rows
        ],
    )


FORMULA_ROWS = (  # the formula table's rows: (name, key in a results row, digits; None: a speedup)
    ("decode x plain, measured", "decode_speedup", None),
    ("predicted x plain, c in rounds", "predicted_in_rounds", None),
    ("predicted x plain, isolated c", "predicted_speedup", None),
    ("predicted x plain, from τ", "predicted_from_tau", None),
    ("predicted x plain, with v_k", "predicted_with_verify_cost", None),
    ("c in rounds", "cost_ratio_in_rounds", 3),
    ("isolated c", "cost_ratio", 3),
)


def formula_table(rows: list[dict]) -> str:
    """One drafter at each k (a column each): the decode speedup measured and as the formula
    predicts it, and the cost ratios c it was predicted with."""
    body = [
        [name] + [_times(r.get(key)) if digits is None else _number(r.get(key), digits) for r in rows]
        for name, key, digits in FORMULA_ROWS
    ]
    return table(["k (draft tokens per round)"] + [str(r["k"]) for r in rows], body)


def acceptance_table(rows: list[dict]) -> str:
    """specdec's methods: decode tokens/s as a share of the roofline's ceiling, and acceptance
    (accepted ÷ proposed) at each draft position."""
    body = [
        [
            r["label"].removeprefix("specdec "),
            _percent(r["roofline_fraction"]),
            " ".join(_number(a, 2) for a in r["acceptance_by_position"] or []) or "–",
        ]
        for r in rows
    ]
    return table(["specdec method", "roofline %", "acceptance by draft position 1, 2, …"], body, left=(0, 2))


def costs_table(results: dict) -> str:
    costs, roof = results["costs"], results["roofline"]
    greedy_targets = [
        r for r in results["rows"] if r["engine"] == "specdec" and r["method"] == "none" and r["sampling"] == "greedy"
    ]
    rows = [
        ["target step (1 token after 64)", _number(costs["target_step_ms"], 3), "ms"],
        ["draft step (1 token after 64)", _number(costs["draft_step_ms"], 3), "ms"],
        ["cost ratio c = draft step ÷ target step", _number(costs["cost_ratio"], 3), "ratio"],
        [
            f"streaming read bandwidth ({roof['buffer_bytes'] / 2**20:.0f} MiB buffer)",
            f"{roof['read_bandwidth_gb_per_s']:.1f}",
            "GB/s",
        ],
        ["target weight bytes read per decode step", f"{roof['decode_weight_bytes'] / 1e6:.1f}", "MB"],
        ["roofline: step floor", f"{roof['step_floor_ms']:.3f}", "ms"],
        ["roofline: ceiling", f"{roof['ceiling_tokens_per_s']:.0f}", "tok/s"],
    ]
    for r in greedy_targets:
        rows += [
            [
                f"target alone, {r['prompt_set']} greedy, after the prefill",
                _number(r["decode_tokens_per_s"], 1),
                "tok/s",
            ],
            [f"target alone, {r['prompt_set']} greedy, of the ceiling", _percent(r["roofline_fraction"]), "%"],
        ]
    parts = [table(["measure", "value", "unit"], rows, left=(0, 2))]
    verify = costs.get("verify_cost_ratio", {})
    if verify:
        parts.append(
            table(
                ["k"] + list(verify),
                [["v_k: verify of k+1 tokens ÷ target step"] + [_number(v, 2) for v in verify.values()]],
            )
        )
    return "\n\n".join(parts)


def quality_table(quality: dict) -> str:
    """The quantized target against the unquantized one (benchmark/quality.py)."""
    q = quality["quantization"]
    rows = [
        [
            "greedy outputs identical to the unquantized's",
            f"{quality['greedy_identical']} of {quality['prompts']}",
            "",
            "",
        ],
        ["greedy agreement (tokens to the first difference ÷ length)", _number(quality["greedy_agreement"], 3), "", ""],
        [
            "perplexity on held-out modules",
            _number(quality["perplexity"], 3),
            _number(quality["reference_perplexity"], 3),
            f"{quality['perplexity_difference']:+.3f}",
        ],
        [
            "target alone, greedy tok/s",
            _number(quality["tokens_per_s"], 1),
            _number(quality["reference_tokens_per_s"], 1),
            _times(quality["speedup_over_reference"]),
        ],
    ]
    return table(["measure", q, "unquantized", "change"], rows)


def exactness_text(exactness: dict) -> str:
    text = _wrap(
        f"Greedy outputs identical in {exactness['identical']} of {exactness['compared']} comparisons "
        "(every specdec method against the specdec target alone; the target alone against "
        "transformers' greedy generate)."
    )
    if exactness["divergences"]:
        text += "\n\nWhere outputs part (the first different token, and the tokens from there):\n\n" + "\n".join(
            _bullet(
                f"{d['checked']} against {d['reference']}, {d['prompt']}: token {d['position']}, "
                f"{list(d['checked_tokens'])} vs {list(d['reference_tokens'])}."
            )
            for d in exactness["divergences"]
        )
    return text


def profile_tables(results: dict) -> str:
    """Per round (ms): draft, target forward, sampling/verification, bookkeeping; and the share
    of the wall time in prefill and outside the engine; for the target alone and the rows at
    transformers_k, a table per prompt set and sampling."""
    k = results["config"]["transformers_k"]
    parts = [
        _wrap(
            "Milliseconds per round (one propose → verify → accept step) in each part; prefill and other "
            "(outside the engine's loop) as shares of the wall time."
        )
    ]
    for set_name, sampling in _panel_keys(results):
        rows = []
        for r in _rows(results, set_name, sampling):
            if r["profile"] is None or r["k"] not in (0, k):
                continue
            rounds, seconds = r["profile"]["rounds"], r["profile"]["seconds"]
            per_round = {part: seconds[part] / rounds * 1e3 if rounds else float("nan") for part in ROUND_PARTS}
            total = sum(seconds.values())
            rows.append(
                [r["label"].removeprefix("specdec "), str(rounds), _number(sum(per_round.values()), 2)]
                + [_number(per_round[part], 2) for part in ROUND_PARTS]
                + [f"{seconds['prefill'] / total * 100:.0f}", f"{seconds['other'] / total * 100:.0f}"]
            )
        if rows:
            parts.append(
                f"{set_name}, {sampling}:\n\n"
                + table(
                    ["specdec method", "rounds", "ms/round"]
                    + [f"{part} ms" for part in ROUND_PARTS]
                    + ["prefill %", "other %"],
                    rows,
                )
            )
    return "\n\n".join(parts)


# -- plain-text tables that are Markdown ---------------------------------------------------

KEY_FLOOR = 16  # a wrapped first column keeps at least this many characters (or its header's)
TEXT_FLOOR = 10  # and another column of text this many


def table(
    headers: list[str], rows: list[list[str]], left=(0,), width: int = WIDTH, key_width: int | None = None
) -> str:
    """A Markdown table padded into columns, no line wider than width: the columns of text (the
    first, and those in left) wrap onto continuation rows where the table is too wide, and where
    wrapping is not enough the other columns are spread over several tables, each beginning with
    the first column (as wide in each). key_width: the most the first column takes."""
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(headers[i])] + [len(row[i]) for row in rows]) for i in range(len(headers))]
    floors = [_floor(headers, rows, i, left) for i in range(len(headers))]
    if key_width is not None:
        widths[0], floors[0] = min(widths[0], key_width), min(floors[0], key_width)
    shrunk = _shrink(widths, floors, left, width)
    groups = _column_groups(widths, floors, left, width) if shrunk is None and len(headers) > 2 else []
    if len(groups) <= 1:  # it fits (wrapped), or splitting cannot make it fit: as narrow as it goes
        return _render(
            headers, rows, shrunk or [floors[i] if i in left else widths[i] for i in range(len(widths))], left
        )
    room = min(width - _line_width([0] + [widths[i] for i in group]) for group in groups)
    key_width = max(floors[0], min(widths[0], room))
    return "\n\n".join(
        table(
            [headers[0]] + [headers[i] for i in group],
            [[row[0]] + [row[i] for i in group] for row in rows],
            left=[0] + [n + 1 for n, i in enumerate(group) if i in left],
            width=width,
            key_width=key_width,
        )
        for group in groups
    )


def _line_width(widths: list[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1


def _floor(headers: list[str], rows: list[list[str]], i: int, left) -> int:
    """The narrowest a column wraps to: its header, and no narrower than its floor (nor than its
    widest word, up to the floor)."""
    natural = max([len(headers[i])] + [len(row[i]) for row in rows])
    if i not in left:
        return natural
    return min(natural, max(len(headers[i]), KEY_FLOOR if i == 0 else TEXT_FLOOR))


def _shrink(widths: list[int], floors: list[int], left, width: int) -> list[int] | None:
    """widths with the text columns narrowed, the widest first, until the table fits; None if
    it does not fit even with them at their floors."""
    widths = list(widths)
    while _line_width(widths) > width:
        wide = [i for i in left if widths[i] > floors[i]]
        if not wide:
            return None
        widths[max(wide, key=lambda i: widths[i])] -= 1
    return widths


def _column_groups(widths: list[int], floors: list[int], left, width: int) -> list[list[int]]:
    """The columns after the first in as few consecutive groups as fit beside the first column
    (at its floor), spread as evenly as that many groups allow."""
    need = [(floors[i] if i in left else widths[i]) + 3 for i in range(len(widths))]

    def pack(room: int) -> list[list[int]]:
        groups, used = [[]], 0
        for i in range(1, len(widths)):
            if groups[-1] and used + need[i] > room:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += need[i]
        return groups

    most = width - _line_width([floors[0]])
    fewest = len(pack(most))
    room = next(room for room in range(min(max(need[1:]), most), most + 1) if len(pack(room)) <= fewest)
    return pack(room)


def _render(headers: list[str], rows: list[list[str]], widths: list[int], left) -> str:
    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
            )
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) if i in left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    lines = [line(headers), rule]
    for row in rows:
        wrapped = [
            textwrap.wrap(cell, w, subsequent_indent="  ", break_on_hyphens=False) or [""] if len(cell) > w else [cell]
            for cell, w in zip(row, widths)
        ]
        for n in range(max(map(len, wrapped))):
            lines.append(line([cell[n] if n < len(cell) else "" for cell in wrapped]))
    return "\n".join(lines)


def _wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_on_hyphens=False)


def _bullet(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)


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
    return (
        f"Models: {pair}. Prompts: {sets}; {config['max_tokens']} new tokens each; k in "
        f"{{{', '.join(map(str, config['ks']))}}}; transformers at k={config['transformers_k']}; "
        f"device {config['device']}; every method interleaved prompt by prompt in one run."
    )


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


def _percent(x) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x * 100:.0f}"


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
    """The three PNGs of PLOTS, one panel per (prompt set, sampling) in each; the panels share one
    legend, below them, outside the axes (a legend inside would cover the data)."""
    import matplotlib.pyplot as plt

    paths = []
    for name in PLOTS:
        figure = plot_figure(results, name)
        path = out_dir / name
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def plot_figure(results: dict, name: str):
    """The matplotlib figure of the plot PLOTS names (closed by the caller)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw = dict(zip(PLOTS, (_plot_speedup_vs_k, _plot_acceptance, _plot_tokens_per_second)))[name]
    rows_per_panel = len(_rows(results, *next(iter(_panel_keys(results)))))
    height = max(4, 0.3 * rows_per_panel) if name == "tokens_per_second.png" else 4  # the bars grow with the rows
    figure, panels = _panels(plt, results, height)
    for (set_name, sampling), axes in panels:
        draw(axes, _rows(results, set_name, sampling))
        axes.set_title(f"{results['prompt_sets'][set_name]['title']}, {sampling}", fontsize=10)
    _shared_legend(figure, [axes for _, axes in panels])
    return figure


def _shared_legend(figure, panels: list) -> None:
    """One legend for every panel's lines (each label once, as the first panel drew it), below
    the panels: constrained layout makes room for it."""
    entries = {}
    for axes in panels:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(
            list(entries.values()),
            list(entries),
            loc="outside lower center",
            fontsize=8,
            ncol=min(3, len(entries)),
            frameon=False,
        )


def _panel_keys(results: dict) -> list[tuple[str, str]]:
    return [(s, m["name"]) for s in results["prompt_sets"] for m in results["config"]["samplings"]]


def _panels(plt, results: dict, height: float):
    num_sets, num_samplings = len(results["prompt_sets"]), len(results["config"]["samplings"])
    figure, grid = plt.subplots(
        num_sets, num_samplings, figsize=(6.5 * num_samplings, height * num_sets), squeeze=False, layout="constrained"
    )
    return figure, [(key, grid[i // num_samplings][i % num_samplings]) for i, key in enumerate(_panel_keys(results))]


def _plot_speedup_vs_k(axes, rows: list[dict]) -> None:
    lines = (
        ("specdec", "draft_model", "o-", "C0"),
        ("specdec", "ngram", "s-", "C1"),
        ("specdec", "lookup_then_draft", "v-", "C4"),
        ("transformers", "draft_model", "D", "C2"),
        ("transformers", "ngram", "^", "C3"),
    )
    for engine, method, style, color in lines:
        chosen = [r for r in rows if r["engine"] == engine and r["method"] == method]
        if chosen:
            axes.plot(
                [r["k"] for r in chosen],
                [r["speedup"] for r in chosen],
                style,
                color=color,
                label=chosen[0]["label"].rsplit(" k=", 1)[0],
            )
    drafted = [
        r
        for r in rows
        if r["engine"] == "specdec"
        and r["method"] == "draft_model"
        and r.get("predicted_in_rounds")
        and r["decode_speedup"]
    ]
    if drafted:
        ks = [r["k"] for r in drafted]
        axes.plot(
            ks,
            [r["decode_speedup"] for r in drafted],
            "o-.",
            color="C0",
            alpha=0.6,
            label="specdec draft model, after the prefill",
        )
        axes.plot(
            ks,
            [r["predicted_in_rounds"] for r in drafted],
            "o--",
            color="C0",
            alpha=0.3,
            label="specdec draft model, predicted (c in rounds)",
        )
    single_k = (
        ("eagle", "*", "C5"),
        ("eagle_tree", "P", "C6"),
        ("draft_model_tree", "X", "C7"),
        ("early_exit", "h", "C8"),
    )  # rows at the comparison k only, each its own point
    for method, style, color in single_k:
        for shade, r in enumerate(r for r in rows if r["method"] == method):
            axes.plot(
                [r["k"]],
                [r["speedup"]],
                style,
                color=color,
                alpha=1.0 - 0.25 * min(shade, 3),
                markersize=9,
                label=r["label"],
            )
    for r in rows:
        if r["method"] == "none":
            axes.axhline(
                r["speedup"],
                linestyle=":" if r["engine"] == "transformers" else "-",
                color="gray",
                linewidth=1,
                label=r["label"],
            )
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("k (draft tokens per round)")
    axes.set_ylabel("speedup, x plain (÷ the target alone's tok/s)")


def _plot_acceptance(axes, rows: list[dict]) -> None:
    for method, color in (("draft_model", "C0"), ("ngram", "C1"), ("lookup_then_draft", "C4")):
        chosen = [r for r in rows if r["engine"] == "specdec" and r["method"] == method and r["acceptance_by_position"]]
        if chosen:
            r = max(chosen, key=lambda row: row["k"])
            values = [math.nan if a is None else a for a in r["acceptance_by_position"]]
            axes.plot(range(1, len(values) + 1), values, "o-", color=color, label=r["label"])
    for method, style, color in (
        ("eagle", "*-", "C5"),
        ("eagle_tree", "P--", "C6"),
        ("draft_model_tree", "X--", "C7"),
        ("early_exit", "h-", "C8"),
    ):
        for r in rows:
            if r["method"] == method and r["acceptance_by_position"]:
                values = [math.nan if a is None else a for a in r["acceptance_by_position"]]
                axes.plot(range(1, len(values) + 1), values, style, color=color, label=r["label"])
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("draft position (a tree's: depth)")
    axes.set_ylabel("acceptance (accepted ÷ proposed)")


def _plot_tokens_per_second(axes, rows: list[dict]) -> None:
    axes.barh(
        range(len(rows)),
        [r["tokens_per_s"] for r in rows],
        color=["C0" if r["engine"] == "specdec" else "C1" for r in rows],
    )
    axes.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("tok/s (blue: specdec, orange: transformers)")


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
    kinds = [
        {**measured, "config": results["config"], "command": results.get("command")}
        for measured in results["cpu_kinds"]
    ]
    return llama_cpp_section(kinds, title_level)


def llama_cpp_section(kinds: list[dict], title_level: int = 2) -> str:
    """The verdict (each CPU kind's and prompt set's fastest of each engine) first, then what was
    compared, then each kind's tables."""
    h = "#" * title_level
    parts = [
        f"{h} Against llama.cpp\n",
        f"{h}# Verdict: the fastest of each, and the goals\n\n{llama_cpp_verdict(kinds)}\n",
        *(f"{llama_cpp_goals_text(kind)}\n" for kind in kinds),
        f"{_wrap(LLAMA_CPP_INTRO)}\n",
    ]
    for kind in kinds:
        parts.append(llama_cpp_kind_markdown(kind, h + "#"))
    return "\n".join(parts)


LLAMA_CPP_INTRO = (
    "specdec and llama.cpp's own tools (built from the source llama-cpp-python 0.3.36 vendors) on the same GGUF "
    "file, the same prompt text (a chat prompt rendered with the target's chat template by specdec, handed to "
    "llama.cpp as raw text; the prompt token counts both report are checked), the same threads, greedy (or, "
    "where the title says so, sampled at the same temperature and top-p, llama.cpp's top-k and min-p off, "
    "prompt i seeded seed + i: llama.cpp's request, and for specdec the stream its unseeded requests share, "
    "so that goodput chooses k), up to "
    "the same number of new tokens, both stopping at an end-of-sequence token; every system interleaved prompt "
    "by prompt in one run. tok/s: the tokens each generated over its time with the prefill (llama.cpp's own "
    "timing lines: prompt eval + eval, or its speculative tools' encoded + decoded; model loading left out on "
    "both sides); x llama.cpp plain: times llama.cpp plain's tok/s. Accepted ÷ drafted: llama.cpp's n_accept "
    "÷ n_drafted, specdec's accepted ÷ proposed draft tokens, the same measure; τ: tokens per target forward, "
    "tokens ÷ (tokens − accepted). specdec runs as `LLM` does by default: the file's quantized weights, k "
    "chosen by goodput up to k; llama.cpp drafts k tokens every round. Same text: greedy outputs that agree "
    "with specdec plain's as far as the shorter goes, of the prompts. specdec's drafters: α is accepted ÷ judged "
    "(the draft tokens the verifier reached), acceptance by position accepted ÷ proposed at each draft "
    "position, c in rounds the drafter's seconds per draft token asked for (the k of every round summed) ÷ "
    "specdec plain's seconds per target forward; staged drafts are prompt lookup drafting for the draft "
    'model (`speculative_model=["[ngram]", DRAFT]`), sharing its weights, the other-tokenizer draft drafts '
    "through text."
)


def llama_cpp_verdict(kinds: list[dict]) -> str:
    """A line per CPU kind and prompt set: specdec's fastest system against llama.cpp's."""
    return "\n".join(
        _bullet(f"{_cpu_kind_title(kind)}, {set_name} prompts: {_fastest_line(kind, set_name)}")
        for kind in kinds
        for set_name in kind["prompt_sets"]
    )


def llama_cpp_goals_text(kind: dict) -> str:
    """Issue 29's goals on one CPU kind (goals.py), and issue 50's where their rows ran, judged
    from its rows: a count, the table, what each goal is and how it was judged."""
    from specdec.tools.benchmark.goals import evaluate_llama_cpp_goals

    goals = evaluate_llama_cpp_goals(kind["rows"], _sampling_name(kind))
    counts = [sum(g["met"] is value for g in goals) for value in (True, False, None)]
    words = [f"**{counts[0]} of {len(goals)} met**", f"{counts[1]} missed"]
    if counts[2]:
        words.append(f"{counts[2]} not measured")
    line = f"The goals (issue 29's, and issue 50's where measured), {_cpu_kind_title(kind)}: {', '.join(words)}."
    details = "\n".join(_bullet(f"{_goal_name(g)}: {g['goal']}. {g['detail']}.") for g in goals)
    return f"{_wrap(line)}\n\n{goals_table(goals)}\n\n{details}"


def llama_cpp_kind_markdown(kind: dict, h: str) -> str:
    """One CPU kind's measurement: tables per prompt set, and what a verify forward costs."""
    parts = [f"{h} {_cpu_kind_title(kind)}\n\n{_wrap(_llama_cpp_setup(kind))}\n"]
    for set_name, prompt_set in kind["prompt_sets"].items():
        parts.append(f"{h}# {prompt_set['title']} ({set_name})\n\n{llama_cpp_table(kind, set_name)}\n")
        drafting = llama_cpp_drafting_text(kind, set_name)
        if drafting:
            parts.append(f"{drafting}\n")
    if kind.get("adaptation"):
        parts.append(f"{h}# Adapting the head to the job\n\n{_wrap(adaptation_text(kind))}\n")
    parts.append(f"{h}# What a verify forward costs\n\n{verify_cost_table(kind['verify_cost'])}\n")
    if kind["notes"]:
        parts.append("\n".join(_bullet(note) for note in kind["notes"]) + "\n")
    return "\n".join(parts)


def llama_cpp_table(kind: dict, set_name: str) -> str:
    rows = [
        [
            r["label"],
            _number(r["tokens_per_s"], 1),
            _times(r["ratio_to_llama_cpp_plain"]),
            _times(r.get("ratio_to_specdec_plain")),
            _number(r["prompt_tokens_per_s"], 1),
            _number(r["decode_tokens_per_s"], 1),
            _number(r["acceptance"], 2),
            _number(r["tau"], 2),
            str(r["tokens"]),
            "–" if r["same_text_as_specdec_plain"] is None else f"{r['same_text_as_specdec_plain']} of {r['prompts']}",
        ]
        for r in kind["rows"]
        if r["prompt_set"] == set_name
    ]
    return table(
        [
            "system",
            "tok/s",
            "x llama.cpp plain",
            "x specdec plain",
            "prompt tok/s",
            "decode tok/s",
            "accepted ÷ drafted",
            "τ",
            "tokens",
            "same text",
        ],
        rows,
    )


def adaptation_text(kind: dict) -> str:
    """What --adapt recorded, what adapt did and estimated, and the head against the adapted head
    on the requests after the recorded ones."""
    a = kind["adaptation"]
    before, after = a["before"], a["after"]
    rows = {r["method"]: r for r in kind["rows"] if r["engine"] == "specdec"}
    head, adapted = rows["eagle"], rows["adapted_eagle"]
    steps = lambda estimates: " / ".join(_number(x, 3) for x in estimates["agreement_by_step"])  # noqa: E731
    return (
        f"The first {a['requests']} requests of the job, served by specdec's default at "
        f"{_number(a['recording_tokens_per_s'], 1)} tok/s and recorded as `serve --learn` records them "
        f"({a['recorded']} recorded); `specdec adapt` on them for at most {a['minutes']:g} min: {a['steps']} steps "
        f"in {a['training_seconds'] / 60:.1f} min of training, {a['adapt_seconds'] / 60:.1f} min in all (the "
        f"target's features over the recorded text included). adapt's own estimate on the last quarter of the "
        f"recorded requests, held out of its training: agreement by drafting step {steps(before)} → {steps(after)}, "
        f"τ {_number(before['tau_estimate'], 2)} → {_number(after['tau_estimate'], 2)}"
        f"{'' if a['improved'] else ' (not better: adapt would keep the old head)'}. Measured on the "
        f"{head['prompts']} requests after the recorded ones, never recorded: τ {_number(head['tau'], 2)} → "
        f"{_number(adapted['tau'], 2)} ({_times(adapted['tau'] / head['tau'])}), tok/s "
        f"{_number(head['tokens_per_s'], 1)} → {_number(adapted['tokens_per_s'], 1)} "
        f"({_times(adapted['tokens_per_s'] / head['tokens_per_s'])})."
    )


def llama_cpp_drafting_text(kind: dict, set_name: str) -> str:
    """specdec's drafters on a prompt set: α, acceptance by position and c in the rounds; then
    the k goodput chose, and a staged drafter's inner rounds ("" where no row drafts)."""
    rows = [
        r
        for r in kind["rows"]
        if r["prompt_set"] == set_name and r["engine"] == "specdec" and r["method"] != "plain" and "alpha" in r
    ]
    if not rows:
        return ""
    body = [
        [
            r["label"].removeprefix("specdec "),
            _number(r["alpha"], 2),
            " ".join(_number(a, 2) for a in r["acceptance_by_position"] or []) or "–",
            _number(r.get("cost_ratio_in_rounds"), 3),
        ]
        for r in rows
    ]
    text = table(["specdec drafter", "α", "acceptance by draft position 1, 2, …", "c in rounds"], body, left=(0, 2))
    notes = [
        f"k chosen by goodput (k:rounds), {r['label'].removeprefix('specdec ')}: {rounds_by_k_text(r['rounds_by_k'])}."
        for r in rows
        if r.get("rounds_by_k")
    ]
    notes += [
        f"{r['label'].removeprefix('specdec ')}, the draft model's inner rounds (prompt lookup drafting for it): "
        f"α {_number(r['inner_alpha'], 2)}, τ {_number(r['inner_tau'], 2)} tokens per draft-model forward."
        for r in rows
        if r.get("inner")
    ]
    return text + ("\n\n" + "\n".join(_bullet(note) for note in notes) if notes else "")


def _fastest_line(kind: dict, set_name: str) -> str:
    """specdec's fastest system against llama.cpp's fastest, on the prompt set."""
    rows = [r for r in kind["rows"] if r["prompt_set"] == set_name]
    fastest = {
        engine: max((r for r in rows if r["engine"] == engine), key=lambda r: r["tokens_per_s"])
        for engine in ("specdec", "llama.cpp")
    }
    ours, theirs = fastest["specdec"], fastest["llama.cpp"]
    return (
        f"specdec's fastest, {ours['label']}, {_number(ours['tokens_per_s'], 1)} tok/s, against llama.cpp's "
        f"fastest, {theirs['label']}, {_number(theirs['tokens_per_s'], 1)} tok/s: "
        f"**{_times(ours['tokens_per_s'] / theirs['tokens_per_s'])}**."
    )


VERIFY_HOW = {
    "llama.cpp": "llama-bench -p 7 -n 32 -d 64, pp7 ÷ tg per token",
    "specdec": "its runner, median of 3 × 20 forwards each",
}


def verify_cost_table(costs: dict) -> str:
    tokens = next(iter(costs.values())).get("verify_tokens", 7) if costs else 7
    rows = [
        [engine, _number(cost["verify_ms"], 2), _number(cost["step_ms"], 2), _number(cost["verify_cost"], 2)]
        for engine, cost in costs.items()
    ]
    how = "\n".join(
        _bullet(f"{engine}: {VERIFY_HOW.get(engine, 'measured')}, after {cost['depth']} tokens of context.")
        for engine, cost in costs.items()
    )
    return table(["engine", f"{tokens}-token forward ms", "1-token step ms", "verify ÷ step"], rows) + "\n\n" + how


def _cpu_kind_title(kind: dict) -> str:
    held = "held to AVX2" if kind["cpu_kind"] == "avx2" else "as it is"
    title = f"{kind['machine']['cpu']}, {kind['cpu_capability']} ({held})"
    sampling = kind.get("sampling") or {"name": "greedy"}
    if sampling["name"] == "greedy":
        return title
    return f"{title}, sampled (temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g})"


def _sampling_name(kind: dict) -> str:
    """ "greedy" or "sampled": the run's sampling (greedy for a run from before --sampled)."""
    return (kind.get("sampling") or {"name": "greedy"})["name"]


def _docs_file_name(kind: dict) -> str:
    """The docs' data file of a CPU kind and sampling: native.json, avx2-sampled.json, ..."""
    sampling = _sampling_name(kind)
    return kind["cpu_kind"] + ("" if sampling == "greedy" else f"-{sampling}") + ".json"


def _llama_cpp_setup(kind: dict) -> str:
    config, m = kind["config"], kind["machine"]
    model = Path(config["model"]).name + (f", draft {Path(config['draft']).name}" if config["draft"] else "")
    if config.get("cross_draft"):
        model += f", other-tokenizer draft {Path(config['cross_draft']).name}"
    if config.get("head"):
        model += f", EAGLE head {Path(config['head']).name}"
    sets = ", ".join(f"{len(s['prompts'])} {name}" for name, s in kind["prompt_sets"].items())
    text = (
        f"{m['date']}; {m['cores']} cores, {kind['threads']} threads each; torch {m['torch']} (instruction set "
        f"{kind['cpu_capability']}); llama.cpp {kind['llama_cpp'].get('commit') or ''} built with "
        f"`{' '.join(kind['llama_cpp']['flags'])}`, which reports "
        f"`{kind['llama_cpp']['system_info']}`. Target {model}; prompts: {sets}; at most {config['max_tokens']} "
        f"new tokens; k = {config['k']}."
    )
    load = kind.get("load_average")
    if load:
        text += (
            f" The machine's 1-minute load average was {load['before']:.1f} before the timed runs and "
            f"{load['after']:.1f} after them, on {m['cores']} cores."
        )
    return text + (f" Command: `{kind['command']}`." if kind.get("command") else "")


def write_llama_cpp_docs(results: dict, docs_dir: str | Path) -> Path:
    """docs/benchmarks/llama_cpp/<cpu kind>[-sampled].json for each CPU kind measured, then the
    section of docs/benchmarks.md between LLAMA_CPP_START and LLAMA_CPP_END from every kind's and
    sampling's latest file (placed after KEPT_MARKER the first time, so the main bench's
    --write-docs keeps it)."""
    docs_dir = Path(docs_dir)
    data_dir = docs_dir / "benchmarks" / LLAMA_CPP_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    for measured in results["cpu_kinds"]:
        kind = {**measured, "config": results["config"], "command": results.get("command")}
        (data_dir / _docs_file_name(kind)).write_text(json.dumps(_json_safe(kind), indent=2) + "\n")
    kinds = [
        json.loads((data_dir / f"{name}.json").read_text())
        for name in ("native", "avx2", "native-sampled", "avx2-sampled")
        if (data_dir / f"{name}.json").is_file()
    ]
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
