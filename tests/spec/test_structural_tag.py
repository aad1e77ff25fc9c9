"""Structural tags (structural_tag.py: vLLM's structural_tag): the grammar lets through exactly the
answers it should (llguidance's matcher over real tokenizations, then EOS), malformed tags are
refused by name, and under speculation the greedy answer is the masked target's step by step
(transformers' model and a matcher made outside the engine: test_structured.reference_greedy)."""

from __future__ import annotations

import json

import pytest
from test_structured import make_llm, models, reference_greedy  # noqa: F401 - models: the fixture

from helpers import make_tokenizer
from specdec import SamplingParams, StructuredOutputsParams
from specdec.models.tokenizer import Tokenizer
from specdec.spec.grammar import GrammarState

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TAG = {
    "structures": [
        {"begin": "<f=weather>", "schema": CITY, "end": "</f>"},
        {
            "begin": "<f=time>",
            "schema": {"type": "object", "properties": {}, "additionalProperties": False},
            "end": "</f>",
        },
        {"begin": "@n:", "schema": {"type": "integer"}, "end": ";"},
    ],
    "triggers": ["<f=", "@n"],
}
PARIS = '<f=weather>{"city": "Paris"}</f>'
ANSWERS = [
    ("Just words, a < and an @ or two, and <f at the end <f", True),
    (PARIS, True),
    ("Let me look. " + PARIS + " Done.", True),
    (PARIS + "<f=time>{}</f> and @n:42; more", True),
    ('<f=weather>{"city": 3}</f>', False),  # not the schema's
    ("<f=news>{}</f>", False),  # no such structure
    ("a tag left open " + '<f=weather>{"city": "Paris"}', False),
    (PARIS + " then <f=nope", False),  # a trigger must open a tag
    ("@n:4.5;", False),
]


def test_the_grammar_allows_exactly_its_answers():
    tokenizer = Tokenizer(make_tokenizer(320))
    for spec in (TAG, json.dumps(TAG), {"type": "structural_tag", **TAG}):
        params = StructuredOutputsParams(structural_tag=spec)
        for answer, allowed in ANSWERS:
            state = GrammarState(params, tokenizer, tokenizer.vocab_size, eos_token_ids=(1,))
            tokens = tokenizer.encode(answer, add_special_tokens=False)
            assert (state.valid_prefix(tokens + [1]) == len(tokens) + 1) == allowed, answer


@pytest.mark.parametrize(
    "spec, named",
    [
        ("{not json", "not JSON"),
        ({"structures": [], "triggers": ["<f="]}, "structures"),
        ({**TAG, "triggers": []}, "triggers"),
        ({**TAG, "triggers": ["<f=", "@n", "#"]}, r"\[.#.\] begin no structure"),
        ({**TAG, "structures": [{"begin": "x", "schema": CITY, "end": "y"}]}, "starts with none of the triggers"),
        ({**TAG, "structures": [{"begin": "<f=a", "schema": "no", "end": "y"}]}, "schema"),
        ({**TAG, "extra": 1}, "extra"),
    ],
)
def test_a_malformed_tag_is_refused_by_name(spec, named):
    with pytest.raises(ValueError, match=named):
        StructuredOutputsParams(structural_tag=spec)


@pytest.mark.parametrize("drafter", ["alone", "chain", "lookup"])
def test_greedy_equals_the_masked_target_step_by_step(models, drafter):  # noqa: F811 - the fixture
    """A tag the tiny model opens: its trigger the text of a token of its free answer (the first
    all letters, found nowhere before it), after which an integer and ";" must come."""
    llm = make_llm(models, drafter)
    (eos,) = llm.target.eos_token_ids
    prompt = [40, 41, 42, 43, 44, 40, 41, 42]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
    texts = [llm.tokenizer.decode([token]) for token in free]
    trigger = next(
        text
        for i, text in enumerate(texts)
        if text.isascii() and text.isalpha() and text not in "".join(texts[: i + 1])[: -len(text)]
    )
    tag = {"structures": [{"begin": trigger, "schema": {"type": "integer"}, "end": ";"}], "triggers": [trigger]}
    params = StructuredOutputsParams(structural_tag=tag)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=params))[0]
    assert got.outputs[0].token_ids == reference_greedy(models, prompt, params, eos, 40)
    parts = got.outputs[0].text.split(trigger)
    assert len(parts) > 1  # the tag was opened
    for part in parts[1:-1]:
        assert part.split(";")[0].lstrip("-").isdigit()  # each tag holds an integer
