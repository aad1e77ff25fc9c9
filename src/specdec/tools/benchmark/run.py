"""The benchmark's measurement: every method on every prompt, interleaved, on one machine.

For each prompt set and each sampling setting, prompt by prompt, every method decodes the
same prompt tokens back to back (in an order rotated from prompt to prompt), so machine
drift hits all methods alike. The methods:
  specdec    the target alone; the draft model at each k; prompt lookup at each k; and, at the
             comparison k (transformers_k), an EAGLE head (chain and trees), the draft model's
             trees and early exit, where configured
  transformers (optional, imported lazily)  generate: plain, assisted by the draft model
             (assistant_model=draft), prompt lookup (prompt_lookup_num_tokens), at one k
Then the totals per configuration: tokens/s, speedup over the specdec target alone, α, τ,
acceptance by position, the cost ratio c and the speedup the formula predicts from α, k and c,
the fraction of the memory-bandwidth roofline reached, and a profile of where the time went;
and the greedy exactness check.

run_benchmark(BenchConfig) -> results, a JSON-ready dict (report.py renders it).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.config import (
    SamplingParams,
    SpeculativeConfig,
    check,
    check_device,
    check_quantization_name,
    is_int,
    is_real,
)
from specdec.drafters import DRAFTERS, LookupThenDraftDrafter
from specdec.llm import LLM
from specdec.metrics import SpecStats, expected_tokens_per_round, predicted_speedup
from specdec.models.eagle import is_head_directory
from specdec.models.loader import is_gguf_file
from specdec.tools.benchmark.exactness import compare
from specdec.tools.benchmark.goals import evaluate_goals
from specdec.tools.benchmark.machine import decode_weight_bytes, describe_machine, read_bandwidth, step_seconds
from specdec.tools.benchmark.prompts import (
    Prompt,
    batch_job_prompts,
    held_out_chat_prompts,
    held_out_code_prompts,
    held_out_edit_prompts,
    repeated_code_prompts,
)
from specdec.tools.benchmark.quality import quantization_quality
from specdec.tree import TreeShape
from specdec.worker import check_compile_mode

PROMPT_SETS = {  # name -> (title, prompt-set function(per_module, max_chars))
    "code": ("held-out code completion", held_out_code_prompts),
    "repeat": ("repeating code already in the prompt", repeated_code_prompts),
    "chat": ("held-out chat prompts (write, edit or explain a function)", held_out_chat_prompts),
    "edit": ('held-out "edit this function" chat prompts', held_out_edit_prompts),
    "batch": ("a batch job: one instruction over many held-out functions, one after another", batch_job_prompts),
}


@dataclass(frozen=True)
class SamplingSetting:
    name: str
    temperature: float
    top_p: float = 1.0

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens, seed=seed)


GREEDY = SamplingSetting("greedy", 0.0)
SAMPLED = SamplingSetting("sampled", 0.8, 0.95)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    model / draft: Hugging Face directories (draft None: no draft-model rows).
    dtype / draft_dtype / compile / quantization / draft_quantization: as LLM's. With a
        quantized target the bench also measures what quantization costs (quality.py).
    adaptive_confidence: > 0 adds a row for the draft model with adaptive k (up to the
        largest of ks; LLM's draft_confidence_threshold).
    ks: the k of each speculative row (draft model and prompt lookup).
    transformers_k: the k of transformers' assisted generation and prompt lookup
        (None: 5 if in ks, else the largest of ks).
    prompts_per_set: prompts taken from each prompt set (spread evenly over it).
    max_prompt_chars: the longest prompt text; prompts too long for the context are cut
        from the left, keeping their first token.
    bandwidth_bytes: the buffer that measures streaming read bandwidth (larger than the
        last-level cache).
    head: an EAGLE head's directory for the target (speculative_method="eagle"): a row at
        the comparison k (transformers_k), and one per tree shape.
    early_exit_layer: a row for early exit from this layer at the comparison k (None: none).
    trees: tree shapes (speculative_tree, e.g. "auto"): a row for the draft model and one for
        the head growing each, trees of transformers_k nodes.
    """

    model: str
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    draft_dtype: str = "auto"
    compile: str = "auto"
    quantization: str | None = None
    draft_quantization: str | None = None
    adaptive_confidence: float = 0.0
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    transformers_k: int | None = None
    max_tokens: int = 128
    prompts_per_set: int = 8
    max_prompt_chars: int = 1200
    prompt_sets: tuple[str, ...] = ("code", "repeat")
    samplings: tuple[SamplingSetting, ...] = (GREEDY, SAMPLED)
    with_transformers: bool = True
    seed: int = 0
    bandwidth_bytes: int = 1 << 30
    step_repeats: int = 50
    head: str | None = None
    early_exit_layer: int | None = None
    trees: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ks", tuple(self.ks))
        object.__setattr__(self, "trees", tuple(self.trees))
        for shape in self.trees:
            check(shape != "chain", "trees lists tree shapes ('auto', '3,2,1'); the chain rows are always there")
            TreeShape.parse(shape)
        if self.head is not None:
            check(
                is_head_directory(self.head),
                f"head {str(self.head)!r} is not an EAGLE head directory (with head.json, from `specdec train-heads`)",
            )
        check(
            self.early_exit_layer is None or (is_int(self.early_exit_layer) and self.early_exit_layer >= 1),
            f"early_exit_layer must be an integer >= 1, got {self.early_exit_layer!r}",
        )
        object.__setattr__(self, "prompt_sets", tuple(self.prompt_sets))
        object.__setattr__(self, "samplings", tuple(self.samplings))
        _check_model_dir(self.model, "target model")
        if self.draft is not None:
            _check_model_dir(self.draft, "draft model")
        check(
            self.ks and all(is_int(k) and k >= 1 for k in self.ks) and len(set(self.ks)) == len(self.ks),
            f"ks must be distinct integers >= 1, got {self.ks!r}",
        )
        object.__setattr__(self, "ks", tuple(sorted(self.ks)))
        if self.transformers_k is None:
            object.__setattr__(self, "transformers_k", 5 if 5 in self.ks else max(self.ks))
        check(
            is_int(self.transformers_k) and self.transformers_k >= 1,
            f"transformers_k must be an integer >= 1, got {self.transformers_k!r}",
        )
        check(
            is_real(self.adaptive_confidence) and 0 <= self.adaptive_confidence < 1,
            f"adaptive_confidence must be in [0, 1), got {self.adaptive_confidence!r}",
        )
        check(is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}")
        check(
            is_int(self.prompts_per_set) and self.prompts_per_set >= 1,
            f"prompts per set must be >= 1, got {self.prompts_per_set!r}",
        )
        check(
            is_int(self.max_prompt_chars) and self.max_prompt_chars >= 16,
            f"max_prompt_chars must be >= 16, got {self.max_prompt_chars!r}",
        )
        check(
            self.prompt_sets and set(self.prompt_sets) <= set(PROMPT_SETS),
            f"prompt sets must be among {sorted(PROMPT_SETS)}, got {self.prompt_sets!r}",
        )
        check(
            self.samplings and len({s.name for s in self.samplings}) == len(self.samplings),
            "samplings must be non-empty with distinct names",
        )
        check(
            is_int(self.step_repeats) and self.step_repeats >= 1,
            f"step_repeats must be an integer >= 1, got {self.step_repeats!r}",
        )
        check(
            is_int(self.bandwidth_bytes) and self.bandwidth_bytes >= 1 << 20,
            f"bandwidth_bytes must be an integer >= 1 MiB, got {self.bandwidth_bytes!r}",
        )
        check_device(self.device)
        check_compile_mode(self.compile)
        check_quantization_name(self.quantization)
        check_quantization_name(self.draft_quantization, "draft_quantization")
        check(self.draft is not None or self.draft_quantization is None, "draft_quantization needs a draft model")

    @property
    def max_k(self) -> int:
        assert self.transformers_k is not None  # __post_init__ resolves None
        return max(max(self.ks), self.transformers_k)


@dataclass(frozen=True)
class Method:
    engine: str  # "specdec" or "transformers"
    drafter: str  # "none", "draft_model", "draft_model_adaptive" (k at most k), "draft_model_goodput" (k at most
    # k, by goodput), "ngram", "lookup_then_draft", "eagle", "early_exit", or "draft_model_tree" / "eagle_tree"
    k: int = 0
    tree: str = "chain"  # the tree shape of the *_tree drafters
    layer: int | None = None  # early exit's depth (None: its default)

    @property
    def label(self) -> str:
        if self.drafter == "none":
            return "specdec target alone" if self.engine == "specdec" else "transformers generate"
        if self.drafter.endswith("_tree"):
            name = {"draft_model_tree": "draft model", "eagle_tree": "eagle head"}[self.drafter]
            return f"{self.engine} {name} tree {self.tree}, {self.k} nodes"
        if self.drafter == "eagle":
            return f"{self.engine} eagle head k={self.k}"
        if self.drafter == "early_exit":
            return (
                f"{self.engine} early exit ({'default depth' if self.layer is None else f'layer {self.layer}'}) "
                f"k={self.k}"
            )
        if self.drafter == "draft_model_adaptive":
            return f"{self.engine} draft model adaptive k<={self.k}"
        if self.drafter == "draft_model_goodput":
            return f"{self.engine} draft model goodput k<={self.k}"
        name = {
            "draft_model": "draft model",
            "ngram": "prompt lookup",
            "lookup_then_draft": "prompt lookup, else draft model",
        }[self.drafter]
        if self.engine == "transformers":
            name = {"draft_model": "assisted (draft model)", "ngram": "prompt lookup"}[self.drafter]
        return f"{self.engine} {name} k={self.k}"


TARGET_ALONE = Method("specdec", "none")
TRANSFORMERS_PLAIN = Method("transformers", "none")


@dataclass
class Run:
    """One method's decoding of one prompt."""

    token_ids: list[int]
    seconds: float  # wall time of the call
    stats: SpecStats | None = None  # specdec only
    timings: dict[str, float] | None = None  # specdec only: Engine.timings of the call


Runner = Callable[[list[int], SamplingParams], Run]


@dataclass
class Record:
    prompt_set: str
    sampling: str
    prompt: str
    method: Method
    run: Run


@dataclass
class LoadedRunners:
    runners: dict[Method, Runner]
    target: LLM
    draft_model: object | None  # the draft's ModelRunner, for its step cost
    notes: list[str] = field(default_factory=list)


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Load, warm up, measure every configuration interleaved, and summarize (JSON-ready)."""
    say = progress or (lambda message: None)
    say(f"loading {config.model}" + (f" and {config.draft}" if config.draft else ""))
    loaded = load_runners(config)
    prompts = {name: encode_prompts(loaded.target, config, name, loaded.notes) for name in config.prompt_sets}
    say("warming up every method")
    warm_up(loaded.runners, max((ids for pairs in prompts.values() for _, ids in pairs), key=len), config)
    records = measure(loaded.runners, prompts, config, say)
    say("measuring step costs and memory bandwidth")
    costs = measure_costs(loaded, config)
    roofline = measure_roofline(loaded.target, config)
    rows = summarize(records, loaded.runners, costs, roofline, config)
    quality = None
    if config.quantization is not None:
        say("measuring what quantization costs, against the unquantized target")
        quality = measure_quantization_quality(loaded.target, prompts, records, config)
    results = {
        "machine": describe_machine(config.device),
        "config": _config_json(config),
        "models": _models_json(loaded, config),
        "prompt_sets": {
            name: {"title": PROMPT_SETS[name][0], "prompts": [p.name for p, _ in prompts[name]]}
            for name in config.prompt_sets
        },
        "costs": costs,
        "roofline": roofline,
        "rows": rows,
        "exactness": check_greedy_exactness(records),
        "quantization_quality": quality,
        "notes": loaded.notes + _method_notes(loaded.target.target.model.dtype),
    }
    results["goals"] = evaluate_goals(results)
    return results


# -- loading -------------------------------------------------------------------------------


def load_runners(config: BenchConfig) -> LoadedRunners:
    """The specdec target (loaded once, shared by every specdec method) and its drafters,
    then the transformers baselines where transformers is installed."""
    target = LLM(
        config.model,
        dtype=config.dtype,
        device=config.device,
        compile=config.compile,
        quantization=config.quantization,
        speculative_method="none",
    )
    runners: dict[Method, Runner] = {TARGET_ALONE: SpecdecRunner(target)}
    draft_model = None
    if config.draft is not None:
        spec = SpeculativeConfig(
            method="draft_model",
            model=config.draft,
            num_speculative_tokens=max(config.ks),
            draft_dtype=config.draft_dtype,
            draft_quantization=config.draft_quantization,
        )
        drafter = DRAFTERS["draft_model"](spec, target.target, target.runner)
        draft_model = drafter.runner
        for k in config.ks:
            runners[Method("specdec", "draft_model", k)] = SpecdecRunner(target.with_drafter(drafter, k, "fixed"))
        if config.adaptive_confidence > 0:  # the same draft weights, its own cache
            adaptive = drafter.sharing_weights(config.adaptive_confidence)
            runners[Method("specdec", "draft_model_adaptive", max(config.ks))] = SpecdecRunner(
                target.with_drafter(adaptive, max(config.ks), "fixed")
            )
        runners[Method("specdec", "draft_model_goodput", max(config.ks))] = SpecdecRunner(  # LLM's default policy
            target.with_drafter(drafter.sharing_weights(), max(config.ks), "goodput")
        )
    ngram = DRAFTERS["ngram"](SpeculativeConfig(method="ngram"), target.target, target.runner)
    for k in config.ks:
        runners[Method("specdec", "ngram", k)] = SpecdecRunner(target.with_drafter(ngram, k, "fixed"))
    if config.draft is not None:  # the same draft weights, with its own cache, behind prompt lookup
        hybrid = LookupThenDraftDrafter.sharing_weights(drafter)
        for k in config.ks:
            runners[Method("specdec", "lookup_then_draft", k)] = SpecdecRunner(target.with_drafter(hybrid, k, "fixed"))
    runners.update(self_drafting_runners(config, target, drafter if config.draft is not None else None))
    loaded = LoadedRunners(runners, target, draft_model)
    if config.with_transformers:
        runners.update(transformers_runners(config, target, draft_model, loaded.notes))
    return loaded


def self_drafting_runners(config: BenchConfig, target: LLM, draft_model_drafter) -> dict[Method, Runner]:
    """The comparison k's rows of the drafters beyond the draft model's k sweep: the head
    (chain, then each tree shape), the draft model's trees, early exit."""
    k, runners = config.transformers_k, {}
    assert k is not None  # BenchConfig resolves None
    if draft_model_drafter is not None:
        for shape in config.trees:
            runners[Method("specdec", "draft_model_tree", k, shape)] = SpecdecRunner(
                target.with_drafter(draft_model_drafter.sharing_weights(), k, tree=shape)
            )
    if config.head is not None:
        head = DRAFTERS["eagle"](SpeculativeConfig(method="eagle", model=config.head), target.target, target.runner)
        runners[Method("specdec", "eagle", k)] = SpecdecRunner(target.with_drafter(head, k, "fixed"))
        for shape in config.trees:
            runners[Method("specdec", "eagle_tree", k, shape)] = SpecdecRunner(target.with_drafter(head, k, tree=shape))
    if config.early_exit_layer is not None:
        spec = SpeculativeConfig(method="early_exit", early_exit_layer=config.early_exit_layer)
        early_exit = DRAFTERS["early_exit"](spec, target.target, target.runner)
        runners[Method("specdec", "early_exit", k, layer=config.early_exit_layer)] = SpecdecRunner(
            target.with_drafter(early_exit, k, "fixed")
        )
    return runners


def on_the_shared_stream(llm: LLM, params: SamplingParams) -> SamplingParams:
    """A bench's sampled request as users send it, without a seed of its own: its seed seeds
    the stream unseeded requests share (llm's), now, before its generate. A seeded sampled
    request keeps the fixed k (spec/k_choice.py: its tokens must not depend on timings), so
    goodput's k is measured only unseeded; seeding the shared stream keeps a run repeatable.
    Greedy or unseeded params come back as they are."""
    if params.greedy or params.seed is None:
        return params
    llm.engine.shared_generator.manual_seed(params.seed)
    return dataclasses.replace(params, seed=None)


class SpecdecRunner:
    """One generate of a specdec method, a sampled request on the shared stream
    (on_the_shared_stream)."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> Run:
        params = on_the_shared_stream(self.llm, params)
        start = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
        seconds = time.perf_counter() - start
        return Run(output.outputs[0].token_ids, seconds, output.metrics, dict(self.llm.engine.timings))


class TransformersRunner:
    """transformers' generate on the same checkpoint (assisted by assistant_model, if given,
    with generation_options such as prompt_lookup_num_tokens). Its generation config holds
    what the SamplingParams say and neutral values for what they do not: transformers fills
    a setting left unset from the checkpoint's generation_config.json, which may hold ones
    specdec does not apply (a repetition penalty, say) and would give transformers other
    work and other tokens. It stops at the same EOS ids as specdec (config.json's and
    generation_config.json's)."""

    NEUTRAL = dict(
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
    )

    def __init__(
        self, model, device: torch.device, eos_token_ids: tuple[int, ...], assistant_model=None, **generation_options
    ):
        self.model, self.device, self.eos_token_ids = model, device, list(eos_token_ids)
        self.assistant_model, self.generation_options = assistant_model, generation_options

    def generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        eos = self.eos_token_ids or None
        sampling = (
            dict(do_sample=False)
            if params.greedy
            else dict(
                do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0, min_p=self._min_p(params)
            )
        )
        return GenerationConfig(
            max_new_tokens=params.max_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **self.NEUTRAL,
            **sampling,
            **self.generation_options,
        )

    def _min_p(self, params: SamplingParams) -> float | None:
        """params.min_p; None (no warper at all) for 0 unless the checkpoint's config sets one."""
        return params.min_p if params.min_p or self.model.generation_config.min_p is not None else None

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> Run:
        input_ids = torch.tensor([prompt_ids], device=self.device)
        kwargs = dict(generation_config=self.generation_config(params), attention_mask=torch.ones_like(input_ids))
        if self.assistant_model is not None:
            kwargs["assistant_model"] = self.assistant_model
        if not params.greedy:
            torch.manual_seed(params.seed)
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(input_ids, **kwargs)
        token_ids = output[0, len(prompt_ids) :].tolist()
        return Run(token_ids, time.perf_counter() - start)


def transformers_runners(config: BenchConfig, target: LLM, draft_model, notes: list[str]) -> dict[Method, Runner]:
    """transformers' generate: plain, assisted by the draft, prompt lookup; {} with a note
    where transformers is missing or cannot load the checkpoints."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        notes.append("transformers is not installed: its rows are skipped (pip install transformers).")
        return {}
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device, k = target.device, config.transformers_k
    assert k is not None  # BenchConfig resolves None
    eos = target.target.eos_token_ids
    try:  # in the dtypes specdec loaded them in
        hf_target = _transformers_model(AutoModelForCausalLM, config.model, target.target.model.dtype, device)
    except Exception as e:  # an optional baseline: report why it is missing, measure the rest
        notes.append(f"transformers could not load the target ({type(e).__name__}: {e}); its rows are skipped.")
        return {}
    hf_draft = None
    if draft_model is not None and draft_model.config.output_vocab_size:
        notes.append(
            "the draft's output layer scores part of the vocabulary (output_vocab_size), which transformers' "
            "models do not have: transformers' assisted-generation row is skipped."
        )
    elif draft_model is not None:
        assert config.draft is not None  # draft_model was loaded from it
        try:
            hf_draft = _transformers_model(AutoModelForCausalLM, config.draft, draft_model.dtype, device)
        except Exception as e:
            notes.append(
                f"transformers could not load the draft ({type(e).__name__}: {e}); its assisted-generation "
                "row is skipped."
            )
    if hf_draft is not None:
        hf_draft.generation_config.num_assistant_tokens = k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    runners = {TRANSFORMERS_PLAIN: TransformersRunner(hf_target, device, eos)}
    if hf_draft is not None and hf_draft.config.vocab_size != hf_target.config.vocab_size:
        notes.append(
            f"transformers' assisted generation needs the draft's vocab_size "
            f"({hf_draft.config.vocab_size}) to equal the target's ({hf_target.config.vocab_size}); "
            "its row is skipped (specdec drafts with a padded vocabulary like this)."
        )
    elif hf_draft is not None:
        assert draft_model is not None  # hf_draft is its copy
        runners[Method("transformers", "draft_model", k)] = TransformersRunner(
            hf_target, device, eos, assistant_model=hf_draft
        )
        packed = _packed_linears(draft_model.eager_model())
        if packed:
            notes.append(
                f"specdec runs the draft in {str(draft_model.dtype).removeprefix('torch.')} with "
                f"{packed} of its matrices (those of 2 MB or more) prepacked in bfloat16 "
                '(draft_dtype="auto"); transformers\' assistant runs wholly in '
                f"{str(hf_draft.dtype).removeprefix('torch.')}, reading more bytes a step."
            )
    runners[Method("transformers", "ngram", k)] = TransformersRunner(hf_target, device, eos, prompt_lookup_num_tokens=k)
    notes.append(
        f"transformers {transformers.__version__}: assisted generation at num_assistant_tokens={k} "
        "(schedule constant, its default assistant_confidence_threshold), prompt lookup at "
        f"prompt_lookup_num_tokens={k} (its default max_matching_ngram_size 2)."
    )
    return runners


def _transformers_model(auto_class, path: str, dtype: torch.dtype, device):
    """transformers' model of a directory or a GGUF file (read by its own GGUF loader)."""
    if is_gguf_file(path):
        file = Path(path).expanduser()
        model = auto_class.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype)
    else:
        model = auto_class.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


# -- prompts -------------------------------------------------------------------------------


def encode_prompts(target: LLM, config: BenchConfig, set_name: str, notes: list[str]) -> list[tuple[Prompt, list[int]]]:
    """prompts_per_set prompts spread over the set, as token ids that fit the context."""
    _, make_prompts = PROMPT_SETS[set_name]
    tokenizer = target.tokenizer
    assert tokenizer is not None  # the bench loads the target with its tokenizer
    available = make_prompts(per_module=2, max_chars=config.max_prompt_chars)
    prompts = spread(available, config.prompts_per_set)
    if not prompts:
        raise ValueError(f"prompt set {set_name!r} is empty: the held-out standard-library modules are missing")
    if len(prompts) < config.prompts_per_set:
        notes.append(
            f"the {set_name!r} set has {len(prompts)} prompts, fewer than the {config.prompts_per_set} "
            "asked for: all of them were run."
        )
    room = target.max_model_len - config.max_tokens - config.max_k - 1
    if room < 2:
        raise ValueError(
            f"the target's context ({target.max_model_len} tokens) leaves no room for a prompt with "
            f"max_tokens={config.max_tokens} and k up to {config.max_k}; lower --max-tokens"
        )
    if prompts[0].chat and not tokenizer.chat_template:
        raise ValueError(
            f"prompt set {set_name!r} is chat prompts, and the target has no chat template; use the "
            "code and repeat sets for a model that is not a chat model"
        )
    encoded, num_cut = [], 0
    for prompt in prompts:
        ids = (
            target.chat_token_ids([{"role": "user", "content": prompt.text}])
            if prompt.chat
            else tokenizer.encode(prompt.text)
        )
        if len(ids) > room:
            ids, num_cut = ids[:1] + ids[len(ids) - room + 1 :], num_cut + 1
        encoded.append((prompt, ids))
    if num_cut:
        notes.append(f"{num_cut} {set_name!r} prompts were cut to their last {room} tokens to fit the context.")
    return encoded


def spread(items: list, n: int) -> list:
    """n items taken evenly through the list (all of them if it has no more than n)."""
    if len(items) <= n:
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)]


# -- measuring -----------------------------------------------------------------------------


def warm_up(runners: dict[Method, Runner], prompt_ids: list[int], config: BenchConfig) -> None:
    """Every method and sampling pays its first calls' costs (compiling, allocating caches for
    the longest prompt, packing weights, each forward shape's first call, goodput's cost
    calibration) before anything is timed: LLM.warm_up for specdec's methods, on the longest
    prompt (prompt_ids); a call of enough tokens for a round at the largest k for the others."""
    for sampling in config.samplings:
        params = sampling.params(config.max_tokens, config.seed)
        short = sampling.params(min(config.max_tokens, config.max_k + 2), config.seed)
        for runner in runners.values():
            if isinstance(runner, SpecdecRunner):
                runner.llm.warm_up(prompt_ids, params)
            else:
                runner(prompt_ids[-32:], short)


def measure(
    runners: dict[Method, Runner],
    prompts: dict[str, list[tuple[Prompt, list[int]]]],
    config: BenchConfig,
    say: Callable[[str], None],
) -> list[Record]:
    """Every method on every prompt, prompt by prompt, the order rotated each prompt."""
    methods, records = list(runners), []
    for set_name, set_prompts in prompts.items():
        for sampling in config.samplings:
            for index, (prompt, ids) in enumerate(set_prompts):
                say(f"[{set_name} {sampling.name} {index + 1}/{len(set_prompts)}] {prompt.name}")
                params = sampling.params(config.max_tokens, config.seed + index)
                shift = index % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    records.append(Record(set_name, sampling.name, prompt.name, method, runners[method](ids, params)))
    return records


def measure_costs(loaded: LoadedRunners, config: BenchConfig) -> dict:
    """The median single-token step of the target and of the draft, c = draft ÷ target, and
    for each k the target's (k+1)-token verify forward ÷ its step, v_k (each the median over
    three alternating measurements, so drift hits all alike)."""
    target_runner = loaded.target.runner
    work = config.max_tokens  # each request runs alone: the work "auto" compilation judges
    target_steps, draft_steps, verify_steps = [], [], {k: [] for k in config.ks}
    for _ in range(3):
        target_steps.append(step_seconds(target_runner, config.step_repeats, num_forwards=work))
        if loaded.draft_model is not None:
            draft_steps.append(step_seconds(loaded.draft_model, config.step_repeats, num_forwards=work))
        for k in config.ks:
            verify_steps[k].append(
                step_seconds(target_runner, config.step_repeats, num_tokens=k + 1, num_forwards=work)
            )
    target_step = statistics.median(target_steps)
    draft_step = statistics.median(draft_steps) if draft_steps else None
    return {
        "target_step_ms": target_step * 1e3,
        "draft_step_ms": draft_step * 1e3 if draft_step is not None else None,
        "cost_ratio": draft_step / target_step if draft_step is not None else None,
        "verify_cost_ratio": {str(k): statistics.median(times) / target_step for k, times in verify_steps.items()},
    }


def measure_quantization_quality(target: LLM, prompts: dict, records: list[Record], config: BenchConfig) -> dict | None:
    """The quantized target against the same checkpoint unquantized, on the greedy prompts the
    target alone ran (see quality.py)."""
    ids_by_name = {(set_name, prompt.name): ids for set_name, pairs in prompts.items() for prompt, ids in pairs}
    greedy_runs = [
        (ids_by_name[(r.prompt_set, r.prompt)], r.run.token_ids, r.run.seconds)
        for r in records
        if r.method == TARGET_ALONE and r.sampling == GREEDY.name
    ]
    if not greedy_runs:
        return None
    reference = LLM(
        config.model, dtype=config.dtype, device=config.device, compile=config.compile, speculative_method="none"
    )
    return quantization_quality(target, reference, greedy_runs, config.max_tokens)


def measure_roofline(target: LLM, config: BenchConfig) -> dict:
    """Weight bytes a decode step reads ÷ streaming read bandwidth: the fastest a step can be."""
    bandwidth = read_bandwidth(config.bandwidth_bytes, device=config.device)
    weight_bytes = decode_weight_bytes(target.target.model)
    return {
        "buffer_bytes": config.bandwidth_bytes,
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "decode_weight_bytes": weight_bytes,
        "step_floor_ms": weight_bytes / bandwidth * 1e3,
        "ceiling_tokens_per_s": bandwidth / weight_bytes,
    }


# -- summarizing ---------------------------------------------------------------------------


def summarize(
    records: list[Record], runners: dict[Method, Runner], costs: dict, roofline: dict, config: BenchConfig
) -> list[dict]:
    """One row per (prompt set, sampling, method), in the order of runners; speedups are over
    the specdec target alone in the same prompt set and sampling."""
    rows = []
    for set_name in config.prompt_sets:
        for sampling in config.samplings:
            group = []
            for method in runners:
                key = (set_name, sampling.name, method)
                runs = [r.run for r in records if (r.prompt_set, r.sampling, r.method) == key]
                row = {
                    "prompt_set": set_name,
                    "sampling": sampling.name,
                    "engine": method.engine,
                    "method": method.drafter,
                    "k": method.k,
                    "label": method.label,
                }
                row.update(_row_measurements(method, runs, costs, roofline))
                group.append(row)
            baseline = next(row for row in group if row["label"] == TARGET_ALONE.label)
            _add_speedups(group, baseline)
            _add_in_round_costs(group, baseline)
            rows += group
    return rows


def _row_measurements(method: Method, runs: list[Run], costs: dict, roofline: dict) -> dict:
    seconds = sum(r.seconds for r in runs)
    row = {"prompts": len(runs), "tokens": sum(len(r.token_ids) for r in runs), "seconds": seconds}
    row["tokens_per_s"] = row["tokens"] / seconds
    row.update(
        alpha=None,
        tau=None,
        acceptance_by_position=None,
        rounds_by_k=None,
        cost_ratio=None,
        predicted_speedup=None,
        predicted_with_verify_cost=None,
        tokens_per_round=None,
        predicted_from_tau=None,
        decode_tokens_per_s=None,
        roofline_fraction=None,
        profile=None,
    )
    if method.engine != "specdec":
        return row
    stats = SpecStats.merge([r.stats for r in runs])  # pyright: ignore[reportArgumentType]  # specdec runs have stats
    alpha = _finite(stats.acceptance_rate)
    row.update(
        tau=_finite(stats.tokens_per_forward),
        alpha=alpha,
        acceptance_by_position=acceptance_by_position(stats),
        rounds_by_k=stats.rounds_by_k if method.drafter == "draft_model_goodput" else None,
    )
    row["cost_ratio"] = {"draft_model": costs["cost_ratio"], "ngram": 0.0}.get(method.drafter)
    if alpha is not None and row["cost_ratio"] is not None:
        row["predicted_speedup"] = predicted_speedup(alpha, method.k, row["cost_ratio"])
        verify_cost = costs["verify_cost_ratio"].get(str(method.k))
        if verify_cost is not None:  # the formula with the verify forward's measured cost instead of 1
            row["predicted_with_verify_cost"] = expected_tokens_per_round(alpha, method.k) / (
                method.k * row["cost_ratio"] + verify_cost
            )
    row["profile"] = profile(runs, stats)
    if row["profile"]["rounds"] and row["cost_ratio"] is not None:
        row["tokens_per_round"] = (row["tokens"] - len(runs)) / row["profile"]["rounds"]  # after the prefill's
        row["predicted_from_tau"] = row["tokens_per_round"] / (method.k * row["cost_ratio"] + 1)
    decode_seconds = seconds - row["profile"]["seconds"]["prefill"]
    if decode_seconds > 0:
        row["decode_tokens_per_s"] = (row["tokens"] - len(runs)) / decode_seconds  # the first comes from prefill
        row["roofline_fraction"] = row["decode_tokens_per_s"] / roofline["ceiling_tokens_per_s"]
    return row


def _add_speedups(group: list[dict], baseline: dict) -> None:
    """speedup: tokens/s over the baseline's, prefill included (what a user waits for);
    decode_speedup: over the baseline's after the prefill (what the formula predicts)."""
    for row in group:
        row["speedup"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        both = row["decode_tokens_per_s"] and baseline["decode_tokens_per_s"]
        row["decode_speedup"] = row["decode_tokens_per_s"] / baseline["decode_tokens_per_s"] if both else None


def _add_in_round_costs(group: list[dict], baseline: dict) -> None:
    """c measured where it is paid: the drafter's time per draft step inside the rounds (its
    k steps per round, with the bookkeeping that feeds them) ÷ the target alone's time per
    forward in its own decoding; and the formula's prediction with that c. An isolated step
    is cheaper than one between the target's forwards (which evict the draft from the caches),
    so the isolated c flatters the formula."""
    target_rounds = baseline["profile"]["rounds"] if baseline["profile"] else 0
    target_step = baseline["profile"]["seconds"]["target"] / target_rounds if target_rounds else None
    for row in group:
        row.update(cost_ratio_in_rounds=None, predicted_in_rounds=None)
        fixed_k = row["cost_ratio"] is not None  # set for the rows that draft k tokens every round
        if not (fixed_k and target_step and row["alpha"] is not None and row["profile"]["rounds"]):
            continue
        draft_step = row["profile"]["seconds"]["draft"] / (row["profile"]["rounds"] * row["k"])
        row["cost_ratio_in_rounds"] = draft_step / target_step
        row["predicted_in_rounds"] = predicted_speedup(row["alpha"], row["k"], row["cost_ratio_in_rounds"])


def acceptance_by_position(stats: SpecStats) -> list[float | None]:
    """Accepted ÷ proposed at each draft position, None (for JSON) where nothing was proposed,
    where SpecStats.acceptance_by_position has NaN."""
    proposed = stats.proposed_by_position
    accepted = stats.accepted_by_position + [0] * (len(proposed) - len(stats.accepted_by_position))
    return [a / p if p else None for a, p in zip(accepted, proposed)]


def profile(runs: list[Run], stats: SpecStats) -> dict:
    """Where the time went, summed over runs: Engine.timings' parts, and "other" (the rest of
    the wall time: creating requests and outputs, the final decode), with the rounds counted."""
    # specdec runs have timings
    parts = {key: sum(r.timings[key] for r in runs) for key in runs[0].timings}  # pyright: ignore[reportOptionalSubscript, reportOptionalIterable]
    parts["other"] = max(0.0, sum(r.seconds for r in runs) - sum(parts.values()))
    return {
        "rounds": stats.num_target_forwards - len(runs),  # a prefill forward per run is not a round
        "seconds": parts,
    }


def check_greedy_exactness(records: list[Record]) -> dict:
    """Greedy outputs of every specdec method against the specdec target alone, and the target
    alone against transformers' greedy generate: how many compared, and every divergence."""
    greedy = [r for r in records if r.sampling == GREEDY.name]
    by_prompt: dict[tuple[str, str], dict[Method, Run]] = {}
    for r in greedy:
        by_prompt.setdefault((r.prompt_set, r.prompt), {})[r.method] = r.run
    compared, divergences = 0, []
    for (_, prompt), runs in by_prompt.items():
        pairs = [(m, TARGET_ALONE) for m in runs if m.engine == "specdec" and m != TARGET_ALONE]
        if TRANSFORMERS_PLAIN in runs:
            pairs.append((TARGET_ALONE, TRANSFORMERS_PLAIN))
        for checked, against in pairs:
            compared += 1
            divergence = compare(prompt, checked.label, runs[checked].token_ids, against.label, runs[against].token_ids)
            if divergence is not None:
                divergences.append(divergence.to_json())
    return {"compared": compared, "identical": compared - len(divergences), "divergences": divergences}


# -- helpers -------------------------------------------------------------------------------


def _method_notes(target_dtype: torch.dtype) -> list[str]:
    notes = [
        "Speedup (x plain): tokens/s over the specdec target alone's on the same prompts and sampling; "
        "tokens/s counts every generated token over the wall time of each call, prefill included. Decode "
        "speedup (decode x plain): the same after the prefill (the first token), which is what the formula "
        "models.",
        "Predicted: (1 - α^(k+1)) / ((1 - α)(k·c + 1)) from the measured α and c; prompt lookup is taken "
        "as c = 0 and may propose fewer than k tokens a round, which the formula does not model.",
        "Predicted with verify cost: the formula with the measured cost of the (k+1)-token verify forward "
        "(v_k target steps) in place of 1: (1 - α^(k+1)) / ((1 - α)(k·c + v_k)).",
        "Predicted from τ: the measured tokens per round (after the prefill) ÷ (k·c + 1), the formula with "
        "the α that gives the measured tokens per round. α = accepted ÷ judged (a draft token is judged when "
        "every draft before it in its round was accepted), the α the formula assumes; the two predictions "
        "differ where acceptance is not the same at every position. What remains between them and the "
        "measured speedup is cost the formula leaves out (sampling, bookkeeping, a verify forward dearer "
        "than one step).",
        "Adaptive k: the draft model up to the largest k, a row stopping its drafting after a token the draft "
        "gave less than the --adaptive-confidence probability (LLM's draft_confidence_threshold); the "
        "formula's fixed k does not apply to it.",
        "Prompt lookup, else draft model (speculative_method lookup_then_draft): prompt lookup for the rows "
        "whose last 2 or more tokens occurred earlier, at no cost, and the draft model for the others; its "
        "cost per draft token varies by round, so no formula.",
    ]
    if target_dtype != torch.float32:
        notes.append(
            f"The target runs in {str(target_dtype).replace('torch.', '')}: greedy outputs are exact in "
            "float32; in lower precision a forward over k+1 tokens can round differently from a "
            "one-token step and flip a near-tie, which the exactness check would show (--dtype float32 "
            "rules that out)."
        )
    return notes


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _config_json(config: BenchConfig) -> dict:
    data = asdict(config)
    data["samplings"] = [asdict(s) for s in config.samplings]
    return data


def _models_json(loaded: LoadedRunners, config: BenchConfig) -> dict:
    def describe(path: str, runner) -> dict:
        return {
            "path": str(Path(path)),
            "parameters": runner.config.num_parameters,
            "dtype": str(runner.dtype),
            "bf16_packed_matrices": _packed_linears(runner.eager_model()),
            "compile": runner.compile_mode,
            "compile_seconds": round(runner.compile_seconds, 1),
            "quantization": runner.quantization,
        }

    return {
        "target": describe(config.model, loaded.target.runner),
        "draft": describe(config.draft, loaded.draft_model) if loaded.draft_model is not None else None,  # pyright: ignore[reportArgumentType]  # loaded from config.draft
    }


def _packed_linears(model) -> int:
    """How many of a float32 model's matrices run prepacked in bfloat16 (cpu_linear.py)."""
    from specdec.models.cpu_linear import Bf16PackedLinear

    return sum(isinstance(module, Bf16PackedLinear) for module in model.modules())


def _check_model_dir(path: str, what: str) -> None:
    if not Path(path).is_dir() and not is_gguf_file(path):
        raise FileNotFoundError(
            f"{what} directory {str(path)!r} does not exist; pass a Hugging Face model "
            "directory (with config.json and *.safetensors) or a .gguf file"
        )
