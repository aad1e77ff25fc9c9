"""Structured output under speculation (grammar.py, processors.py): greedy output equal to a
step-by-step reference outside the engine (transformers' model, llguidance's matcher built here
from the tokenizer file, the argmax over the allowed tokens), for the target alone, a chain, a
tree and prompt lookup; answers that parse and validate against their schema; sampled answers
following the exact distribution of the masked target (chi-square over every answer the
grammar allows); a bad schema or grammar refused by name before any work."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from helpers import load_hf, save_tree_models
from specdec import LLM, SamplingParams, StructuredOutputsParams
from specdec.spec.grammar import grammar_text
from specdec.tools.benchmark.chi_square import chi_square_p_value

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
OUTPUTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-f]{3}-[0-9]{2}"),
    "choice": StructuredOutputsParams(choice=["apple", "banana", "cherry pie"]),
    "grammar": StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[xyz]/ | start'),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target, a draft that is the target plus noise (helpers.save_tree_models)."""
    return save_tree_models(tmp_path_factory.mktemp("structured"))


def reference_matcher(models, params: StructuredOutputsParams, eos: int) -> llguidance.LLMatcher:
    """llguidance's matcher over the model's tokenizer file, made here, not by the engine."""
    tokenizer_json = (models["target"] / "tokenizer.json").read_text()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=320, eos_token=eos)
    return llguidance.LLMatcher(ll_tokenizer, grammar_text(params), log_level=0)


def allowed_tokens(matcher: llguidance.LLMatcher) -> torch.Tensor:
    """[V] bool from the matcher's bitmask (one bit per token, little-endian)."""
    packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(packed, bitorder="little")[:320].astype(bool))


def reference_greedy(models, prompt: list[int], params: StructuredOutputsParams, eos: int, max_tokens: int):
    """The target's argmax over the allowed tokens, one token at a time, until EOS or max_tokens."""
    model, matcher = load_hf(models["target"]), reference_matcher(models, params, eos)
    output: list[int] = []
    with torch.no_grad():
        while len(output) < max_tokens:
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            token = int(logits.masked_fill(~allowed_tokens(matcher), float("-inf")).argmax())
            output.append(token)
            if token == eos:
                break
            assert matcher.consume_token(token)
    return output


DRAFTERS = {
    "alone": dict(speculative_method="none"),
    "chain": dict(speculative_method="draft_model", num_speculative_tokens=4),
    "tree": dict(speculative_method="draft_model", num_speculative_tokens=6, speculative_tree="2,2,1"),
    "lookup": dict(speculative_model="[ngram]", num_speculative_tokens=4),
}


def make_llm(models, drafter: str, **kwargs) -> LLM:
    options = dict(DRAFTERS[drafter], **kwargs)
    if options.get("speculative_method") == "draft_model":
        options["speculative_model"] = str(models["draft"])
    if drafter != "alone":
        options["speculative_k_policy"] = "fixed"  # k every round: what these tests count was drafted
    return LLM(str(models["target"]), dtype="float32", **options)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_equals_the_masked_target_step_by_step(models, drafter):
    llm = make_llm(models, drafter)
    (eos,) = llm.target.eos_token_ids
    prompt = [40, 41, 42, 43, 44, 40, 41, 42]
    for name, params in OUTPUTS.items():
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=params))[0]
        want = reference_greedy(models, prompt, params, eos, 40)
        assert got.outputs[0].token_ids == want, name
        assert got.outputs[0].finish_reason == "stop", name  # each grammar ends well before 40 tokens
        if name == "json":
            jsonschema.validate(json.loads(got.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("drafter", ["lookup", "chain", "alone"])
def test_tokens_the_grammar_forces_lead_the_drafts_and_the_output_is_the_same(models, drafter):
    """Jump-forward: the literal runs of a regex (what the grammar forces) are verified ahead of
    the drafter's tokens, counted apart from them; greedy output still the masked target's. The
    target alone keeps no room for drafts, so it has none."""
    params = StructuredOutputsParams(regex=r"order=[0-9]{3}; status=(shipped|pending); note=[a-z]{4}\.")
    llm = make_llm(models, drafter)
    (eos,) = llm.target.eos_token_ids
    prompt = [50, 51, 52, 53]
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs=params))[0]
    assert got.outputs[0].token_ids == reference_greedy(models, prompt, params, eos, 60)
    if drafter == "alone":
        assert got.metrics.num_forced_tokens == 0
    else:
        assert got.metrics.num_forced_tokens >= 5, got.metrics
        # the drafter's own proposals are counted apart: never more accepted than proposed
        assert got.metrics.num_accepted_tokens <= got.metrics.num_draft_tokens


def test_answers_follow_their_grammars_in_a_batch_with_free_text(models):
    """Rows with different grammars and one without, batched, sampled: every constrained answer
    is one its grammar allows; the free row is free (it writes what no grammar here allows)."""
    llm = make_llm(models, "chain")
    prompts = [[40 + i, 41, 42, 43] for i in range(len(OUTPUTS) + 1)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=p)
        for i, p in enumerate(OUTPUTS.values())
    ]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True))
    outputs = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in outputs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert len(texts[1]) == 6 and texts[1][3] == "-" and set(texts[1][:3]) <= set("abcdef") and texts[1][4:].isdigit()
    assert texts[2] in ("apple", "banana", "cherry pie")
    assert texts[3].startswith("(") and texts[3].endswith(")") and set(texts[3]) <= set("(),xyz")
    assert len(outputs[4].outputs[0].token_ids) == 20
    assert sum(o.metrics.num_accepted_tokens for o in outputs[:4]) > 0


def test_a_bad_schema_or_grammar_is_refused_by_name_before_any_work(models):
    llm = make_llm(models, "chain")
    for params, named in (
        (StructuredOutputsParams(json={"type": "objekt"}), "json"),
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
    ):
        with pytest.raises(ValueError, match=named):
            llm.generate([[5, 6]], SamplingParams(structured_outputs=params))
    with pytest.raises(ValueError, match="structured outputs"):
        LLM(str(models["target"]), skip_tokenizer_init=True).generate(
            [[5, 6]], SamplingParams(structured_outputs=OUTPUTS["choice"])
        )


# --- sampled: chi-square over every answer -----------------------------------------------------

NUM_DRAWS = 4_000
CHOICES = ["ab", "abc", "b", "cab", "ca"]


def exact_answers(models, prompt: list[int], params: StructuredOutputsParams, eos: int, temperature: float):
    """{answer's tokens (with EOS): probability} over every tokenization the grammar allows: the
    target's softmax at temperature over the allowed tokens, multiplied along each answer."""
    model, matcher = load_hf(models["target"]), reference_matcher(models, params, eos)
    answers: dict[tuple[int, ...], float] = {}

    def walk(output: list[int], probability: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1] / temperature
        probs = torch.softmax(logits.masked_fill(~allowed_tokens(matcher), float("-inf")).double(), -1)
        for token in probs.nonzero().flatten().tolist():
            p = probability * float(probs[token])
            if token == eos:
                answers[tuple(output + [token])] = p
            else:
                assert matcher.consume_token(token)
                walk(output + [token], p)
                matcher.rollback(1)

    walk([], 1.0)
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_sampled_answers_follow_the_masked_target(models, drafter):
    params = StructuredOutputsParams(choice=CHOICES)
    llm = make_llm(models, drafter, max_num_seqs=NUM_DRAWS, seed=31)
    (eos,) = llm.target.eos_token_ids
    prompt = [40, 41, 42, 43]
    exact = exact_answers(models, prompt, params, eos, temperature=1.0)
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) >= len(CHOICES)  # each spelt one way or more
    answers = list(exact)
    outputs = llm.generate(
        [prompt] * NUM_DRAWS, SamplingParams(temperature=1.0, max_tokens=10, structured_outputs=params)
    )
    index = {answer: i for i, answer in enumerate(answers)}
    samples = np.array([index[tuple(o.outputs[0].token_ids)] for o in outputs])
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    proposed = sum(o.metrics.num_draft_tokens for o in outputs)
    assert 100 < accepted < proposed, (accepted, proposed)
    probs = np.array([exact[answer] for answer in answers])
    p_value = chi_square_p_value(samples, probs, f"{drafter} answers")
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e} over {NUM_DRAWS} answers"


def test_a_whitespace_pattern_is_the_whitespace_json_allows():
    """vLLM's whitespace_pattern: JSON's whitespace between two tokens follows it instead of the
    default (up to 64 whitespace characters); with a regex instead of JSON it is refused."""
    from helpers import make_tokenizer
    from specdec.models.tokenizer import Tokenizer
    from specdec.spec.grammar import GrammarState

    tokenizer = Tokenizer(make_tokenizer(320))
    tight, compact = '{"ok":true,"n":3,"tag":"red"}', '{"ok": true, "n": 3, "tag": "red"}'
    pretty = '{\n  "ok": true,\n  "n": 3,\n  "tag": "red"\n}'
    for params, allowed in (
        (StructuredOutputsParams(json=SCHEMA), {tight, compact, pretty}),
        (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"), {tight, compact}),
        (StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ \n]*"), {tight, compact, pretty}),
        (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), {tight}),
    ):
        for answer in (tight, compact, pretty):
            state = GrammarState(params, tokenizer, tokenizer.vocab_size, eos_token_ids=(1,))
            tokens = tokenizer.encode(answer, add_special_tokens=False)
            assert (state.valid_prefix(tokens + [1]) == len(tokens) + 1) == (answer in allowed), (params, answer)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ")
