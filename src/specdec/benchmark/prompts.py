"""Prompt sets for benchmarks.

held-out code prompts: a held-out standard-library module's text cut just after one of its
function's `def` line (the signature, up to the colon and line break), so the model writes the
body. Only modules in corpus.HELD_OUT_MODULES are used: the shipped pair never saw them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from specdec.training.corpus import HELD_OUT_MODULES, stdlib_path


@dataclass(frozen=True)
class Prompt:
    name: str  # "module.py:function"
    text: str


def held_out_code_prompts(per_module: int = 2, max_chars: int = 1200) -> list[Prompt]:
    """Up to per_module prompts from each held-out module: the last max_chars characters of the
    file before (and including) a `def` line, cut at a line start."""
    prompts = []
    for module in HELD_OUT_MODULES:
        file = stdlib_path() / module
        if not file.is_file():
            continue
        source = file.read_text(encoding="utf-8")
        for name, cut in _def_line_ends(source)[:per_module]:
            text = source[:cut]
            if len(text) > max_chars:
                start = text.index("\n", len(text) - max_chars) + 1
                text = text[start:]
            prompts.append(Prompt(f"{module}:{name}", text))
    return prompts


def _def_line_ends(source: str) -> list[tuple[str, int]]:
    """(function name, offset just past its signature's line break), for functions whose body
    starts on a later line, spread evenly through the file."""
    lines = source.splitlines(keepends=True)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno > node.lineno:
            last = node.body[0].lineno - 2  # 0-based: the line before the body
            while last > node.lineno - 1 and (not lines[last].strip() or lines[last].lstrip().startswith("#")):
                last -= 1  # comments and blank lines between the signature and the body
            found.append((node.lineno, node.name, line_starts[last + 1]))
    found.sort()
    step = max(1, len(found) // 4)
    return [(name, offset) for _, name, offset in found[step // 2::step]]
