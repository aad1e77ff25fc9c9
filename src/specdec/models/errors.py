"""The error a model that cannot be loaded raises (models/loader.py, models/gguf.py and the
modules they use), in a module of its own so that each can raise it without importing the other."""


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message says why and what to do."""
