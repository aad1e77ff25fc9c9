"""The speculative methods: every name `speculative_method` takes, what each needs and does, and
where its drafter is made. A new drafter is one file behind the Drafter interface and one line
here; config.py's checks and the command line's choices read this table.

A method's factory is named as "module:attribute" (a callable (SpeculativeConfig, the loaded
target, the target's ModelRunner) -> Drafter), imported by the layer that makes drafters
(drafters/__init__.py for drafters/; llm.py for staged drafts, which verify with the rejection
sampler and so sit in spec/), so that this ground-floor table imports nothing above it. "auto"
has none: it is a composition of the others (drafters/auto.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """factory: see the module; needs_model: a draft model's directory (a head's, stages) in
    speculative_model; grows_trees: drafts trees (Drafter.grows_trees); suffix: drafts, or may, by
    suffix decoding (takes its settings); chooses: picks its drafters itself (takes every
    drafter's settings); ngram_min: the shortest n-gram match its prompt lookup trusts (None: the
    chosen method's)."""

    factory: str | None
    needs_model: bool = False
    grows_trees: bool = False
    suffix: bool = False
    chooses: bool = False
    ngram_min: int | None = 1

    @property
    def draft_model_settings(self) -> bool:
        """Whether it takes a draft model's settings (draft_dtype, ...): it has one, or may choose one."""
        return self.needs_model or self.chooses


METHODS: dict[str, Method] = {
    "auto": Method(None, suffix=True, chooses=True, ngram_min=None),
    "draft_model": Method("specdec.drafters.cross_tokenizer:draft_model_drafter", needs_model=True, grows_trees=True),
    "ngram": Method("specdec.drafters.ngram:NgramDrafter.from_config"),
    # with a draft model to fall back on, a one-token match is too weak to use instead of it
    "lookup_then_draft": Method(
        "specdec.drafters.lookup_then_draft:LookupThenDraftDrafter.from_config", needs_model=True, ngram_min=2
    ),
    "eagle": Method("specdec.drafters.eagle:EagleDrafter.from_config", needs_model=True, grows_trees=True),
    "early_exit": Method("specdec.drafters.early_exit:early_exit_drafter", grows_trees=True),
    "staged": Method("specdec.spec.staged:StagedDrafter.from_config", needs_model=True),
    "suffix": Method("specdec.drafters.suffix:SuffixDrafter.from_config", suffix=True),
    "suffix_then_draft": Method(
        "specdec.drafters.suffix_then_draft:SuffixThenDraftDrafter.from_config", needs_model=True, suffix=True
    ),
}
