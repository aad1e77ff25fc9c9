"""LLM: the user-facing entry point, in the names vLLM users know. For example:

    llm = LLM(model="target_dir", speculative_model="draft_dir", num_speculative_tokens=5)
    outputs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    print(outputs[0].outputs[0].text, outputs[0].metrics.acceptance_rate)

(see README.md for more).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from typing import Any, cast

import torch

from specdec.config import (
    INT64_MIN,
    NGRAM_STAGE,
    NO_SPECULATION,
    UINT64_MAX,
    ConfigError,
    SamplingParams,
    SpeculativeConfig,
    as_stages,
    check,
    check_device,
    is_int,
    keeps_file_quantization,
    keyword,
    requantization,
)
from specdec.drafters import DRAFTERS, Drafter, auto, factories
from specdec.engine import Engine
from specdec.engine.parallel_sampling import fork
from specdec.engine.swap import DEFAULT_SWAP_SPACE_GIB
from specdec.metrics import SpecStats
from specdec.models.eagle import is_head_directory
from specdec.models.loader import LoadedModel, load_pretrained
from specdec.models.quantized_linear import check_quantization
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.platform import Platform, detect_platform
from specdec.progress import stage
from specdec.prompts import PromptEncoder
from specdec.sampling import request_generator
from specdec.sequence import Sequence
from specdec.tree import TreeShape
from specdec.worker import ModelRunner, check_compile_mode

log = logging.getLogger("specdec")


class LLM:
    """A target model, optionally with a drafter, ready to generate.

    model: the target's Hugging Face directory.
    speculative_model: the draft's directory (methods "draft_model", "lookup_then_draft"; for
        the latter also a head's), or
        "[ngram]" for prompt lookup; None = the drafter speculative_method names, by default
        "auto"'s choice.
        A list of stages, first (cheapest) to last, is staged drafts (method "staged"): each
        stage drafts for the next by speculative decoding, the last for the target, e.g.
        ["[ngram]", "qwen2.5-coder-0.5b-instruct"] (prompt lookup drafting for the 0.5B model)
        or [smaller draft, larger draft]; "[ngram]" may only be first (spec/staged.py).
    num_speculative_tokens: k, draft tokens per round (None: 5). Below the target's context
        length; each round drafts no more than a request can still emit.
    speculative_method: None (the default): inferred from speculative_model, or "auto" without
        one: the drafter the registry ships for the target behind suffix decoding, for any other
        target suffix decoding alone (drafters/auto.py; the choice and why: draft_choice, and the
        log). "none": no speculation, plain decoding. Or "draft_model", "ngram",
        "lookup_then_draft" (prompt lookup where it finds a match, the draft model or head
        elsewhere) or "eagle" (speculative_model: a head's directory, from `specdec train-heads`)
        or "early_exit" (the target's own first early_exit_layer layers draft; default half its
        depth) or "staged" (a list of stages in speculative_model), "suffix" or
        "suffix_then_draft" (see SpeculativeConfig).
    ngram_prompt_lookup_min / _max: the n-gram lengths prompt lookup tries (min None: 1 for
        "ngram", 2 for "lookup_then_draft"; see SpeculativeConfig).
    dtype: "auto" (the checkpoint's, or float32 where the device emulates the checkpoint's half
        precision; see platform.auto_dtype), "float32", "bfloat16" or "float16".
    draft_dtype: the draft model's dtype; "auto" = float32 for a small draft on the CPU, else
        the target's (see SpeculativeConfig).
    speculative_k_policy: "goodput" (the default: each round picks its k, from 0, plain
        decoding, to num_speculative_tokens, for the most expected tokens per second; a useless
        draft switches itself off) or "fixed" (every round drafts num_speculative_tokens).
    speculative_tree: "chain" (None: the default), "auto" (EAGLE-2's dynamic tree) or branching
        factors per depth like "3,2,1": every round drafts a tree of num_speculative_tokens
        candidates and the target verifies it in one forward (tree.py); draft models, EAGLE
        heads and early exit grow trees.
    draft_confidence_threshold: adaptive k: a row stops drafting for the round after a token
        the draft gave less than this probability (0 = always k; see SpeculativeConfig).
    device: "cpu", "cuda", "cuda:1", ...
    max_num_seqs: the most sequences run at once; more wait for a free slot.
    enable_prefix_caching: a request whose prompt starts with whole 16-token blocks an earlier
        request computed (a system prompt, earlier turns) takes their cache entries and skips
        their prefill (block_manager.py). On by default, as in vLLM; the output is the
        same either way.
    swap_space: GiB of memory where the cache entries of requests preempted for lack of cache
        blocks wait (engine/swap.py; vLLM's name and default, 4): a preempted request resumes
        exactly where it was, so preemption changes no output. 0: preempted requests are
        prefilled anew instead.
    quantization: "auto" (the default: a GGUF file's quantized tensors run as the file holds
        them, through specdec's own kernel: models/gguf_model.py; any other model as loaded),
        None (a GGUF file dequantized), "int8" or "int4": the target's linear layers with
        weight-only quantized weights (int8 per output channel, int4 in groups of 32; CPU only,
        see models/quantized_linear.py). Speculation stays exact with respect to the model as
        it runs.
    draft_quantization: the same for the draft model.
    compile: "auto", "on" or "off": whether the target and draft models run compiled
        (torch.compile; see runner.py: "auto" compiles for long work only).
    platform: what the device can do (platform.Platform); None detects it. Tests pass their own.
    seed: seeds the random stream that requests without a seed of their own share.

    speculative_config: all of speculation in one, as vLLM takes it: a SpeculativeConfig, or a
        dict of its fields ({"model": DIR, "num_speculative_tokens": 5}, {"method": "ngram",
        "prompt_lookup_max": 4}; vLLM's prompt_lookup_min / _max name ngram_min / ngram_max).
        The speculative_* keywords above are the same settings spelled flat; give one or the
        other.

    Options of speculation given with speculative_method="none" are refused, not ignored; so are
    draft-model options given with prompt lookup alone. Given with "auto", they apply where the
    chosen drafter uses them.
    """

    def __init__(
        self,
        model: str,
        speculative_model: str | list[str] | tuple[str, ...] | None = None,
        num_speculative_tokens: int | None = None,
        speculative_method: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_num_seqs: int = 256,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        ngram_prompt_lookup_min: int | None = None,
        ngram_prompt_lookup_max: int | None = None,
        draft_dtype: str = "auto",
        draft_confidence_threshold: float | None = None,
        compile: str = "auto",
        platform: Platform | None = None,
        quantization: str | None = "auto",
        draft_quantization: str | None = "auto",
        speculative_k_policy: str | None = None,
        early_exit_layer: int | None = None,
        speculative_tree: str | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        enable_prefix_caching: bool = True,
        swap_space: float = DEFAULT_SWAP_SPACE_GIB,
    ):
        check(
            isinstance(enable_prefix_caching, bool),
            f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}",
        )
        check_arguments(seed=seed, max_num_seqs=max_num_seqs, skip_tokenizer_init=skip_tokenizer_init)
        self.swap_space_bytes = swap_space_bytes(swap_space)
        check_compile_mode(compile)
        flat = dict(
            model=speculative_model,
            method=speculative_method,
            num_speculative_tokens=num_speculative_tokens,
            ngram_min=ngram_prompt_lookup_min,
            ngram_max=ngram_prompt_lookup_max,
            draft_dtype=draft_dtype,
            draft_confidence_threshold=draft_confidence_threshold,
            draft_quantization=draft_quantization,
            k_policy=speculative_k_policy,
            early_exit_layer=early_exit_layer,
            tree=speculative_tree,
        )
        check(
            speculative_config is None or not _given(flat),
            f"speculative_config and {', '.join(FLAT_NAMES[name] for name in _given(flat))} both say how to "
            "speculate: give one or the other",
        )
        self.speculative_config = speculative_config_from(flat if speculative_config is None else speculative_config)
        self.device = check_device(device)
        check_quantization(quantization, self.device)
        if self.speculative_config is not None:
            check_quantization(self.speculative_config.draft_quantization, self.device, "draft_quantization")
        platform = platform or detect_platform(self.device)
        with stage(f"loading the target {model}"):
            self.target: LoadedModel = load_pretrained(
                model,
                dtype,
                self.device,
                load_tokenizer=not skip_tokenizer_init,
                platform=platform,
                what="the target",
                keep_quantized=keeps_file_quantization(quantization),
            )
            self.runner = ModelRunner(
                self.target.model, platform, compile, name="the target", quantization=requantization(quantization)
            )
        self.tokenizer = self.target.tokenizer
        self.prompts = PromptEncoder(self.tokenizer, self.target.model.config.vocab_size, self.max_model_len)
        drafter = None
        self.draft_choice: auto.DraftChoice | None = None  # what speculative_method="auto" chose, and why
        if self.speculative_config is not None:
            check_k_fits(self.speculative_config, self.max_model_len)
            drafter = self._load_drafter(self.speculative_config)
        spec = self.speculative_config
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self._shared_generator = torch.Generator(self.device).manual_seed(seed)  # for requests without a seed
        self._next_request_id = 0
        self.engine = self._engine(
            drafter,
            spec.num_speculative_tokens if spec else 0,
            spec.k_policy if spec else "fixed",
            TreeShape.parse(spec.tree) if spec else None,
        )

    def _load_drafter(self, config: SpeculativeConfig) -> Drafter:
        """config's drafter; for "auto", the chosen one (speculative_config becomes its config,
        draft_choice says what and why)."""
        if config.method != "auto":
            with stage(f"loading the drafter ({config.method})"):
                return ALL_DRAFTERS[config.method](config, self.target, self.runner)
        with stage("loading the drafter (auto)"):
            self.draft_choice, drafter = auto.build(config, self.target, self.runner, ALL_DRAFTERS)
        self.speculative_config = self.draft_choice.config
        log.info("speculation: %s; %s", self.draft_choice.drafters, self.draft_choice.reason)
        return drafter

    def target_only(self) -> LLM:
        """An LLM over the same loaded target with no drafter: the baseline to compare with."""
        return self.with_drafter(None)

    def with_drafter(self, drafter: Drafter | None, k: int = 0, k_policy: str = "goodput", tree: str = "chain") -> LLM:
        """An LLM over the same loaded target (nothing is reloaded) that speculates with drafter
        at k (at most, by goodput, the default as for LLM; or every round: k_policy="fixed"; a
        tree of k nodes for a tree shape other than "chain"), or decodes plainly (None). Its
        speculative_config is None: that field says how an LLM was made from arguments."""
        other = copy.copy(self)
        other.speculative_config = other.draft_choice = None
        other.engine = self._engine(drafter, k, k_policy, TreeShape.parse(tree))
        return other

    def _engine(self, drafter: Drafter | None, k: int, k_policy: str, tree: TreeShape | None = None) -> Engine:
        return Engine(
            self.runner,
            drafter,
            k,
            self.target.eos_token_ids,
            self.tokenizer,
            self.max_num_seqs,
            k_policy,
            tree,
            generator=self._shared_generator,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space_bytes=self.swap_space_bytes,
        )

    @property
    def max_model_len(self) -> int:
        return self.target.model.config.max_position_embeddings

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (text, token ids, or
        {"prompt_token_ids": [...]}); returns one RequestOutput per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        requests = [self._new_sequences(prompt, params) for prompt, params in zip(prompt_list, params_list)]
        with torch.inference_mode():
            self.engine.prepare([seq for seqs in requests for seq in seqs])
            for seqs in requests:
                self.engine.add_sequences(seqs)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        return [self._output(seqs) for seqs in requests]

    def warm_up(self, prompt, params: SamplingParams) -> None:
        """Pay the first calls' one-off costs (compiling, allocating, packing weights, the first
        call of each forward shape, goodput's cost calibration) before a request like this one is
        timed: size (and compile) for it, run every forward shape its rounds can take
        (Capacity.warm_up), then generate enough tokens for a round at the full k."""
        with torch.inference_mode(), stage("warming up"):
            self.engine.prepare(self._new_sequences(prompt, params))
            self.engine.capacity.warm_up(self.engine.scheduler.num_slots)
        self.generate(prompt, dataclasses.replace(params, max_tokens=min(self.engine.k + 2, params.max_tokens)))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to a list of them,
        each rendered with the model's chat template (tools: OpenAI's tool entries, for the
        template to render); one RequestOutput per conversation, as vLLM's LLM.chat returns."""
        conversations = cast("list[list[dict]]", messages if _is_conversation_list(messages) else [messages])
        prompts = [{"prompt_token_ids": self.chat_token_ids(c, add_generation_prompt, tools)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def chat_token_ids(self, messages: list[dict], *rendering, **options) -> list[int]:
        """One conversation rendered with the model's chat template, as token ids
        (prompts.PromptEncoder.chat_token_ids's arguments)."""
        return self.prompts.chat_token_ids(messages, *rendering, **options)

    def fill_in_the_middle_ids(self, prefix: str, suffix: str) -> list[int]:
        """The prompt of a gap between prefix and suffix for a code model to fill (prompts.py)."""
        return self.prompts.fill_in_the_middle_ids(prefix, suffix)

    def fill_in_the_middle_stops(self) -> tuple[int, ...]:
        """The tokens that end a middle (prompts.py): give them as stop_token_ids."""
        return self.prompts.fill_in_the_middle_stops()

    def prompt_token_ids(self, prompt, params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        """The prompt (text or token ids) as token ids, checked as generate checks a request
        with these params: a ValueError names what is wrong before any work is done
        (add_special_tokens: prompts.py's)."""
        return self.prompts.prompt_token_ids(prompt, params, add_special_tokens)

    def _new_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """The sequences that run one prompt: one, or params.n (engine/parallel_sampling.py)."""
        prompt_ids = self.prompt_token_ids(prompt, params)
        prompt_text = prompt if isinstance(prompt, str) else None
        request_id = str(self._next_request_id)
        self._next_request_id += 1
        return fork(
            request_id,
            prompt_ids,
            params,
            lambda seed: request_generator(seed, self._shared_generator, self.device),
            prompt=prompt_text,
        )

    def _output(self, seqs: list[Sequence]) -> RequestOutput:
        """One prompt's whole output: a CompletionOutput per sequence (n of them), metrics merged."""
        completions = [
            CompletionOutput(
                seq.index,
                seq.text,
                list(seq.output_token_ids),
                seq.finish_reason,
                list(seq.output_from_draft),
                list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            )
            for seq in seqs
        ]
        first = seqs[0]
        stats = first.stats if len(seqs) == 1 else SpecStats.merge([seq.stats for seq in seqs])
        prompt_logprobs = list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None
        return RequestOutput(
            first.output_request_id,
            first.prompt,
            first.prompt_token_ids,
            completions,
            stats,
            prompt_logprobs=prompt_logprobs,
        )


# Every method's drafter: drafters/'s, and staged drafts, whose stages verify one another with
# the rejection sampler (spec/), a layer above drafters/
ALL_DRAFTERS = {**DRAFTERS, **factories("specdec.spec")}

# LLM's flat keyword for each SpeculativeConfig field
FLAT_NAMES = {
    f.name: keyword(SpeculativeConfig, f.name) for f in dataclasses.fields(SpeculativeConfig)
}  # field -> LLM's
VLLM_NAMES = {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}  # vLLM's keys -> ours


def _given(options: dict) -> list[str]:
    """The options set to something other than "not given": None, but "auto" for the draft's dtype and
    quantization (whose None means: dequantize a GGUF draft)."""
    not_given = {"draft_dtype": "auto", "draft_quantization": "auto"}
    return [name for name, value in options.items() if value != not_given.get(name)]


def speculative_config_from(config: SpeculativeConfig | dict) -> SpeculativeConfig | None:
    """LLM's speculative_config= as a SpeculativeConfig (a dict: its fields, or vLLM's names for
    them; the method inferred from the model as for the flat keywords)."""
    if isinstance(config, SpeculativeConfig):
        return config
    check(
        isinstance(config, dict),
        f"speculative_config must be a SpeculativeConfig or a dict of its fields, got {type(config).__name__}",
    )
    fields = cast("dict[str, Any]", {VLLM_NAMES.get(key, key): value for key, value in config.items()})
    unknown = sorted(key for key in config if VLLM_NAMES.get(key, key) not in FLAT_NAMES)
    check(
        not unknown,
        f"speculative_config has no {', '.join(map(repr, unknown))}; its keys are "
        f"{', '.join(sorted(FLAT_NAMES))} (and vLLM's {', '.join(VLLM_NAMES)})",
    )
    return speculative_config(fields.pop("model", None), fields.pop("method", None), **fields)


def speculative_config(model, method, **options) -> SpeculativeConfig | None:
    """LLM's speculation arguments as a SpeculativeConfig (None: no drafter). options:
    SpeculativeConfig's fields; None (or "auto" for draft_dtype and draft_quantization) = not
    given, its default."""
    model = as_stages(model)  # a list of stages (a tuple), or of one stage (that stage)
    if model == NGRAM_STAGE:  # vLLM's older spelling of speculative_method="ngram"
        check(
            method in (None, "ngram"),
            f'speculative_model="[ngram]" means speculative_method="ngram", but '
            f"speculative_method={method!r} was given; give one or the other",
        )
        model, method = None, "ngram"
    if method is None and model is not None:  # stages, or a directory: a head's says what it is
        method = "staged" if isinstance(model, tuple) else "eagle" if is_head_directory(model) else "draft_model"
    given = {name: options[name] for name in _given(options)}
    if method == NO_SPECULATION:
        refused = ({} if model is None else {"speculative_model": model}) | given
        check(
            not refused,
            f"{', '.join(f'{n}={v!r}' for n, v in refused.items())} with speculative_method={NO_SPECULATION!r}, "
            "which turns speculation off: drop them, or the method",
        )
        return None
    if method is None:
        method = "auto"
    return SpeculativeConfig(method=method, model=model, **given)


def check_arguments(seed, max_num_seqs, skip_tokenizer_init) -> None:
    """LLM's plain arguments, checked before any model is loaded."""
    check(is_int(seed) and INT64_MIN <= seed <= UINT64_MAX, f"seed must be an integer, got {seed!r}")
    check(is_int(max_num_seqs) and max_num_seqs >= 1, f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    check(
        isinstance(skip_tokenizer_init, bool), f"skip_tokenizer_init must be True or False, got {skip_tokenizer_init!r}"
    )


def swap_space_bytes(swap_space) -> int:
    """swap_space (GiB, a number >= 0) in bytes, checked against the machine's memory."""
    check(
        isinstance(swap_space, (int, float)) and not isinstance(swap_space, bool) and 0 <= swap_space < math.inf,
        f"swap_space must be a number of GiB >= 0 (0: no swapping), got {swap_space!r}",
    )
    total = total_memory_bytes()
    check(
        total is None or swap_space * 2**30 <= total,
        f"swap_space={swap_space} GiB is more than this machine's memory "
        f"({(total or 0) / 2**30:.1f} GiB); give less (the default is {DEFAULT_SWAP_SPACE_GIB:g})",
    )
    return int(swap_space * 2**30)


def total_memory_bytes() -> int | None:
    """This machine's memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_k_fits(config: SpeculativeConfig, context_length: int) -> None:
    """k (num_speculative_tokens) is at most the context length - 1: a round verifies the last
    token and its k drafts in one forward, which the context must hold. (Each round also drafts
    no more than a request can still emit, so a large k costs nothing it cannot use.)"""
    if (
        config.num_speculative_tokens >= context_length
    ):  # said in the words of the interface the k came from (a flag: -k)
        raise ConfigError(
            config,
            "{num_speculative_tokens:=} is more than the model's context length ({length} tokens) "
            "can verify in one round; give at most {most} (useful values are 1 to about 10)",
            {"length": context_length, "most": context_length - 1},
        )


def _is_conversation_list(messages) -> bool:
    return isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], (list, tuple))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):  # one prompt of token ids
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    out = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            check(
                not {"prompt", "prompt_token_ids"} <= prompt.keys(),
                "a dict prompt takes 'prompt' (text) or 'prompt_token_ids', not both",
            )
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                check(
                    isinstance(prompt, (list, tuple)),
                    f"'prompt_token_ids' must be a list of token ids, got {_short(prompt)}",
                )
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                check(isinstance(prompt, str), f"'prompt' must be text, got {_short(prompt)}")
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")
        out.append(prompt)
    return out


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    check(
        isinstance(params, (list, tuple)),
        f"sampling_params must be a SamplingParams or a list of them, got {_short(params)}",
    )
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"give one SamplingParams, or a list of {n} (one per prompt)")
    return params
