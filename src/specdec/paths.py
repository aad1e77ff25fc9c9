"""Where the project's own files live: the checkout, the shipped model pair, the docs, and
the caches the demo and the benchmarks build (below every module that uses them, so that
demo, cli and the bench command need not import one another for a path)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (src/specdec/paths.py -> .)


def in_checkout(path: Path) -> str:
    """path relative to the checkout where it lies inside it, else as given."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


SHIPPED_TARGET = ROOT / "models" / "code-target"
SHIPPED_DRAFT = ROOT / "models" / "code-draft"
SHIPPED_HEAD = ROOT / "models" / "code-target-eagle"  # the shipped target's EAGLE head
DOCS = ROOT / "docs"
BUILD = ROOT / "build"  # caches of generated models, apart from bench_out (which `specdec bench` replaces)

# Models fetched from outside (never committed): SPECDEC_CACHE, else ~/.cache/specdec. models/registry.py
# names them, and puts each in CACHE/models/<name>/ (the wheels they come in: CACHE/downloads)
CACHE = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()
SMOLLM2_DIR = CACHE / "models" / "smollm2"
SMOLLM2_GGUF = SMOLLM2_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"  # `specdec fetch smollm2` puts it here
SMOLLM2_TARGET = SMOLLM2_DIR / "hf"  # ... and converts it to this Hugging Face directory
SMOLLM2_DRAFT = ROOT / "models" / "smollm2-draft"  # its distilled draft, shipped
