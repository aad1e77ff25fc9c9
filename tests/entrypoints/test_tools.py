"""Tool calls (serve/tools.py): the grammar each tool_choice makes lets through exactly the
answers it should (checked by llguidance's matcher over real tokenizations, with the tags as
tokens of their own as in Qwen2.5's tokenizer, and spelled out in text as elsewhere); answers are
read back into OpenAI's shapes, arguments validated against the schema by jsonschema; a stream fed
in random pieces gives the same content and calls as the whole answer; bad tool fields are
refused by name."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tokenizers import AddedToken

from helpers import make_tokenizer
from specdec.models.tokenizer import Tokenizer
from specdec.serve.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolCallStream,
    ToolError,
    format_for,
    parse,
    template_messages,
    tool_choice_from,
)
from specdec.spec.grammar import GrammarState

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PARIS, ROME = call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome", "days": 3})
NOW = call("get_time", {})
# (answer, the tool_choice settings that allow it): auto, required, named get_weather, one call at most
ANSWERS = [
    ("Just words, and a < or two.", {"auto", "auto-single"}),
    (PARIS, {"auto", "required", "named", "auto-single", "required-single"}),
    ("Let me look.\n" + PARIS, {"auto", "auto-single"}),
    (PARIS + "\n" + ROME, {"auto", "required"}),
    (PARIS + "\n" + NOW, {"auto", "required"}),
    (NOW, {"auto", "required", "auto-single", "required-single"}),
    (call("get_weather", {"town": "Paris"}), set()),  # not the schema's
    (call("get_weather", {"city": 3}), set()),
    (call("get_news", {}), set()),  # no such tool
    (PARIS + " and some words after", set()),
]
CHOICES = {
    "auto": ("auto", None),
    "required": ("required", None),
    "named": ({"type": "function", "function": {"name": "get_weather"}}, None),
    "auto-single": ("auto", False),
    "required-single": ("required", False),
}


@pytest.fixture(scope="module", params=["tags as tokens", "tags as text"])
def tokenizer(request):
    backend = make_tokenizer(320)
    if request.param == "tags as tokens":  # as Qwen2.5's tokenizer has them: added, not special
        backend.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
        assert backend.token_to_id("<tool_call>") is not None
    return Tokenizer(backend)


@pytest.mark.parametrize("choice", CHOICES)
def test_each_tool_choices_grammar_allows_exactly_its_answers(tokenizer, choice):
    tool_choice, parallel = CHOICES[choice]
    structured = tool_choice_from(TOOLS, tool_choice, parallel).structured_outputs(tokenizer)
    assert structured is not None
    for answer, allowed_by in ANSWERS:
        state = GrammarState(structured, tokenizer, tokenizer.vocab_size, eos_token_ids=(1,))
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        allowed = state.valid_prefix(tokens + [1]) == len(tokens) + 1  # the answer, then EOS
        assert allowed == (choice in allowed_by), (choice, answer)


def test_tool_choice_none_renders_no_tools_and_holds_nothing(tokenizer):
    none = tool_choice_from(TOOLS, "none", None)
    assert none is not None and none.template_tools is None and none.structured_outputs(tokenizer) is None
    assert tool_choice_from(TOOLS, None, None).template_tools == TOOLS  # auto: the template gets them


def test_answers_are_read_back_in_openais_shapes():
    for answer, allowed_by in ANSWERS:
        if not allowed_by:
            continue
        content, calls = parse(answer)
        expected_text = answer.split("<tool_call>")[0].strip()
        assert content == (expected_text or None)
        assert [c["type"] for c in calls] == ["function"] * answer.count("<tool_call>")
        assert len({c["id"] for c in calls}) == len(calls) and all(c["id"].startswith("call_") for c in calls)
        for c in calls:
            schema = next(t for t in TOOLS if t["function"]["name"] == c["function"]["name"])["function"]["parameters"]
            jsonschema.validate(json.loads(c["function"]["arguments"]), schema)
    assert parse("no calls at all\n") == ("no calls at all\n", [])  # a plain answer keeps its text as it is
    content, calls = parse(PARIS + '\n<tool_call>\n{"name": "get_we')  # cut short by max_tokens
    assert content is None and len(calls) == 1


@pytest.mark.parametrize("seed", range(4))
def test_a_stream_in_random_pieces_gives_the_whole_answers_content_and_calls(seed):
    rng = random.Random(seed)
    for answer, allowed_by in ANSWERS:
        if not allowed_by:
            continue
        stream, deltas, start = ToolCallStream(), [], 0
        while start < len(answer):
            end = min(len(answer), start + rng.randint(1, 9))
            deltas += stream.feed(answer[start:end], final=end == len(answer))
            start = end
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        whole_content, whole_calls = parse(answer)
        assert content.strip() == (whole_content or "")
        assert [c["index"] for c in calls] == list(range(len(whole_calls)))
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
        assert all(set(d) in ({"content"}, {"tool_calls"}) for d in deltas)


def test_an_assistants_earlier_calls_reach_the_template_as_objects():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    rendered = template_messages(messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[0] == messages[0] and rendered[2] == messages[2]
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ToolError, match="not JSON"):
        template_messages(messages)


@pytest.mark.parametrize(
    "tools, tool_choice, field, message",
    [
        (None, "auto", "tool_choice", "needs tools"),
        ({"type": "function"}, None, "tools", "must be a list"),
        ([{"type": "retrieval"}], None, "tools", r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools", "non-empty"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools", "JSON schema"),
        ([WEATHER, WEATHER], None, "tools", "twice"),
        (TOOLS, "sometimes", "tool_choice", "must be none, auto"),
        (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice", "none of the tools"),
    ],
)
def test_bad_tool_fields_are_refused_by_name(tools, tool_choice, field, message):
    with pytest.raises(ToolError, match=message) as refused:
        tool_choice_from(tools, tool_choice, None)
    assert refused.value.field == field


# --- Llama 3's format (llama3_json): the answer is the calls, {"name", "parameters"} joined by "; " ---


def llama_call(name: str, parameters: dict) -> str:
    return json.dumps({"name": name, "parameters": parameters})


L_PARIS, L_ROME = llama_call("get_weather", {"city": "Paris"}), llama_call("get_weather", {"city": "Rome", "days": 3})
L_NOW = llama_call("get_time", {})
LLAMA3_ANSWERS = [
    ("Just words, and a { or two.", {"auto", "auto-single"}),
    ("Let me look. " + L_PARIS, {"auto", "auto-single"}),  # text: a call only where the answer starts with one
    (L_PARIS, {"auto", "required", "named", "auto-single", "required-single"}),
    (L_PARIS + "; " + L_ROME, {"auto", "required"}),
    (L_PARIS + "; " + L_NOW, {"auto", "required"}),
    (L_NOW, {"auto", "required", "auto-single", "required-single"}),
    (llama_call("get_weather", {"town": "Paris"}), set()),
    (llama_call("get_weather", {"city": 3}), set()),
    (llama_call("get_news", {}), set()),
    (L_PARIS + " and some words after", set()),
    ('{"not": "a call"}', set()),
    (call("get_weather", {"city": "Paris"}), {"auto", "auto-single"}),  # hermes's tags: text here
]


@pytest.mark.parametrize("choice", CHOICES)
def test_each_tool_choices_llama3_grammar_allows_exactly_its_answers(choice):
    tokenizer = Tokenizer(make_tokenizer(320))
    tool_choice, parallel = CHOICES[choice]
    structured = tool_choice_from(TOOLS, tool_choice, parallel, LLAMA3_JSON).structured_outputs(tokenizer)
    assert structured is not None
    for answer, allowed_by in LLAMA3_ANSWERS:
        state = GrammarState(structured, tokenizer, tokenizer.vocab_size, eos_token_ids=(1,))
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        allowed = state.valid_prefix(tokens + [1]) == len(tokens) + 1
        assert allowed == (choice in allowed_by), (choice, answer)


@pytest.mark.parametrize("seed", range(4))
def test_llama3_answers_read_back_whole_and_streamed_in_random_pieces(seed):
    rng = random.Random(seed)
    choice = tool_choice_from(TOOLS, "auto", None, LLAMA3_JSON)
    assert choice is not None
    for answer, allowed_by in LLAMA3_ANSWERS:
        if not allowed_by:
            continue
        content, calls = choice.parse(answer)
        if answer.startswith("{"):
            assert content is None and [c["function"]["name"] for c in calls] == [
                json.loads(part)["name"] for part in answer.split("; ")
            ]
            for c in calls:
                parameters = json.loads(c["function"]["arguments"])
                schema = next(t for t in TOOLS if t["function"]["name"] == c["function"]["name"])["function"]
                jsonschema.validate(parameters, schema["parameters"])
        else:
            assert (content, calls) == (answer, [])
        stream, deltas, start = choice.stream(), [], 0
        while start < len(answer):
            end = min(len(answer), start + rng.randint(1, 9))
            deltas += stream.feed(answer[start:end], final=end == len(answer))
            start = end
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        streamed = [c for d in deltas for c in d.get("tool_calls", ())]
        assert [c["index"] for c in streamed] == list(range(len(calls)))
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    cut = choice.parse(L_PARIS + '; {"name": "get_ti')  # cut short by max_tokens: the whole calls
    assert cut[0] is None and [c["function"] for c in cut[1]] == [c["function"] for c in choice.parse(L_PARIS)[1]]


def test_the_format_is_the_one_the_chat_template_teaches():
    qwen = '{% for tool in tools %}...{% endfor %}<tool_call>\n{"name": <function-name>, ...}\n</tool_call>'
    llama = (
        '{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.{% endif %}<|start_header_id|>ipython<|end_header_id|>"
    )
    assert [format_for(t) for t in (qwen, llama, "{{ messages }}", None)] == [HERMES, LLAMA3_JSON, HERMES, HERMES]


def test_the_server_takes_the_format_of_its_flag_else_of_the_chat_template():
    from types import SimpleNamespace

    from specdec.serve.app import ServerState

    def state(template, flag="auto"):
        engine = SimpleNamespace(llm=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template)))
        return ServerState(engine, ["m"], 64, tool_call_parser=flag)  # pyright: ignore[reportArgumentType]

    llama = '{"name": function name, "parameters": ...} <|start_header_id|>ipython'
    assert state(llama).tool_format == LLAMA3_JSON and state("<tool_call>").tool_format == HERMES
    assert state(llama, HERMES).tool_format == HERMES and state(None, LLAMA3_JSON).tool_format == LLAMA3_JSON
