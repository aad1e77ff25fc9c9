"""Frozen, validated configuration: what a request asks for and how to speculate.

Terms (see docs/architecture.md): the *target* is the model whose distribution the output follows
exactly; the *drafter* proposes tokens; *k* (``num_speculative_tokens``) is how many draft
tokens are proposed per round for one sequence.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from specdec.tree import TreeShape


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
INT64_MIN, INT64_MAX, UINT64_MAX = -2**63, 2**63 - 1, 2**64 - 1
MAX_LOGPROBS = 20  # the most top tokens a request's logprobs may ask for, as vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, in vLLM's names.

    temperature: 0 means greedy (argmax, no randomness); so does any temperature below
        GREEDY_TEMPERATURE (1e-5, as in vLLM), where logits / T would overflow float32.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p.
    min_p: drop tokens whose probability is below min_p times the most likely one's.
    max_tokens: the most tokens to generate.
    stop: strings that end the generation; the text stops before them.
    stop_token_ids: token ids that end the generation (kept in the token ids, like EOS).
    seed: a per-request seed (any integer torch.Generator takes: from -2**63 to 2**64 - 1).
        The request draws the same random numbers whatever else is batched, so in float32 it
        gets the same tokens. In bfloat16 or float16 a wider batch pads attention to more
        (masked) keys, which can round a near-tie differently and so change a token, as in
        other engines that batch. Under speculation, rounds with a seeded sampled request
        draft the fixed num_speculative_tokens (not the goodput policy's choice, which varies
        with timings), since its tokens depend on how many drafts each round judged.
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    logprobs: also return each generated token's log-probability under the target, and those of
        its `logprobs` most likely tokens (0: the generated token's alone; None: none). They are
        of the target's own distribution, before temperature and the other warps (vLLM's
        default), so they do not depend on the sampling settings or on speculation.
    num_speculative_tokens: this request's most draft tokens a round (specdec's own, not
        vLLM's): None = the engine's k; 0 = no speculation for it; above the engine's k, the
        engine's k. Requests with different values share a batch. With a tree shape, a
        request drafts the engine's whole tree or (0) nothing. Never changes the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        check(isinstance(self.stop, (tuple, list)) or self.stop is None,
              f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if is_int(self.stop_token_ids):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        check(isinstance(self.stop_token_ids, (tuple, list, set, frozenset)) or self.stop_token_ids is None,
              f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        check(is_real(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        check(is_real(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX,
               f"top_k must be an integer >= -1 (-1 or 0 = no limit), got {self.top_k!r}")
        check(is_real(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        check(is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        check(self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= UINT64_MAX),
               f"seed must be an integer from -2**63 to 2**64 - 1, or None, got {self.seed!r}")
        check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to return with each "
              f"token's own), or None, got {self.logprobs!r}")
        check(self.num_speculative_tokens is None or (is_int(self.num_speculative_tokens)
                                                      and self.num_speculative_tokens >= 0),
              f"num_speculative_tokens must be an integer >= 0 (0 = no speculation), or None, "
              f"got {self.num_speculative_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


COMPILE_MODES = ("auto", "on", "off")  # how the models run: see runner.py
COMPILE_HELP = ("run the models compiled (torch.compile): on, off, or auto (the default: only for long work, "
                "where the compile time pays back)")

K_POLICIES = ("goodput", "fixed")  # how each round's k is chosen: see SpeculativeConfig
QUANTIZATIONS = ("int8", "int4")  # weight-only, see models/quantized_linear.py; None: as loaded
# "auto": a GGUF file's quantized matrices run as the file holds them (models/gguf_model.py),
# anything else as loaded; None dequantizes a GGUF file
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)


def check_quantization_name(quantization, what: str = "quantization") -> None:
    """None, "auto", "int8" or "int4", else a ValueError that names the valid choices."""
    check(quantization is None or quantization in QUANTIZATION_CHOICES,
          f"{what} must be one of None, {', '.join(repr(q) for q in QUANTIZATION_CHOICES)}; got {quantization!r}")


def keeps_file_quantization(quantization: str | None) -> bool:
    """Whether a GGUF file's quantized matrices stay as they are (else they are dequantized)."""
    return quantization == "auto"


def requantization(quantization: str | None) -> str | None:
    """The weight-only quantization the runner applies to a float model: "int8", "int4" or None."""
    return quantization if quantization in QUANTIZATIONS else None


QUANTIZATION_HELP = ("weights: auto (the default: a GGUF file's quantized tensors run as they are, anything else "
                     "as loaded), none (dequantize a GGUF file), or weight-only int8 (per output channel) / int4 "
                     "(groups of 32) of the float weights; CPU only")

QUANTIZATION_ARGS = ("auto", "none", *QUANTIZATIONS)  # on the command line, "none" for None


def quantization_from_arg(text: str) -> str | None:
    return None if text == "none" else text


SPECULATIVE_METHODS = ("draft_model", "ngram", "lookup_then_draft", "eagle", "early_exit")
TREE_METHODS = ("draft_model", "eagle", "early_exit")  # the drafters that grow trees (Drafter.grows_trees)
NEEDS_DRAFT_MODEL = ("draft_model", "lookup_then_draft", "eagle")  # "eagle": the head's directory
# the shortest n-gram match prompt lookup trusts, by method: with a draft model to fall back
# on, a one-token match is too weak to use instead of it
DEFAULT_NGRAM_MIN = {"ngram": 1, "lookup_then_draft": 2, "draft_model": 1, "eagle": 1, "early_exit": 1}


DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


SMALL_DRAFT_PARAMETERS = 100_000_000


def torch_dtypes() -> dict:
    """Names (and their aliases) -> the torch dtypes a model can run in."""
    import torch  # not at the top: the command line reads this module before it needs torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtypes.update({alias: dtypes[name] for alias, name in DTYPE_ALIASES.items()})  # "fp16", "bf16", "half", ...
    return dtypes


def dtype_name(dtype):
    """A dtype as its canonical name: torch.bfloat16 or "bf16" -> "bfloat16"; other values as given."""
    if not isinstance(dtype, str):
        import torch  # not at the top: the command line reads this module before it needs torch

        return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    return DTYPE_ALIASES.get(dtype, dtype)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    method: "draft_model" (a smaller model with the target's tokenizer), "ngram" (prompt
        lookup: copy what followed the last matching n-gram of the context), or
        "lookup_then_draft" (prompt lookup for the rows where it finds a match, the draft
        model for the others), or "eagle" (a one-layer head over the target's own features,
        trained by `specdec train-heads`; see drafters/eagle.py), or "early_exit" (self-
        speculation: the target's own first early_exit_layer layers, its final norm and output
        layer draft; see drafters/early_exit.py).
    model: the draft model's directory, for "draft_model" and "lookup_then_draft"; the
        head's directory for "eagle".
    num_speculative_tokens: k, draft tokens proposed per round (0 = plain decoding).
    ngram_min / ngram_max: the n-gram lengths prompt lookup tries, longest first. ngram_min
        None: 1 for "ngram", 2 for "lookup_then_draft".
    draft_dtype: the draft model's dtype. "auto": for a draft of at most
        SMALL_DRAFT_PARAMETERS on the CPU, float32 (its matrices are small, and bfloat16 CPU
        kernels cost more per call than the bytes they save) except its matrices of at least
        2 MB in float32 (draft_model.LARGE_WEIGHT_BYTES: in a draft this small, typically only
        the output layer), big enough for bytes to matter, prepacked in bfloat16
        (benchmarks/bench_draft.py); otherwise the target's dtype. The draft's dtype never
        changes the output, only the acceptance rate and the speed.
    draft_confidence_threshold: adaptive k for the draft model. A row stops drafting for the
        round after a token the draft gave less than this probability (the tokens after it
        would likely be rejected); 0 = always draft k. (transformers' assisted generation
        calls it assistant_confidence_threshold.)
    draft_quantization: "auto", None, "int8" or "int4": the draft's weights (as LLM's
        quantization for the target). Changes the acceptance rate, never the output.
    early_exit_layer: for "early_exit", how many of the target's layers draft (1 to its depth
        less one; None: drafters/early_exit.py's default, half its depth).
    k_policy: "goodput" (each round picks its k, 0 to num_speculative_tokens, for the most
        expected tokens per second, from each request's acceptance rate and the measured costs;
        see goodput.py) or "fixed" (every round drafts num_speculative_tokens).
    tree: "chain" (k tokens, one after another), "auto" (EAGLE-2's dynamic tree) or branching
        factors per depth like "3,2,1": a tree of num_speculative_tokens candidate tokens,
        verified in one forward (tree.py), for a drafter that grows trees (TREE_METHODS).
        Every round drafts the whole tree (k_policy applies to chains).
    """

    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 5
    ngram_min: int | None = None
    ngram_max: int = 4
    draft_dtype: str = "auto"
    draft_confidence_threshold: float = 0.0
    draft_quantization: str | None = "auto"
    k_policy: str = "goodput"
    early_exit_layer: int | None = None
    tree: str = "chain"

    def __post_init__(self) -> None:
        check(self.method in SPECULATIVE_METHODS,
               f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        check(is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 0,
               f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        check(self.model is None or (isinstance(self.model, (str, os.PathLike)) and str(self.model).strip()),
              f"speculative_model must be the path of a draft model directory, got {self.model!r}")
        check(self.method not in NEEDS_DRAFT_MODEL or self.model is not None,
               f"speculative_method={self.method!r} needs speculative_model=<draft directory>")
        check(self.method in NEEDS_DRAFT_MODEL or self.model is None,
               f"speculative_method={self.method!r} uses no draft model, but speculative_model={self.model!r} "
               "was given; drop it, or use 'lookup_then_draft' for prompt lookup with the draft behind it")
        if self.ngram_min is None:
            default = DEFAULT_NGRAM_MIN[self.method]
            object.__setattr__(self, "ngram_min", min(default, self.ngram_max) if is_int(self.ngram_max) else default)
        check(is_int(self.ngram_min) and is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max,
               f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        check(is_real(self.draft_confidence_threshold) and 0 <= self.draft_confidence_threshold <= 1,
               f"draft_confidence_threshold must be in [0, 1], got {self.draft_confidence_threshold!r}")
        object.__setattr__(self, "draft_dtype", dtype_name(self.draft_dtype))
        check(self.draft_dtype in DRAFT_DTYPES, f"draft_dtype must be one of {DRAFT_DTYPES} (or a torch dtype), got "
                                                f"{self.draft_dtype!r}")
        check_quantization_name(self.draft_quantization, "draft_quantization")
        check(self.k_policy in K_POLICIES, f"speculative_k_policy must be one of {K_POLICIES}, got {self.k_policy!r}")
        check(self.early_exit_layer is None or (is_int(self.early_exit_layer) and self.early_exit_layer >= 1),
              f"early_exit_layer must be an integer >= 1, got {self.early_exit_layer!r}")
        check(self.early_exit_layer is None or self.method == "early_exit",
              f"early_exit_layer is for speculative_method='early_exit', not {self.method!r}")
        TreeShape.parse(self.tree)  # raises ValueError naming the forms it takes
        check(self.tree == "chain" or self.method in TREE_METHODS,
              f"speculative_tree={self.tree!r} needs a drafter that grows trees ({', '.join(TREE_METHODS)}); "
              f"speculative_method={self.method!r} drafts chains: drop speculative_tree")
        unused = [f"{name}={value!r}" for name, value, neutral in (
            ("draft_dtype", self.draft_dtype, "auto"),
            ("draft_confidence_threshold", self.draft_confidence_threshold, 0),
            ("draft_quantization", self.draft_quantization, "auto")) if value != neutral
            and not (name == "draft_confidence_threshold" and self.method == "early_exit")]  # it drafts by model
        check(self.method in NEEDS_DRAFT_MODEL or not unused,
              f"{', '.join(unused)} configure a draft model, and speculative_method={self.method!r} uses none; "
              "drop them, or use 'lookup_then_draft' for prompt lookup with a draft model behind it")


# Validation of configuration values, shared by every frozen configuration dataclass.

def is_real(x) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """An int (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_device(device):
    """device (a string or torch.device) as a torch.device: cpu, cuda or cuda:N, and CUDA only
    where this machine has that device; else a ValueError that names it."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    check(parsed is not None and parsed.type in ("cpu", "cuda"),
          f"device must be cpu, cuda or cuda:N, got {device!r}")
    check(parsed.type != "cuda" or torch.cuda.is_available(),
          f"device {str(device)!r}: CUDA is not available on this machine (no GPU, or a CPU build of PyTorch); "
          "use cpu")
    check(parsed.type != "cuda" or (parsed.index or 0) < torch.cuda.device_count(),
          f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return parsed


def check(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok."""
    if not ok:
        raise ValueError(message)
