"""The engine: a short step loop (engine.py) over the scheduler (which requests hold cache
slots), the round (spec/), and the output processor (stop conditions, text, streaming)."""

from specdec.engine.engine import Engine

__all__ = ["Engine"]
