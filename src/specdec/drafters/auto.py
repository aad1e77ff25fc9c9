"""speculative_method="auto", the default: the drafters a target gets when nobody names one.

    target the registry knows (models/registry.py: by name, or the path of its fetched file),
    with its shipped drafter in the checkout   -> suffix_then_draft: suffix decoding where the
                                                  request's own text or recent requests' outputs
                                                  continue the context, the shipped EAGLE head or
                                                  draft model everywhere else
    any other target                           -> suffix: suffix decoding alone (no model to load)
    arctic-inference not installed             -> prompt lookup in suffix decoding's place
                                                  (lookup_then_draft, or ngram)

The free drafters (suffix decoding, prompt lookup) cost almost nothing to propose; a model
drafter costs its steps. Either way the goodput policy (spec/goodput.py) gives a round k = 0,
plain decoding, wherever drafting does not pay, so the default costs at most a plain round's
price plus the policy's occasional trial. A choice says why in words (DraftChoice.reason): the
start-up log and the server's /v1/models show it. A shipped drafter that fails to load is
passed over for the free drafters, with the error in the reason.

Settings given with "auto" apply where the chosen method uses them (draft_dtype to a draft
model, the suffix_decoding_* fields to suffix decoding); the rest fall back to their defaults.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from specdec.config import DRAFT_MODEL_FIELDS, DRAFT_MODEL_SETTINGS, SUFFIX_METHODS, SpeculativeConfig
from specdec.drafters.base import Drafter
from specdec.drafters.suffix import suffix_cache_class
from specdec.models.eagle import is_head_directory
from specdec.models.errors import ModelLoadError
from specdec.models.registry import registered_as
from specdec.paths import ROOT, in_checkout

log = logging.getLogger("specdec")

SUFFIX_WORDS = "suffix decoding (the request's own text and recent requests' outputs)"
LOOKUP_WORDS = "prompt lookup (arctic-inference, which suffix decoding needs, is not installed)"


@dataclass(frozen=True)
class DraftChoice:
    """What "auto" chose: config (a method other than "auto") and reason, in words."""

    config: SpeculativeConfig
    reason: str

    @property
    def model(self) -> str | None:
        """The chosen drafter's path (relative to the checkout where it is in it), or None."""
        return None if self.config.model is None else _shown(Path(str(self.config.model)))

    @property
    def drafters(self) -> str:
        """The chosen drafters, as one line: "suffix_then_draft (models/qwen...-eagle3)"."""
        return self.config.method if self.model is None else f"{self.config.method} ({self.model})"

    def as_dict(self) -> dict:
        """For /v1/models: the method, the drafter's path (or None) and why."""
        return {"method": self.config.method, "model": self.model, "reason": self.reason}


def suffix_decoding_installed() -> bool:
    """Whether suffix decoding's trees (arctic-inference) import."""
    try:
        suffix_cache_class()
    except ImportError:
        return False
    return True


def choose_drafters(
    config: SpeculativeConfig, target_path, root: Path = ROOT, registry=None, cache=None
) -> DraftChoice:
    """The drafters for config (method "auto") drafting for the target at target_path (its
    name or path): the registry's shipped drafter behind the free drafters, or those alone."""
    entry = registered_as(target_path, registry, cache)
    if entry is None:
        return free_drafters(config, "no drafter is registered for this model (give a draft model or head for one)")
    listed = [root / path for path in entry.drafters]
    present = [path for path in listed if path.is_dir()]
    if not present:
        missing = ", ".join(_shown(path) for path in listed) or "none"
        return free_drafters(config, f"{entry.name}'s shipped drafter is not in this checkout ({missing})")
    drafter = present[0]
    kind = "EAGLE head" if is_head_directory(drafter) else "draft model"
    if suffix_decoding_installed():
        method, free = "suffix_then_draft", SUFFIX_WORDS
    else:
        method, free = "lookup_then_draft", LOOKUP_WORDS
    reason = f"{entry.name} ships {kind} {_shown(drafter)}: {free} where it matches, the {kind} elsewhere"
    return DraftChoice(_as_method(config, method, str(drafter)), reason)


def free_drafters(config: SpeculativeConfig, why: str) -> DraftChoice:
    """The drafters that need no model: suffix decoding, else prompt lookup."""
    if suffix_decoding_installed():
        return DraftChoice(_as_method(config, "suffix"), f"{why}: {SUFFIX_WORDS} alone")
    return DraftChoice(_as_method(config, "ngram"), f"{why}: {LOOKUP_WORDS}")


def build(config: SpeculativeConfig, target, target_runner, factories: dict) -> tuple[DraftChoice, Drafter]:
    """The chosen drafters, made by factories (the method -> factory table, as DRAFTERS); a
    shipped drafter that does not load gives way to the free drafters."""
    choice = choose_drafters(config, target.path)
    try:
        return choice, factories[choice.config.method](choice.config, target, target_runner)
    except ModelLoadError as e:
        if choice.config.model is None:
            raise
        log.warning("the shipped drafter %s did not load (%s): drafting without it", choice.config.model, e)
        choice = free_drafters(config, f"the shipped drafter {choice.config.model} did not load: {e}")
        return choice, factories[choice.config.method](choice.config, target, target_runner)


def _as_method(config: SpeculativeConfig, method: str, model: str | None = None) -> SpeculativeConfig:
    """config as the chosen method: the settings that method uses kept, the others at their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    unused = [name for name in DRAFT_MODEL_FIELDS if method not in DRAFT_MODEL_SETTINGS]
    unused += [name for name in defaults if name.startswith("suffix_decoding_") and method not in SUFFIX_METHODS]
    kept = {name: defaults[name] for name in unused}
    return dataclasses.replace(config, method=method, model=model, **kept)


def _shown(path: Path) -> str:
    """path relative to the checkout where it lies inside it (resolved first)."""
    return in_checkout(path.resolve())
