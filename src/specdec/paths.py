"""Where the project's own files live: the checkout, the shipped model pair, the docs, and
the caches the demo and the benchmarks build (below every module that uses them, so that
demo, cli and the bench command need not import one another for a path)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (src/specdec/paths.py -> .)
SHIPPED_TARGET = ROOT / "models" / "code-target"
SHIPPED_DRAFT = ROOT / "models" / "code-draft"
DOCS = ROOT / "docs"
BUILD = ROOT / "build"  # caches of generated models, apart from bench_out (which `specdec bench` replaces)
