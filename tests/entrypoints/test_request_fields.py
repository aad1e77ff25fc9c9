"""No request field that changes the output is silently ignored (serve/request_fields.py): every
field the official openai client can send is taken, refused or ignored; every refused field is
refused by name at a value that changes something and accepted at the API's default; fields no
list knows are refused. The defaults are OpenAI's and vLLM's own (its OpenAI server's request
models)."""

from __future__ import annotations

import json
import random
import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from specdec.serve import request_fields
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest
from specdec.serve.request_fields import CHAT, COMPLETIONS, IGNORED, REFUSED

REQUESTS = {
    COMPLETIONS: (CompletionRequest, {"prompt": "hi"}),
    CHAT: (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
}
CLIENT_FIELDS = {
    COMPLETIONS: set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | {"stream"},
    CHAT: set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase)) | {"stream"},
}

# each refused field's default in OpenAI's API or vLLM's request models: a value that changes nothing
API_DEFAULTS = {
    "functions": None,
    "function_call": "none",
    "audio": None,
    "modalities": ["text"],
    "reasoning_effort": None,
    "verbosity": None,
    "web_search_options": None,
    "moderation": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "guided_decoding_backend": None,
    "chat_template": None,
    "mm_processor_kwargs": None,
    "prompt_embeds": None,
    "vllm_xargs": None,
    "include_reasoning": True,
}

# values that change the output (or the answer's shape), by field
CHANGING = {
    "length_penalty": [0.5, 2],
    "functions": [[{"name": "f"}]],
    "function_call": ["auto", {"name": "f"}],
    "audio": [{"voice": "alloy", "format": "wav"}],
    "modalities": [["text", "audio"], ["audio"]],
    "reasoning_effort": ["low", "high"],
    "verbosity": ["low"],
    "web_search_options": [{}, {"search_context_size": "low"}],  # {}: search with the defaults
    "moderation": ["auto", {"enabled": True}],
    "use_beam_search": [True],
    "spaces_between_special_tokens": [False],
    "logits_processors": [["my.Processor"]],
    "guided_decoding_backend": ["xgrammar", "outlines"],
    "chat_template": ["{{ messages[0].content }}"],
    "mm_processor_kwargs": [{"num_crops": 4}],
    "prompt_embeds": ["AAAA"],
    "vllm_xargs": [{"k": 1}],
    "include_reasoning": [False],
}


def refused(endpoint: str, **fields) -> list[str]:
    """The fields a request to endpoint with these fields (beside its required ones) gets refused for."""
    model, required = REQUESTS[endpoint]
    body = model.model_validate({**required, **fields})
    return [name for name, _ in body.refused()]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_every_field_the_openai_client_sends_is_taken_refused_or_ignored(endpoint):
    model, _ = REQUESTS[endpoint]
    known = set(model.model_fields) | set(REFUSED) | set(IGNORED)
    assert CLIENT_FIELDS[endpoint] - known == set()


def test_the_lists_do_not_overlap_and_each_refused_field_is_tested():
    taken = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert not (taken & set(REFUSED)) and not (taken & set(IGNORED)) and not (set(REFUSED) & set(IGNORED))
    assert set(API_DEFAULTS) == set(REFUSED) == set(CHANGING)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_refused_by_name_unless_it_changes_nothing(endpoint, name):
    assert refused(endpoint, **{name: API_DEFAULTS[name]}) == []
    assert refused(endpoint, **{name: None}) == []  # JSON null: the API's default
    for value in CHANGING[name]:
        assert refused(endpoint, **{name: value}) == [name], value


def test_a_bool_is_not_taken_for_a_number():
    assert refused(COMPLETIONS, length_penalty=True) == ["length_penalty"]
    assert refused(COMPLETIONS, use_beam_search=0) == ["use_beam_search"]


def test_add_special_tokens_is_taken_at_both_endpoints():
    for endpoint in (COMPLETIONS, CHAT):
        assert refused(endpoint, add_special_tokens=True) == refused(endpoint, add_special_tokens=False) == []


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_ignored_fields_are_accepted_with_any_value(endpoint):
    rng = random.Random(3)
    for name in IGNORED:
        value = rng.choice(["x", 7, True, {"a": "b"}, ["x"], None])
        assert refused(endpoint, **{name: value}) == [], name


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_field_no_list_knows_is_refused_by_name(endpoint):
    rng = random.Random(5)
    name = "".join(rng.choice("abcdefghij_") for _ in range(12)) + "_x"
    assert refused(endpoint, **{name: 1}) == [name]
    assert refused(endpoint, **{name: None, "user": "u"}) == [name]  # even null: what it means is unknown


def test_several_refused_fields_are_named_together_in_the_order_sent():
    model, required = REQUESTS[CHAT]
    body = model.model_validate({**required, "suffix": "}", "user": "u", "vllm_xargs": {"k": 1}, "nope": 1})
    problems = body.refused()
    assert [name for name, _ in problems] == ["suffix", "vllm_xargs", "nope"]
    assert all(message.startswith(name) for name, message in problems)


def test_taken_fields_at_their_defaults_and_values_are_not_refused():
    assert refused(COMPLETIONS, temperature=0.0, top_k=5, min_p=0.1, stop=["x"], seed=1, logprobs=2, n=1) == []
    assert refused(COMPLETIONS, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"3": -100}, min_tokens=2) == []
    assert refused(CHAT, repetition_penalty=1.2) == []
    assert refused(CHAT, logprobs=True, top_logprobs=3, max_completion_tokens=4, add_generation_prompt=True) == []


def test_a_chat_message_keeps_its_fields_for_the_template():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "tool", "content": [{"type": "text", "text": "4"}], "tool_call_id": "c1", "name": "add"}
            ]
        }
    )
    assert body.messages[0].template_fields() == {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"}


def test_messages_name_the_value_and_what_to_do():
    ((_, message),) = request_fields.problems({"guided_decoding_backend": "xgrammar"}, set(), CHAT)
    assert "guided_decoding_backend='xgrammar'" in message and "llguidance" in message


# --- structured output's fields -------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


@pytest.mark.parametrize(
    "fields, want",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"json": SCHEMA},
        ),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ("yes", "no")}),
        ({"guided_grammar": 'start: "a"+'}, {"grammar": 'start: "a"+'}),
        ({"structured_outputs": {"choice": ["a"], "disable_fallback": False}}, {"choice": ("a",)}),
        ({"response_format": {"type": "structural_tag", **TAG}}, {"structural_tag": {"type": "structural_tag", **TAG}}),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, {"structural_tag": json.dumps(TAG)}),
        ({"structural_tag": json.dumps(TAG)}, {"structural_tag": json.dumps(TAG)}),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, {"json": SCHEMA, "whitespace_pattern": " ?"}),
        ({"guided_whitespace_pattern": " ?"}, None),  # no JSON asked for: it changes nothing
    ],
)
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_structured_output_fields_become_structured_outputs_params(endpoint, fields, want):
    from specdec import StructuredOutputsParams

    model, required = REQUESTS[endpoint]
    body = model.model_validate({**required, **fields})
    assert body.refused() == []
    params = body.sampling_params(8).structured_outputs
    assert params == (None if want is None else StructuredOutputsParams(**want))


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex and guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"structural_tag": '{"structures": [], "triggers": ["<f"]}'}, "structural_tag"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_structured_output_said_wrongly_is_a_value_error_that_names_the_field(fields, named):
    model, required = REQUESTS[CHAT]
    body = model.model_validate({**required, **fields})
    with pytest.raises(ValueError, match=named):
        body.sampling_params(8)
