"""How a model executes: the ModelRunner (dtype, compilation, weight layout, static shapes),
which owns the model's key/value cache and runs ForwardBatch records (tokens, positions and
each row's cache slot, explicit)."""

from specdec.worker.runner import ForwardBatch, ModelRunner, check_compile_mode

__all__ = ["ForwardBatch", "ModelRunner", "check_compile_mode"]
