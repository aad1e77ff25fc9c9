"""Drafters, by the name `speculative_method` uses. A new drafter is a new file and a line
in DRAFTERS: a factory (SpeculativeConfig, the loaded target, the target's ModelRunner) -> Drafter."""

from specdec.drafters import auto
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter, draft_model_drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.early_exit import early_exit_drafter
from specdec.drafters.lookup_then_draft import LookupThenDraftDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_then_draft import SuffixThenDraftDrafter

DRAFTERS = {
    "draft_model": draft_model_drafter,  # a DraftModelDrafter, or a CrossTokenizerDrafter for another tokenizer
    "ngram": NgramDrafter.from_config,
    "lookup_then_draft": LookupThenDraftDrafter.from_config,
    "eagle": EagleDrafter.from_config,
    "early_exit": early_exit_drafter,
    "suffix": SuffixDrafter.from_config,
    "suffix_then_draft": SuffixThenDraftDrafter.from_config,
}
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
]
