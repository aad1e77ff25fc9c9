"""Early exit (self-speculation, as LayerSkip drafts): the target's own first layers draft.

The draft is the target cut after its first `early_exit_layer` layers, then its own final norm
and output layer (LlamaModel.first_layers: the same weights, nothing copied or trained); it runs
as a draft model does (drafters/draft_model.py), with a cache of its own for those layers, and
the full target verifies every token, so the output is the target's exactly.

Default depth: half the target's layers (DEFAULT_FRACTION). A model not trained for early exit
(LayerSkip trains for it; most models are not) predicts poorly from its middle layers; the
goodput policy measures what the drafts are worth and drafts less, or not at all, where they do
not pay.

Not done: the shallow layers' K/V are computed twice, once while drafting and again in the
verify forward. They are the same numbers for the accepted tokens (same weights, same inputs),
so the verify forward could start from them and run only the deeper layers; that needs a
forward that starts at a layer, which the model does not have yet.
"""

from __future__ import annotations

from specdec.drafters.draft_model import DraftModelDrafter
from specdec.models.loader import LoadedModel
from specdec.worker import ModelRunner

DEFAULT_FRACTION = 0.5


def default_exit_layer(num_layers: int) -> int:
    """Half the depth, at least 1 and below the full depth."""
    return max(1, min(num_layers - 1, round(num_layers * DEFAULT_FRACTION)))


def early_exit_drafter(spec, target: LoadedModel, target_runner: ModelRunner) -> DraftModelDrafter:
    """A draft-model drafter over the target's first spec.early_exit_layer layers (see above)."""
    num_layers = target.model.config.num_layers
    if num_layers < 2:
        raise ValueError(
            f"speculative_method='early_exit' needs a target of 2 or more layers; {target.path} has {num_layers}"
        )
    layer = default_exit_layer(num_layers) if spec.early_exit_layer is None else spec.early_exit_layer
    if not 1 <= layer < num_layers:
        raise ValueError(
            f"early_exit_layer must be in [1, {num_layers - 1}] for this target of {num_layers} layers "
            f"(the draft is its first early_exit_layer layers), got {layer}"
        )
    draft = target_runner.model.first_layers(layer)
    runner = ModelRunner(draft, target_runner.platform, target_runner.compile_mode, name="the early-exit draft")
    return DraftModelDrafter(runner, target.model.config.vocab_size, spec.draft_confidence_threshold)
