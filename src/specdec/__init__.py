"""specdec: exact, batched speculative decoding for Hugging Face Llama-family checkpoints.

The public names load on first use (PEP 562), so that `specdec --help` and the command line's
first second do not wait for PyTorch; `from specdec import LLM` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_MODULES = {
    "SamplingParams": "specdec.config",
    "StructuredOutputsParams": "specdec.config",
    "SpeculativeConfig": "specdec.config",
    "LLM": "specdec.llm",
    "CompletionOutput": "specdec.llm",
    "RequestOutput": "specdec.llm",
    "SpecStats": "specdec.metrics",
    "ModelLoadError": "specdec.models.loader",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "SpeculativeConfig",
    "RequestOutput",
    "CompletionOutput",
    "SpecStats",
    "ModelLoadError",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from specdec.config import SamplingParams, SpeculativeConfig, StructuredOutputsParams
    from specdec.llm import LLM, CompletionOutput, RequestOutput
    from specdec.metrics import SpecStats
    from specdec.models.loader import ModelLoadError


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
