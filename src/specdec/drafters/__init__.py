"""Drafters, by the name `speculative_method` uses: each method's factory (methods.py, where a
new drafter's one line goes) imported from drafters/; "auto" composed of them (auto.py)."""

import functools
import importlib
from collections.abc import Callable

from specdec.drafters import auto
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.lookup_then_draft import LookupThenDraftDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_then_draft import SuffixThenDraftDrafter
from specdec.methods import METHODS


def factories(package: str) -> dict[str, Callable]:
    """The factories of the methods whose drafters live in package ("specdec.drafters": these;
    llm.py asks for spec/'s), imported by the names methods.py gives them."""
    found = {}
    for name, method in METHODS.items():
        if method.factory is not None and method.factory.startswith(package + "."):
            module, _, attribute = method.factory.partition(":")
            found[name] = functools.reduce(getattr, attribute.split("."), importlib.import_module(module))
    return found


DRAFTERS = factories("specdec.drafters")
# the default: the registry's shipped drafter behind the free drafters, or those alone (drafters/auto.py)
DRAFTERS["auto"] = lambda spec, target, target_runner: auto.build(spec, target, target_runner, DRAFTERS)[1]

__all__ = [
    "DRAFTERS",
    "CrossTokenizerDrafter",
    "Draft",
    "Drafter",
    "DraftModelDrafter",
    "EagleDrafter",
    "LookupThenDraftDrafter",
    "NgramDrafter",
    "SuffixDrafter",
    "SuffixThenDraftDrafter",
    "factories",
]
