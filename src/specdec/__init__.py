"""specdec: exact, batched speculative decoding for Hugging Face Llama-family checkpoints."""

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM, CompletionOutput, RequestOutput
from specdec.metrics import SpecStats
from specdec.models.loader import ModelLoadError

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "SpecStats",
           "ModelLoadError"]
__version__ = "0.1.0"
