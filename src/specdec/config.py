"""Frozen, validated configuration: what a request asks for and how to speculate.

Terms (see docs/architecture.md): the *target* is the model whose distribution the output follows
exactly; the *drafter* proposes tokens; *k* (``num_speculative_tokens``) is how many draft
tokens are proposed per round for one sequence.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, TypeGuard

from specdec import structural_tag
from specdec.methods import METHODS
from specdec.tree import TreeShape

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
MAX_LOGPROBS = 20  # the most top tokens a request's logprobs may ask for, as vLLM's default max_logprobs
MAX_N = 128  # the most completions one request may ask for (n), as OpenAI caps it


# Each setting is named in the words of the interface it came through: LLM's keyword in Python
# (num_speculative_tokens=), a flag on the command line (--num-speculative-tokens). A field's
# metadata holds its names and its help, once (setting()); a refused value raises ConfigError,
# whose message names the fields it is about and is said in either set of words (Wording).


class Wording(NamedTuple):
    """How an interface names a configuration's fields (owner: the dataclass; field: its name)."""

    name: Callable[[type, str], str]  # the field, e.g. "num_speculative_tokens" / "--num-speculative-tokens"
    value: Callable[[type, str, object], str]  # the field set to a value: "speculative_tree='auto'" / "--tree auto"
    placeholder: Callable[[type, str, str], str]  # set to a value described: "speculative_model=<draft directory>"


def keyword(owner: type, name: str) -> str:
    """The Python keyword a field is given by: LLM's flat keyword for SpeculativeConfig's fields
    (speculative_method for method), else the field's own name."""
    return _metadata(owner, name).get("keyword", name)


PYTHON_WORDS = Wording(
    keyword,
    lambda owner, name, value: f"{keyword(owner, name)}={value!r}",
    lambda owner, name, text: f"{keyword(owner, name)}={text}",
)


def _metadata(owner: type, name: str) -> Mapping[str, Any]:
    return next((f.metadata for f in fields(owner) if f.name == name), {})


class ConfigError(ValueError):
    """A configuration value its dataclass refuses. str(error) says it in Python's words; an
    interface with words of its own for the fields (the command line's flags) says it with
    error.in_words(its Wording). fields: the fields the message names.

    The message is a template: {field} names a field, {field:=} names it with the value it was
    given, {field:=VALUE} with a value, {field:=<text>} with a placeholder; the other {names}
    are the values passed with it."""

    def __init__(self, config, template: str, values: dict):
        self.owner = type(config)
        self.given = {f.name: getattr(config, f.name, None) for f in fields(config)}
        self.template, self.values = template, values
        self.fields = tuple(name for name in self.given if "{" + name + "}" in template or "{" + name + ":" in template)
        super().__init__(self.in_words(PYTHON_WORDS))

    def __reduce__(self):  # pickled (a worker's error), it is the ValueError it says
        return ValueError, (str(self),)

    def in_words(self, words: Wording) -> str:
        names = {name: _Named(words, self.owner, name, value) for name, value in self.given.items()}
        return self.template.format(**names, **self.values)


class _Named:
    """A field in a ConfigError's template, formatted as a Wording says it."""

    def __init__(self, words: Wording, owner: type, name: str, value):
        self.words, self.owner, self.name, self.value = words, owner, name, value

    def __format__(self, spec: str) -> str:
        if not spec:
            return self.words.name(self.owner, self.name)
        if spec == "=":
            return self.words.value(self.owner, self.name, self.value)
        if spec.startswith("=<"):
            return self.words.placeholder(self.owner, self.name, spec[1:])
        return self.words.value(self.owner, self.name, spec[1:])


class Refusal:
    """need(ok, template, **values): raise ConfigError(config, template, values) unless ok."""

    def __init__(self, config):
        self.config = config

    def __call__(self, ok: object, template: str, **values) -> None:
        if not ok:
            raise ConfigError(self.config, template, values)


def setting(
    default,
    help: str,
    flag: str | tuple[str, ...],
    keyword: str | None = None,
    *,
    old_flags: tuple[str, ...] = (),
    metavar: str | None = None,
    parse: Callable[[str], object] = str,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
    bare: bool = False,
    repeat: bool = False,
):
    """A configuration field with its help and its names: flag (the command line's spelling,
    or spellings, as -k and --num-speculative-tokens: a message names the one typed, else the
    first), old_flags (earlier spellings, still taken, not shown), keyword (LLM's, if not the
    field's name). parse: the flag's text -> the value; choices: the texts it takes; shown: the
    default as --help says it (None: the default itself); bare: the flag may be given without
    a value (it then asks for the default); repeat: the flag may be given more than once, each
    adding an entry to a list (--draft A --draft B). model_flags.add_speculative_arguments
    makes the flags."""
    flags = (flag,) if isinstance(flag, str) else tuple(flag)
    metadata = {
        "help": help,
        "flags": flags,
        "old_flags": old_flags,
        "metavar": metavar,
        "parse": parse,
        "choices": choices,
        "shown": shown if shown is not None else _shown(default),
        "bare": bare,
        "repeat": repeat,
    }
    if keyword is not None:
        metadata["keyword"] = keyword
    return field(default=default, metadata=metadata)


def _shown(default) -> str:
    return "none" if default is None else f"{default:g}" if isinstance(default, float) else str(default)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must follow, in vLLM's names (exactly one of them): json, a JSON schema
    (a dict, or its JSON text); json_object, any JSON object; regex, a regular expression;
    choice, one of these strings; grammar, a Lark or GBNF (llama.cpp's) grammar; structural_tag,
    free text whose tags hold JSON of their schemas ({"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, a dict or its JSON text: spec/structural_tag.py). Enforced by
    llguidance (spec/grammar.py) at every position the target samples from, drafts included.
    disable_any_whitespace: JSON without whitespace between its tokens (vLLM's; by default up to
    64 whitespace characters between two tokens: pretty-printing, not a run of spaces until
    max_tokens, which a small model can fall into). whitespace_pattern: the regex JSON's
    whitespace between two tokens follows instead (vLLM's; json and json_object only)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    structural_tag: dict | str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        need = Refusal(self)
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = ("json", "regex", "choice", "grammar", "structural_tag")
        given = [name for name in kinds if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        need(
            len(given) == 1,
            "structured outputs take exactly one of json, regex, choice, grammar, structural_tag and json_object, "
            "got {got}",
            got=given or "none",
        )
        need(
            self.json is None or isinstance(self.json, (dict, str)), "{json} must be a JSON schema (a dict or its text)"
        )
        need(self.regex is None or isinstance(self.regex, str), "{regex} must be a string, got {got!r}", got=self.regex)
        need(
            self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice)),
            "{choice} must be a non-empty list of non-empty strings, got {got!r}",
            got=self.choice,
        )
        need(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
            "{grammar} must be a Lark or GBNF grammar (a non-empty string), got {got!r}",
            got=self.grammar,
        )
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            need(isinstance(value, bool), f"{{{name}}} must be True or False, got {{got!r}}", got=value)
        if self.structural_tag is not None:
            structural_tag.parse(self.structural_tag)  # a ValueError names what is wrong
        need(
            self.whitespace_pattern is None
            or (isinstance(self.whitespace_pattern, str) and (self.json is not None or self.json_object)),
            "{whitespace_pattern} is JSON's whitespace: a regex, with json or json_object only, got {got!r}",
            got=self.whitespace_pattern,
        )
        need(
            self.whitespace_pattern is None or not self.disable_any_whitespace,
            "{whitespace_pattern} and {disable_any_whitespace} both say JSON's whitespace; give one",
        )


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, in vLLM's names.

    temperature: 0 means greedy (argmax, no randomness); so does any temperature below
        GREEDY_TEMPERATURE (1e-5, as in vLLM), where logits / T would overflow float32.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p.
    min_p: drop tokens whose probability is below min_p times the most likely one's.
    max_tokens: the most tokens to generate.
    stop: strings that end the generation; the text stops before them (include_stop_str_in_output,
        vLLM's: after them).
    stop_token_ids: token ids that end the generation (kept in the token ids, like EOS).
    seed: a per-request seed (any integer torch.Generator takes: from -2**63 to 2**64 - 1).
        The request draws the same random numbers whatever else is batched, so in float32 it
        gets the same tokens. In bfloat16 or float16 a wider batch pads attention to more
        (masked) keys, which can round a near-tie differently and so change a token, as in
        other engines that batch. Under speculation, rounds with a seeded sampled request
        draft the fixed num_speculative_tokens (not the goodput policy's choice, which varies
        with timings), since its tokens depend on how many drafts each round judged.
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    skip_special_tokens: the text leaves special tokens out (vLLM's default; False: writes them).
    logprobs: also return each generated token's log-probability under the target, and those of
        its `logprobs` most likely tokens (0: the generated token's alone; None: none). They are
        of the target's own distribution, before temperature and the other warps (vLLM's
        default), so they do not depend on the sampling settings or on speculation.
    prompt_logprobs: also return each prompt token's log-probability under the target given the
        tokens before it (the first token has none), and those of the `prompt_logprobs` most
        likely tokens there (vLLM's; None: none). A request asking for them finds no prefix in
        the prefix cache: its prefill computes every position (as in vLLM).
    num_speculative_tokens: this request's most draft tokens a round (specdec's own, not
        vLLM's): None = the engine's k; 0 = no speculation for it; above the engine's k, the
        engine's k. Requests with different values share a batch. With a tree shape, a
        request drafts the engine's whole tree or (0) nothing. Never changes the output.
    The logits processors (spec/processors.py has the formulas), applied to the target's logits at
    every position it samples from, with the tokens drafted before that position counted as
    generated, so that speculation never changes the output:
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: a token's logit less
        frequency_penalty x its count in the output so far and presence_penalty once if it is
        there at all.
    repetition_penalty: vLLM's and transformers' (> 0; 1 = none): a token of the prompt or the
        output has its logit divided by it where positive, multiplied where negative.
    logit_bias: {token id: bias in [-100, 100]} added to those tokens' logits (OpenAI's).
    min_tokens: no EOS, stop token or stop string before this many tokens are generated (vLLM's:
        a stop string counts where it ends in the text of the min_tokens-th token or a later one;
        at most max_tokens).
    allowed_token_ids: only these tokens may be generated (vLLM's; None: all).
    bad_words: words never generated (vLLM's): each word's tokens, with and without a space
        before it, are never completed in the output (needs the tokenizer).
    structured_outputs: what the output must follow (StructuredOutputsParams: a JSON schema, a
        regex, a choice, a grammar; needs the tokenizer).
    n: how many completions of the prompt to return (vLLM's parallel sampling: n sequences that
        share the prompt's cache blocks, each sampled on its own; with a seed, completion i draws
        from seed + i, as in vLLM). Greedy completions are all the same.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1

    def __post_init__(self) -> None:
        need = Refusal(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        need(
            isinstance(self.stop, (tuple, list)) or self.stop is None,
            "{stop} must be a string or a list of strings, got {got!r}",
            got=self.stop,
        )
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        stop_token_ids = self.stop_token_ids
        if is_int(stop_token_ids):
            object.__setattr__(self, "stop_token_ids", (stop_token_ids,))
        need(
            isinstance(self.stop_token_ids, (tuple, list, set, frozenset)) or self.stop_token_ids is None,
            "{stop_token_ids} must be a list of token ids, got {got!r}",
            got=self.stop_token_ids,
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        need(
            is_real(self.temperature) and self.temperature >= 0,
            "{temperature} must be a number >= 0 (0 = greedy), got {got!r}",
            got=self.temperature,
        )
        need(is_real(self.top_p) and 0 < self.top_p <= 1, "{top_p} must be in (0, 1], got {got!r}", got=self.top_p)
        need(
            is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX,
            "{top_k} must be an integer >= -1 (-1 or 0 = no limit), got {got!r}",
            got=self.top_k,
        )
        need(is_real(self.min_p) and 0 <= self.min_p <= 1, "{min_p} must be in [0, 1], got {got!r}", got=self.min_p)
        need(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            "{max_tokens} must be an integer >= 1, got {got!r}",
            got=self.max_tokens,
        )
        need(
            all(isinstance(s, str) and s for s in self.stop),
            "{stop} must be non-empty strings, got {got!r}",
            got=self.stop,
        )
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "{stop_token_ids} must be non-negative integers, got {got!r}",
            got=self.stop_token_ids,
        )
        need(
            self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= UINT64_MAX),
            "{seed} must be an integer from -2**63 to 2**64 - 1, or None, got {got!r}",
            got=self.seed,
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            need(isinstance(value, bool), f"{{{name}}} must be True or False, got {{got!r}}", got=value)
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "{logprobs} must be an integer from 0 to {most} (the most likely tokens to return with each token's "
            "own), or None, got {got!r}",
            most=MAX_LOGPROBS,
            got=self.logprobs,
        )
        need(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "{prompt_logprobs} must be an integer from 0 to {most} (the most likely tokens to return with each prompt "
            "token's own), or None, got {got!r}",
            most=MAX_LOGPROBS,
            got=self.prompt_logprobs,
        )
        need(
            self.num_speculative_tokens is None
            or (is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 0),
            "{num_speculative_tokens} must be an integer >= 0 (0 = no speculation), or None, got {got!r}",
            got=self.num_speculative_tokens,
        )
        need(
            is_int(self.n) and 1 <= self.n <= MAX_N,
            "{n} must be an integer from 1 to {most} (the completions to return), got {got!r}",
            most=MAX_N,
            got=self.n,
        )
        need(
            self.seed is None or not is_int(self.n) or self.seed + self.n - 1 <= UINT64_MAX,
            "{seed} + n - 1 must be at most 2**64 - 1 (completion i draws from seed + i), got {got!r}",
            got=self.seed,
        )
        self._check_processors(need)

    def _check_processors(self, need) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(
                is_real(value) and -2 <= value <= 2, f"{{{name}}} must be a number in [-2, 2], got {{got!r}}", got=value
            )
        need(
            is_real(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
            "{repetition_penalty} must be a number > 0 (1 = no penalty), got {got!r}",
            got=self.repetition_penalty,
        )
        bias = self.logit_bias
        need(
            bias is None
            or (
                isinstance(bias, Mapping)
                and all(is_int(t) and t >= 0 and is_real(b) and -100 <= b <= 100 for t, b in bias.items())
            ),
            "{logit_bias} must map token ids (integers >= 0) to biases in [-100, 100], got {got!r}",
            got=bias,
        )
        object.__setattr__(self, "logit_bias", dict(bias) if bias else None)
        need(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens if is_int(self.max_tokens) else 0),
            "{min_tokens} must be an integer from 0 to max_tokens, got {got!r}",
            got=self.min_tokens,
        )
        allowed = self.allowed_token_ids
        need(
            allowed is None
            or (
                isinstance(allowed, (tuple, list, set, frozenset))
                and len(allowed) > 0
                and all(is_int(t) and t >= 0 for t in allowed)
            ),
            "{allowed_token_ids} must be a non-empty list of token ids (integers >= 0), or None, got {got!r}",
            got=allowed,
        )
        object.__setattr__(self, "allowed_token_ids", None if allowed is None else tuple(sorted(set(allowed))))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        need(
            isinstance(self.bad_words, (tuple, list)) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "{bad_words} must be a list of words (non-empty strings), got {got!r}",
            got=self.bad_words,
        )
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "{structured_outputs} must be a StructuredOutputsParams, got {got!r}",
            got=self.structured_outputs,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def processed(self) -> bool:
        """Whether a logits processor changes the target's logits (spec/processors.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.structured_outputs is not None
        )


COMPILE_MODES = ("auto", "on", "off")  # how the models run: see runner.py
COMPILE_HELP = (
    "run the models compiled (torch.compile): on, off, or auto (the default: only for long work, "
    "where the compile time pays back)"
)

K_POLICIES = ("goodput", "fixed")  # how each round's k is chosen: see SpeculativeConfig
QUANTIZATIONS = ("int8", "int4")  # weight-only, see models/quantized_linear.py; None: as loaded
# "auto": a GGUF file's quantized matrices run as the file holds them (models/gguf_model.py),
# anything else as loaded; None dequantizes a GGUF file
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)


def check_quantization_name(quantization, what: str = "quantization") -> None:
    """None, "auto", "int8" or "int4", else a ValueError that names the valid choices."""
    check(
        quantization is None or quantization in QUANTIZATION_CHOICES,
        f"{what} must be one of None, {', '.join(repr(q) for q in QUANTIZATION_CHOICES)}; got {quantization!r}",
    )


def keeps_file_quantization(quantization: str | None) -> bool:
    """Whether a GGUF file's quantized matrices stay as they are (else they are dequantized)."""
    return quantization == "auto"


def requantization(quantization: str | None) -> str | None:
    """The weight-only quantization the runner applies to a float model: "int8", "int4" or None."""
    return quantization if quantization in QUANTIZATIONS else None


QUANTIZATION_HELP = (
    "weights: auto (the default: a GGUF file's quantized tensors run as they are, anything else "
    "as loaded), none (dequantize a GGUF file), or weight-only int8 (per output channel) / int4 "
    "(groups of 32) of the float weights; CPU only"
)

QUANTIZATION_ARGS = ("auto", "none", *QUANTIZATIONS)  # on the command line, "none" for None


def quantization_from_arg(text: str) -> str | None:
    return None if text == "none" else text


# the method lists the checks read, from the table of methods (methods.py)
SPECULATIVE_METHODS = tuple(METHODS)
TREE_METHODS = tuple(name for name, m in METHODS.items() if m.grows_trees)  # (Drafter.grows_trees)
NEEDS_DRAFT_MODEL = tuple(name for name, m in METHODS.items() if m.needs_model)  # "eagle": a head's
SUFFIX_METHODS = tuple(name for name, m in METHODS.items() if m.suffix)  # drafting (or maybe) by suffix decoding
NO_SPECULATION = "none"  # speculative_method="none" / --speculative-method none: plain decoding
# the methods that take the draft model's settings ("auto" may choose a draft model: drafters/auto.py)
DRAFT_MODEL_SETTINGS = tuple(name for name, m in METHODS.items() if m.draft_model_settings)
# the settings of a draft model, each with its value that sets nothing (SpeculativeConfig refuses others
# with a method that drafts by no model)
DRAFT_MODEL_NEUTRAL = {"draft_dtype": "auto", "draft_confidence_threshold": 0, "draft_quantization": "auto"}
DRAFT_MODEL_FIELDS = tuple(DRAFT_MODEL_NEUTRAL)
# the shortest n-gram match prompt lookup trusts, by method (as the first stage of staged drafts,
# a draft model checks its proposals, and a wrong one costs only a slightly wider draft forward)
DEFAULT_NGRAM_MIN = {name: m.ngram_min for name, m in METHODS.items()}
MAX_SUFFIX_TREE_DEPTH = 1024  # past this a match is longer than any draft a round could verify
MAX_SUFFIX_CACHED_REQUESTS = 2**31 - 1  # arctic-inference's bound (its sequence ids are int32)
NGRAM_STAGE = "[ngram]"  # prompt lookup as a stage of staged drafts (vLLM's spelling of prompt lookup as a model)


def as_stages(model):
    """speculative_model as given, a directory or a list of stages, as SpeculativeConfig's model
    takes it: a list of one stage is that stage; a longer list a tuple of stages (str; os.PathLike
    as its path); anything else as it is (SpeculativeConfig judges it)."""
    if not isinstance(model, (list, tuple)):
        return model
    stages = tuple(os.fspath(stage) if isinstance(stage, os.PathLike) else stage for stage in model)
    return stages[0] if len(stages) == 1 else stages


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

    method: "auto" (the default: the drafters chosen for the target, see drafters/auto.py:
        for a model the registry knows, the drafter it ships behind suffix decoding; for any
        other, suffix decoding alone), "draft_model" (a smaller model with the target's tokenizer), "ngram" (prompt
        lookup: copy what followed the last matching n-gram of the context), or
        "lookup_then_draft" (prompt lookup for the rows where it finds a match, the draft
        model for the others), or "eagle" (a one-layer head over the target's own features,
        trained by `specdec train-heads`; see drafters/eagle.py), or "early_exit" (self-
        speculation: the target's own first early_exit_layer layers, its final norm and output
        layer draft; see drafters/early_exit.py), or "staged" (staged drafts: a list of stages
        in model, each drafting for the next by speculative decoding, the last for the target;
        see spec/staged.py), or "suffix" (suffix decoding: what followed the context's longest
        match in the request's own text or in recent requests' outputs; see drafters/suffix.py),
        or "suffix_then_draft" (suffix decoding for the rows where it finds a match, the draft
        model or EAGLE head in model for the others; see drafters/suffix_then_draft.py).
    model: the draft model's directory, for "draft_model" and "lookup_then_draft" (which also
        takes a head's directory: the head drafts where lookup finds nothing); the
        head's directory for "eagle"; for "staged", the stages, first (cheapest) to last, at
        least two: the first a draft model's directory or "[ngram]" (NGRAM_STAGE: prompt
        lookup, with ngram_min / ngram_max), every later one a draft model's directory (a list
        is kept as a tuple). Every model stage shares the target's vocabulary and is no larger
        than the model it drafts for; draft_dtype and draft_quantization apply to each.
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
        quantization for the target; an EAGLE head's own layers as GGUF Q8_0 / Q4_0 blocks, and
        "auto" is "int8" for a GGUF target's head). "auto" for a draft model: a GGUF file's own
        blocks, except a file of more than 5.25 bits a weight drafting for a GGUF target,
        requantized into Q4_0 on the GGUF kernels (draft_model.gguf_requantization). Changes the
        acceptance rate, never the output.
    early_exit_layer: for "early_exit", how many of the target's layers draft (1 to its depth
        less one; None: drafters/early_exit.py's default, half its depth).
    k_policy: "goodput" (each round picks its k, 0 to num_speculative_tokens, for the most
        expected tokens per second, from each request's acceptance rate and the measured costs;
        see goodput.py; a tree is cut to the likeliest nodes its verify's cost buys:
        tree_width.py) or "fixed" (every round drafts num_speculative_tokens, or verifies the
        whole tree).
    tree: "chain" (k tokens, one after another), "auto" (EAGLE-2's dynamic tree) or branching
        factors per depth like "3,2,1": a tree of num_speculative_tokens candidate tokens,
        verified in one forward (tree.py), for a drafter that grows trees (TREE_METHODS).
        Under goodput a row's tree grows as deep as the policy's k for it and is cut to the
        nodes its verify's cost buys; under fixed, every round grows and verifies the whole tree.
    suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests,
    suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob: suffix decoding's, in vLLM's
        names: the longest match and draft its trees hold (24); how many recent requests' outputs
        the shared tree holds, the oldest dropped first (10,000; 0: each request drafts from its
        own text alone); the most tokens drafted per matched token (1.0); the least frequency
        a drafted token may have after its context (0.1). A suffix draft is a tree of at most
        num_speculative_tokens nodes.

    Each field's help, flag and LLM keyword are in its metadata (setting()): generate, serve and
    bench take every field as that flag, and a value refused here is said as the flag on the
    command line, as the keyword in Python (ConfigError).
    """

    method: str = setting(
        "auto",
        "the drafter: auto (the drafter the registry ships for the model, behind suffix decoding; any "
        "other model: suffix decoding), none (no speculation), draft_model, ngram (prompt lookup), "
        "lookup_then_draft (prompt lookup, the draft model or head where it finds nothing), eagle (an "
        "EAGLE head), early_exit (the target's first layers), staged (each --draft drafting for the "
        "next), suffix (suffix decoding: the request's own text and recent requests' outputs) or "
        "suffix_then_draft (suffix decoding, the draft model or head where it finds nothing)",
        "--speculative-method",
        "speculative_method",
        choices=(*SPECULATIVE_METHODS, NO_SPECULATION),
        shown="what --draft (draft_model, eagle for a head's directory, staged when given twice or more), "
        "--ngram, --lookup or --early-exit says; none of them: auto",
    )
    model: str | tuple[str, ...] | None = setting(
        None,
        "the draft model's directory (sharing the target's tokenizer), or an EAGLE head's (`specdec train-heads`); "
        "given more than once, staged drafts: each stage drafts for the next by speculative decoding, the last "
        "for the target, the first a draft model or '[ngram]' (prompt lookup), e.g. --draft '[ngram]' --draft DIR",
        "--draft",
        "speculative_model",
        metavar="DIR",
        shown="none",
        repeat=True,
    )
    num_speculative_tokens: int = setting(
        5,
        "k: draft tokens per round (the most, with --k-policy goodput; 0: plain decoding)",
        ("-k", "--num-speculative-tokens"),
        metavar="K",
        parse=int,
    )
    ngram_min: int | None = setting(
        None,
        "prompt lookup's shortest n-gram match",
        "--ngram-min",
        "ngram_prompt_lookup_min",
        metavar="N",
        parse=int,
        shown="1 for ngram, 2 for lookup_then_draft",
    )
    ngram_max: int = setting(
        4,
        "prompt lookup's longest n-gram match, tried first",
        "--ngram-max",
        "ngram_prompt_lookup_max",
        metavar="N",
        parse=int,
    )
    draft_dtype: str = setting(
        "auto",
        "the draft model's dtype: auto (float32 for a small draft on the CPU, else the target's), float32, "
        "bfloat16 or float16",
        "--draft-dtype",
        metavar="DTYPE",
    )
    draft_confidence_threshold: float = setting(
        0.0,
        "adaptive k: a row stops drafting for the round after a token the draft gave less than P (0: always draft k)",
        "--draft-confidence",
        old_flags=("--adaptive-confidence",),
        metavar="P",
        parse=float,
    )
    draft_quantization: str | None = setting(
        "auto",
        "the draft model's weights: auto (a GGUF file's quantized tensors as they are, anything else as "
        "loaded; a GGUF draft of more than 5.25 bits a weight for a GGUF target: requantized into Q4_0; "
        "an EAGLE head for a GGUF target: int8), none (dequantize a GGUF file), int8 or int4 "
        "(weight-only, CPU only; an EAGLE head's own layers as GGUF Q8_0 / Q4_0)",
        "--draft-quantization",
        parse=quantization_from_arg,
        choices=QUANTIZATION_ARGS,
    )
    k_policy: str = setting(
        "goodput",
        "goodput: each round picks k from 0 to K for the most expected tokens per second, switching "
        "speculation off where it does not pay (a tree: verifies the likeliest nodes its cost buys); "
        "fixed: always K (a tree: all of it)",
        "--k-policy",
        "speculative_k_policy",
        choices=K_POLICIES,
    )
    early_exit_layer: int | None = setting(
        None,
        "self-speculation: the target's first LAYER layers draft (early_exit)",
        "--early-exit",
        metavar="LAYER",
        parse=int,
        shown="half the target's depth",
        bare=True,
    )
    tree: str = setting(
        "chain",
        "draft a tree of K candidate tokens each round, verified in one forward: chain (one after "
        "another), auto (EAGLE-2's dynamic tree) or children per depth like 3,2,1 (for a draft model, an EAGLE "
        "head or early exit)",
        "--tree",
        "speculative_tree",
        metavar="SHAPE",
    )
    suffix_decoding_max_tree_depth: int = setting(
        24,
        "suffix decoding: the longest match and draft its trees hold, in tokens",
        "--suffix-decoding-max-tree-depth",
        metavar="N",
        parse=int,
    )
    suffix_decoding_max_cached_requests: int = setting(
        10_000,
        "suffix decoding: how many recent requests' outputs the shared tree holds, the oldest dropped first "
        "(0: each request drafts from its own text alone)",
        "--suffix-decoding-max-cached-requests",
        metavar="N",
        parse=int,
    )
    suffix_decoding_max_spec_factor: float = setting(
        1.0,
        "suffix decoding: the most tokens a round drafts per token of the context's match",
        "--suffix-decoding-max-spec-factor",
        metavar="F",
        parse=float,
    )
    suffix_decoding_min_token_prob: float = setting(
        0.1,
        "suffix decoding: the least frequency a drafted token may have after its context",
        "--suffix-decoding-min-token-prob",
        metavar="P",
        parse=float,
    )

    def __post_init__(self) -> None:
        need = Refusal(self)
        need(
            self.method in SPECULATIVE_METHODS,
            "{method} must be one of {methods}, got {got!r}",
            methods=SPECULATIVE_METHODS,
            got=self.method,
        )
        need(
            is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 0,
            "{num_speculative_tokens} must be an integer >= 0, got {got!r}",
            got=self.num_speculative_tokens,
        )
        if isinstance(self.model, (list, tuple)):  # stages, kept as a tuple of texts
            object.__setattr__(
                self, "model", tuple(os.fspath(s) if isinstance(s, os.PathLike) else s for s in self.model)
            )
        if isinstance(self.model, tuple) or self.method == "staged":
            self._check_stages(need)
        need(
            self.model is None
            or isinstance(self.model, tuple)
            or (isinstance(self.model, (str, os.PathLike)) and str(self.model).strip()),
            "{model} must be the path of a draft model directory, got {got!r}",
            got=self.model,
        )
        need(
            self.method != "auto" or self.model is None,
            "{method:=auto} chooses the drafter itself, and {model:=} names one: give the method for it too "
            "(or leave the method out), or drop {model}",
        )
        need(
            self.method not in NEEDS_DRAFT_MODEL or self.model is not None,
            "{method:=} needs {model:=<draft directory>}",
        )
        need(
            self.method in NEEDS_DRAFT_MODEL or self.model is None,
            "{method:=} uses no draft model, but {model:=} was given; drop it, or use {method:=lookup_then_draft} "
            "for prompt lookup with the draft behind it",
        )
        if self.ngram_min is None:
            default = DEFAULT_NGRAM_MIN[self.method]
            if default is not None:
                object.__setattr__(
                    self, "ngram_min", min(default, self.ngram_max) if is_int(self.ngram_max) else default
                )
        need(
            (self.ngram_min is None and is_int(self.ngram_max) and self.ngram_max >= 1)  # auto's, chosen later
            or (is_int(self.ngram_min) and is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max),
            "need 1 <= {ngram_min} <= {ngram_max}, got {low}, {high}",
            low=self.ngram_min,
            high=self.ngram_max,
        )
        need(
            is_real(self.draft_confidence_threshold) and 0 <= self.draft_confidence_threshold <= 1,
            "{draft_confidence_threshold} must be in [0, 1], got {got!r}",
            got=self.draft_confidence_threshold,
        )
        object.__setattr__(self, "draft_dtype", dtype_name(self.draft_dtype))
        need(
            self.draft_dtype in DRAFT_DTYPES,
            "{draft_dtype} must be one of {dtypes} (or a torch dtype), got {got!r}",
            dtypes=DRAFT_DTYPES,
            got=self.draft_dtype,
        )
        need(
            self.draft_quantization is None or self.draft_quantization in QUANTIZATION_CHOICES,
            "{draft_quantization} must be one of None, {choices}; got {got!r}",
            choices=", ".join(repr(q) for q in QUANTIZATION_CHOICES),
            got=self.draft_quantization,
        )
        need(
            self.k_policy in K_POLICIES,
            "{k_policy} must be one of {policies}, got {got!r}",
            policies=K_POLICIES,
            got=self.k_policy,
        )
        need(
            self.early_exit_layer is None or (is_int(self.early_exit_layer) and self.early_exit_layer >= 1),
            "{early_exit_layer} must be an integer >= 1, got {got!r}",
            got=self.early_exit_layer,
        )
        need(
            self.early_exit_layer is None or self.method == "early_exit",
            "{early_exit_layer} is for {method:=early_exit}, not {got!r}",
            got=self.method,
        )
        try:
            TreeShape.parse(self.tree)
        except ValueError as e:  # tree.py says what shapes it takes, naming speculative_tree
            raise ConfigError(self, "{tree}" + _escaped(str(e).removeprefix("speculative_tree")), {}) from None
        need(
            self.tree == "chain" or self.method not in SUFFIX_METHODS,
            "{method:=} drafts a tree wherever earlier text continued the match in several ways, shaped by "
            "that text, not by {tree}: drop it",
        )
        need(
            self.tree == "chain" or self.method in TREE_METHODS,
            "{tree:=} needs a drafter that grows trees ({methods}); {method:=} drafts chains: drop {tree}",
            methods=", ".join(TREE_METHODS),
        )
        unused = [
            name
            for name, neutral in DRAFT_MODEL_NEUTRAL.items()
            if getattr(self, name) != neutral
            and not (name == "draft_confidence_threshold" and self.method == "early_exit")
        ]  # it drafts by model
        need(
            self.method in DRAFT_MODEL_SETTINGS or not unused,
            ", ".join(f"{{{name}:=}}" for name in unused) + " configure a draft model, and {method:=} uses none; "
            "drop them, or use {method:=lookup_then_draft} for prompt lookup with a draft model behind it",
        )
        self._check_suffix(need)

    def _check_suffix(self, need: Refusal) -> None:
        """Suffix decoding's four fields: in range, and set only for the methods that use them
        (SUFFIX_METHODS)."""
        need(
            is_int(self.suffix_decoding_max_tree_depth)
            and 1 <= self.suffix_decoding_max_tree_depth <= MAX_SUFFIX_TREE_DEPTH,
            "{suffix_decoding_max_tree_depth} must be an integer from 1 to {most}, got {got!r}",
            most=MAX_SUFFIX_TREE_DEPTH,
            got=self.suffix_decoding_max_tree_depth,
        )
        need(
            is_int(self.suffix_decoding_max_cached_requests)
            and 0 <= self.suffix_decoding_max_cached_requests <= MAX_SUFFIX_CACHED_REQUESTS,
            "{suffix_decoding_max_cached_requests} must be an integer from 0 (no shared tree) to {most}, got {got!r}",
            most=MAX_SUFFIX_CACHED_REQUESTS,
            got=self.suffix_decoding_max_cached_requests,
        )
        need(
            is_real(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
            "{suffix_decoding_max_spec_factor} must be a number > 0, got {got!r}",
            got=self.suffix_decoding_max_spec_factor,
        )
        need(
            is_real(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1,
            "{suffix_decoding_min_token_prob} must be in [0, 1], got {got!r}",
            got=self.suffix_decoding_min_token_prob,
        )
        changed = [
            f.name for f in fields(self) if f.name.startswith("suffix_decoding_") and getattr(self, f.name) != f.default
        ]
        need(
            self.method in SUFFIX_METHODS or not changed,
            ", ".join(f"{{{name}:=}}" for name in changed) + " configure suffix decoding, which {method:=} does not "
            "use: drop them, or use {method:=suffix}",
        )

    def _check_stages(self, need: Refusal) -> None:
        """Staged drafts: method "staged" with a tuple of at least two stages in model, prompt
        lookup first if anywhere, every stage a non-empty text; no adaptive k (each stage's k is
        the round's: goodput or fixed)."""
        stages = self.model
        example = f"['{NGRAM_STAGE}', '<draft directory>']"
        need(
            self.method == "staged",
            "{model:=} lists stages, which {method:=} does not take: give {method:=staged} (each stage drafts "
            "for the next, the last for the target), or one directory",
        )
        need(
            isinstance(stages, tuple),
            "{method:=} needs a list of stages in {model}, got {got!r}: give at least two, e.g. {example} "
            "(prompt lookup drafting for a draft model), or {method:=draft_model} for one draft model",
            got=stages,
            example=example,
        )
        assert isinstance(stages, tuple)
        need(
            len(stages) >= 2,
            "{model:=} holds {count} stage{s}; staged drafts need at least two, e.g. {example}; give one draft "
            "model as {method:=draft_model}, or '{ngram}' alone as {method:=ngram}",
            count=len(stages),
            s="" if len(stages) == 1 else "s",
            example=example,
            ngram=NGRAM_STAGE,
        )
        bad = [stage for stage in stages if not (isinstance(stage, str) and stage.strip())]
        need(
            not bad,
            "{model}: every stage is a draft model's directory or '{ngram}' (prompt lookup), got {bad}",
            ngram=NGRAM_STAGE,
            bad=", ".join(map(repr, bad)),
        )
        later = [number for number, stage in enumerate(stages, start=1) if stage == NGRAM_STAGE and number > 1]
        need(
            not later,
            "{model:=}: '{ngram}' (prompt lookup) can only be the first stage, not stage {number}: every later "
            "stage checks the tokens of the one before it against its own distribution, which takes a model",
            ngram=NGRAM_STAGE,
            number=later[0] if later else 0,
        )
        need(
            self.draft_confidence_threshold == 0,
            "{draft_confidence_threshold:=} stops a draft model's steps early; {method:=staged} draws each stage's "
            "tokens by speculative decoding with the round's k (by goodput, or fixed): drop it",
        )


def _escaped(text: str) -> str:
    """text as a literal part of a ConfigError's template."""
    return text.replace("{", "{{").replace("}", "}}")


# Validation of configuration values, shared by every frozen configuration dataclass.


def is_real(x) -> TypeGuard[float]:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> TypeGuard[int]:
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
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    check(
        parsed.type != "cuda" or torch.cuda.is_available(),
        f"device {str(device)!r}: CUDA is not available on this machine (no GPU, or a CPU build of PyTorch); use cpu",
    )
    check(
        parsed.type != "cuda" or (parsed.index or 0) < torch.cuda.device_count(),
        f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA devices",
    )
    return parsed


def check(ok: object, message: str) -> None:
    """Raise ValueError(message) unless ok."""
    if not ok:
        raise ValueError(message)
