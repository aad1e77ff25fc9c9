"""specdec serve, as a real server process on a free port, driven by the official openai
client (and raw HTTP for what the client will not send): completions and chat, streamed and
not, greedy float32 outputs identical to LLM.generate offline; a client that disconnects
mid-stream frees its slot; every bad request gets an OpenAI-style error and the server keeps
serving; the API key; a full queue answers 429; SIGTERM ends it with exit code 0. And what a
hostile client tried (issue 30): a body too large for the server is a 413 at once, a long prompt
holds up no other client, a lone surrogate is a 400, an unknown model a 404, requests still
running past --shutdown-timeout hear why they end."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from helpers import HealthWatch, assert_drains, save_tiny_model
from specdec import LLM, SamplingParams
from specdec.serve.process import ServerProcess

# slow: a server process per module (about a minute); alone: it times /health (under 1 s), with nothing beside it
pytestmark = [pytest.mark.slow, pytest.mark.alone]


CHAT_TEMPLATE = (
    "{% if tools %}<s>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CONTEXT = 2048
MODEL = "tiny"
ALIAS = "tiny-alias"  # the model's second name (--served-model-name MODEL ALIAS)


class Server(ServerProcess):
    """specdec serve on the tiny model, float32, eager, served as MODEL (and ALIAS), unless
    names says otherwise (() for the default name)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, names=(MODEL, ALIAS)):
        named = ["--served-model-name", *names] if names else []
        super().__init__([*args, "--compile", "off", "--dtype", "float32", *named], log_path, env)

    def client(self, api_key: str = "none", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    dirs = {
        name: save_tiny_model(
            root / name,
            "llama",
            seed=seed,
            init_std=0.3,
            max_position_embeddings=CONTEXT,
            **({"num_hidden_layers": 1} if name == "draft" else {}),
        )
        for name, seed in (("target", 11), ("draft", 12))
    }
    config_path = dirs["target"] / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": CHAT_TEMPLATE}))
    return dirs


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    server = Server(
        [str(dirs["target"]), "--draft", str(dirs["draft"]), "-k", "4", "--max-num-seqs", "4"],
        tmp_path_factory.mktemp("log") / "server.log",
    )
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def offline(dirs):
    return LLM(str(dirs["target"]), speculative_model=str(dirs["draft"]), num_speculative_tokens=4, dtype="float32")


def test_completions_are_what_generate_gives_offline(server, offline):
    client = server.client()
    for prompt, max_tokens in (("def add(a, b):", 30), ("class Point:\n", 12)):
        want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), max_tokens)
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want.outputs[0].text
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2  # streamed in pieces
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens


def test_n_completions_and_echo_in_openais_shapes(server, offline):
    """n: prompt i's completion j is choice i x n + j, each what LLM.generate gives with n (a
    seeded request: completion j drawn from seed + j), whole and streamed alike; echo puts the
    prompt before each choice's text; chat's n choices likewise, each with its role, content and
    finish reason in the stream."""
    client = server.client()
    prompts = ["def add(a, b):", "class Point:\n"]
    params = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=3, n=3)
    want = [[c.text for c in out.outputs] for out in offline.generate(prompts, params)]
    assert len({*want[0]}) > 1  # sampled apart
    fields = dict(model=MODEL, prompt=prompts, max_tokens=10, temperature=0.9, seed=3, n=3, echo=True)
    got = client.completions.create(**fields, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [p + text for p, texts in zip(prompts, want) for text in texts]
    assert got.usage.completion_tokens == 6 * 10
    chunks = list(client.completions.create(**fields, extra_body={"ignore_eos": True}, stream=True))
    streamed = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in got.choices]
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == list(range(6))

    messages = [{"role": "user", "content": "hi"}]
    chat_want = [c.text for c in offline.chat(messages, params)[0].outputs]
    chat_fields = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.9, seed=3, n=3)
    chat = client.chat.completions.create(**chat_fields, extra_body={"ignore_eos": True})
    assert [(c.index, c.message.role, c.message.content) for c in chat.choices] == [
        (j, "assistant", text) for j, text in enumerate(chat_want)
    ]
    chat_chunks = list(client.chat.completions.create(**chat_fields, extra_body={"ignore_eos": True}, stream=True))
    roles, contents, reasons = {}, [""] * 3, {}
    for chunk in chat_chunks:
        (choice,) = chunk.choices
        roles.setdefault(choice.index, choice.delta.role)
        contents[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert roles == dict.fromkeys(range(3), "assistant") and contents == chat_want
    assert reasons == dict.fromkeys(range(3), "length")
    echoed = client.chat.completions.create(
        model=MODEL,
        messages=[*messages, {"role": "assistant", "content": "Sure"}],
        max_tokens=4,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    assert echoed.choices[0].message.content.startswith("Sure")


def test_echo_with_logprobs_and_prompt_logprobs(server, offline):
    """echo with logprobs: the prompt's tokens first in the choice's logprobs (the first one's
    null), then the completion's, each what LLM.generate gives with prompt_logprobs and
    logprobs, whole and streamed; vLLM's prompt_logprobs field, in completions' choices and at
    the top of a chat answer."""
    client = server.client()
    prompt = "def add(a, b):"
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = offline.generate(prompt, params)[0]
    length = len(want.prompt_token_ids)
    expected = [entry.logprob for entry in want.prompt_logprobs[1:] + want.outputs[0].logprobs]
    fields = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    got = client.completions.create(**fields, extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    (choice,) = got.choices
    logprobs = choice.logprobs
    assert choice.text == prompt + want.outputs[0].text
    assert len(logprobs.tokens) == length + 5 and logprobs.text_offset[0] == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs[1:])  # the top 2, and the token's own
    vllm = choice.model_extra["prompt_logprobs"]
    assert len(vllm) == length and vllm[0] is None
    for token_id, entry, shaped in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], vllm[1:]):
        assert shaped[str(token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert shaped[str(token_id)]["rank"] == entry.rank >= 1 and len(shaped) in (2, 3)
    chunks = list(client.completions.create(**fields, extra_body={"ignore_eos": True}, stream=True))
    streamed = [item for chunk in chunks for item in chunk.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text

    # echo with max_tokens 0 (lm-evaluation-harness's scoring): the prompt and its logprobs alone
    for stream in (False, True):
        answer = client.completions.create(**{**fields, "max_tokens": 0}, stream=stream)
        (alone,) = [chunk.choices[0] for chunk in answer] if stream else answer.choices
        assert (alone.text, alone.finish_reason) == (prompt, "length")
        assert alone.logprobs.token_logprobs[0] is None and len(alone.logprobs.tokens) == length
        assert alone.logprobs.token_logprobs[1:] == pytest.approx(expected[: length - 1], abs=1e-4)
        assert all(len(top) in (2, 3) for top in alone.logprobs.top_logprobs[1:])
    assert client.completions.create(**{**fields, "max_tokens": 0}).usage.completion_tokens == 0

    messages = [{"role": "user", "content": "hi"}]
    chat_ids = offline.chat_token_ids(messages)
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, extra_body={"prompt_logprobs": 0}
    )
    shaped = chat.model_extra["prompt_logprobs"]
    assert len(shaped) == len(chat_ids) and shaped[0] is None
    assert [list(entry)[0] for entry in shaped[1:]] == [str(token_id) for token_id in chat_ids[1:]]


def test_vllms_prompt_and_answer_fields(server, offline):
    """truncate_prompt_tokens (the prompt's last k tokens), return_token_ids (the prompt's and the
    answer's token ids, whole and streamed), include_stop_str_in_output (the text through the stop
    string) and chat_template_kwargs (reserved names refused), each as LLM.generate gives it."""
    client = server.client()
    ids = list(range(40, 60))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = offline.generate([ids[-5:]], greedy)[0].outputs[0]
    fields = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    extra = {"ignore_eos": True, "truncate_prompt_tokens": 5, "return_token_ids": True}
    got = client.completions.create(**fields, extra_body=extra)
    (choice,) = got.choices
    assert got.usage.prompt_tokens == 5 and choice.text == want.text
    assert (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]) == (ids[-5:], want.token_ids)
    chunks = [chunk.choices[0] for chunk in client.completions.create(**fields, extra_body=extra, stream=True)]
    assert chunks[0].model_extra["prompt_token_ids"] == ids[-5:]
    assert [t for c in chunks for t in c.model_extra.get("token_ids", [])] == want.token_ids

    plain_ids = offline.tokenizer.encode("def f():", add_special_tokens=False)  # add_special_tokens: no BOS
    bare = client.completions.create(
        model=MODEL, prompt="def f():", max_tokens=6, temperature=0, extra_body={"add_special_tokens": False}
    )
    assert bare.usage.prompt_tokens == len(plain_ids) == len(offline.tokenizer.encode("def f():")) - 1
    assert (
        bare.choices[0].text
        == offline.generate([plain_ids], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    )

    named = client.completions.create(**fields, logprobs=1, extra_body={**extra, "return_tokens_as_token_ids": True})
    assert named.choices[0].logprobs.tokens == [f"token_id:{token}" for token in want.token_ids]

    stop = want.text[3:6]
    cut = client.completions.create(**fields, stop=[stop], extra_body={**extra, "include_stop_str_in_output": True})
    assert cut.choices[0].text == want.text[: want.text.index(stop) + len(stop)]

    messages = [{"role": "user", "content": "hi"}]
    chat_want = offline.chat(messages, greedy)[0].outputs[0]
    chat_extra = {"ignore_eos": True, "return_token_ids": True, "chat_template_kwargs": {"flavour": "plain"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=chat_extra
    )
    assert chat.model_extra["prompt_token_ids"] == offline.chat_token_ids(messages)
    assert chat.choices[0].model_extra["token_ids"] == chat_want.token_ids
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}}
        )
    assert refused.value.body["param"] == "chat_template_kwargs"  # pyright: ignore[reportIndexIssue, reportOptionalSubscript]

    started = [*messages, {"role": "assistant", "content": "Sure, here"}]  # continue_final_message: go on with it
    prompt = offline.chat_token_ids(started, False, continue_final_message=True)
    go_on = client.chat.completions.create(
        model=MODEL,
        messages=started,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert go_on.choices[0].message.content == offline.generate([prompt], greedy)[0].outputs[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=started, max_tokens=2, extra_body={"continue_final_message": True}
        )
    assert refused.value.body["param"] == "continue_final_message"  # pyright: ignore[reportIndexIssue, reportOptionalSubscript]


def test_best_of_answers_the_completions_likeliest_per_token(server, offline):
    """best_of 4, n 2: the two of LLM.generate's four seeded completions of the highest mean
    logprob, the likeliest first, without logprobs where none were asked; every completion made
    counted in usage."""
    client = server.client()
    prompt = "def add(a, b):"
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5, n=4, logprobs=0)
    made = offline.generate(prompt, params)[0].outputs
    per_token = {c.text: sum(e.logprob for e in c.logprobs) / len(c.logprobs) for c in made}
    assert len(set(per_token.values())) == 4  # four different completions
    want = sorted(per_token, key=per_token.__getitem__, reverse=True)[:2]
    fields = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=2, best_of=4)
    got = client.completions.create(**fields, extra_body={"ignore_eos": True})
    assert [(c.index, c.text, c.logprobs) for c in got.choices] == [(0, want[0], None), (1, want[1], None)]
    assert got.usage.completion_tokens == 4 * 8
    with_logprobs = client.completions.create(**fields, logprobs=1, extra_body={"ignore_eos": True})
    assert [c.text for c in with_logprobs.choices] == want
    assert all(len(c.logprobs.token_logprobs) == 8 for c in with_logprobs.choices)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_tool_calls_in_openais_shapes_with_arguments_held_to_the_schema(server):
    """tools with tool_choice named, required (one call at most) and auto: the tools reach the
    chat template; every call names a given function, its arguments valid under its parameters
    (jsonschema); the stream's tool_call deltas join into the whole answer's calls."""
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    common = dict(model=MODEL, messages=messages, tools=tools, max_tokens=120, temperature=0)
    plain = client.chat.completions.create(**{**common, "tool_choice": "none"})
    cases = [
        ({"type": "function", "function": {"name": "get_weather"}}, {}, "stop"),
        ("required", {"parallel_tool_calls": False}, "tool_calls"),
        ("auto", {}, None),
    ]
    for tool_choice, extra, reason in cases:
        whole = client.chat.completions.create(**common, tool_choice=tool_choice, **extra)
        assert whole.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tools
        (choice,) = whole.choices
        calls = choice.message.tool_calls or []
        if reason is not None:
            assert choice.finish_reason == reason and len(calls) == 1 and choice.message.content is None
        if tool_choice != "auto":
            assert calls, choice
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if isinstance(tool_choice, dict):
            assert calls[0].function.name == "get_weather"
        chunks = list(client.chat.completions.create(**common, tool_choice=tool_choice, **extra, stream=True))
        streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
        ]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert content == (choice.message.content or "")
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [choice.finish_reason]
    with pytest.raises(openai.BadRequestError, match="none of the tools"):
        client.chat.completions.create(**common, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="both say what the output must follow"):
        client.chat.completions.create(**common, tool_choice="required", response_format={"type": "json_object"})


def test_penalties_and_logit_bias_are_what_generate_gives_offline(server, offline):
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty and min_tokens: honoured, the
    answer the one LLM.generate gives with the same SamplingParams (and not the one without)."""
    client = server.client()
    prompt, max_tokens = "def add(a, b):", 20
    token = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    plain = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    for fields in (
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"logit_bias": {str(token): -100}},
        {"extra_body": {"repetition_penalty": 1.5, "min_tokens": 3}},
    ):
        extra = fields.get("extra_body", {})
        sent = {name: value for name, value in fields.items() if name != "extra_body"}
        params = {**sent, **extra}
        if "logit_bias" in params:
            params["logit_bias"] = {int(key): bias for key, bias in params["logit_bias"].items()}
        want = offline.generate(
            prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        )[0]
        got = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
            **sent,
        )
        assert got.choices[0].text == want.outputs[0].text, fields
        assert want.outputs[0].token_ids != plain.outputs[0].token_ids, fields  # the processors changed it


def test_structured_output_is_what_generate_gives_offline(server, offline):
    """response_format, vLLM's guided_choice and structured_outputs: the answer LLM.generate gives
    with the same StructuredOutputsParams, following its grammar; a schema that is none is a 400
    that names the field."""
    from specdec import StructuredOutputsParams

    client = server.client()
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "is it?"}]
    cases = [
        (
            {"extra_body": {"guided_choice": ["yes", "no"]}},
            StructuredOutputsParams(choice=["yes", "no"]),
            lambda text: text in ("yes", "no"),
        ),
        (
            {"extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}},
            StructuredOutputsParams(json=schema, disable_any_whitespace=True),
            lambda text: json.loads(text) in ({"ok": True}, {"ok": False}),
        ),
        (
            {"extra_body": {"guided_regex": "[0-9]{4}"}},
            StructuredOutputsParams(regex="[0-9]{4}"),
            lambda text: len(text) == 4 and text.isdigit(),
        ),
    ]
    for fields, params, follows in cases:
        want = offline.chat([messages], SamplingParams(temperature=0, max_tokens=30, structured_outputs=params))[0]
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0, **fields)
        assert got.choices[0].message.content == want.outputs[0].text, fields
        assert got.choices[0].finish_reason == "stop" and follows(want.outputs[0].text), fields
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        )
    assert "objekt" in str(bad.value)


def test_a_list_of_prompts_gets_a_choice_each(server, offline):
    prompts = ["def add(a, b):", "for i in range(10):"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(prompts, params)]
    got = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    chunks = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == want


def test_chat_is_what_llm_chat_gives_offline(server, offline):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    client = server.client()
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_seeded_sampling_and_per_request_k(server, offline):
    """A seeded sampled request gets what it gets offline; num_speculative_tokens=0 (extra body)
    turns speculation off for that request alone: no draft tokens counted for it."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    want = offline.generate("def add(a, b):", params)[0].outputs[0].text
    client = server.client()
    got = client.completions.create(
        model=MODEL,
        prompt="def add(a, b):",
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want
    drafted = server.metric("spec_decode_num_draft_tokens_total")
    plain = client.completions.create(
        model=MODEL,
        prompt="def add(a, b):",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "num_speculative_tokens": 0},
    )
    assert server.metric("spec_decode_num_draft_tokens_total") == drafted
    greedy = offline.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert plain.choices[0].text == greedy.outputs[0].text


def test_logprobs_are_what_generate_gives_offline(server, offline):
    prompt = "def add(a, b):"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))[0]
    want_logprobs = [entry.logprob for entry in want.outputs[0].logprobs]
    client = server.client()
    got = (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .logprobs
    )
    assert got.token_logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert len(got.tokens) == 12 and all(2 <= len(top) <= 3 for top in got.top_logprobs)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    chunks = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    streamed = [
        value
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs
        for value in choice.logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(want_logprobs, abs=1e-5)

    messages = [{"role": "user", "content": "add two numbers"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert [item.logprob for item in content] == pytest.approx([e.logprob for e in want.outputs[0].logprobs], abs=1e-5)
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_metrics_count_requests_tokens_and_speculation(server):
    before = {
        name: server.metric(name)
        for name in ("generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count")
    }
    server.client().completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert server.metric("generation_tokens_total") == before["generation_tokens_total"] + 24
    assert server.metric("request_success_total", finished_reason="length") >= 1
    assert server.metric("time_to_first_token_seconds_count") == before["time_to_first_token_seconds_count"] + 1
    assert server.metric("spec_decode_num_accepted_tokens_total") <= server.metric("spec_decode_num_draft_tokens_total")
    assert server.metric("spec_decode_num_accepted_tokens_per_pos_total", position="0") == server.metric(
        "spec_decode_num_accepted_tokens_per_pos_total", position="0"
    )  # the series exists
    rounds = server.metric("spec_decode_rounds_by_k_total")
    assert rounds > 0 and rounds >= server.metric("spec_decode_num_drafts_total")  # k = 0 rounds count too
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "spec_decode_num_drafts_total",
        "prompt_tokens_total",
    ):
        assert f"specdec:{name}" in httpx.get(f"{server.url}/metrics").text


def test_metrics_count_the_prefix_cache_and_the_cache_in_use(server):
    """Two requests with one long prompt, one after the other: the second finds its whole
    blocks (short of its last token) in the prefix cache; the counters count tokens, as vLLM's."""
    prompt = "def add(a, b):\n    return a + b\n\n" * 12
    before = (server.metric("prefix_cache_queries_total"), server.metric("prefix_cache_hits_total"))
    client = server.client()
    for _ in range(2):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    num_prompt_tokens = done.usage.prompt_tokens
    assert server.metric("prefix_cache_queries_total") == before[0] + 2 * num_prompt_tokens
    hits = server.metric("prefix_cache_hits_total") - before[1]
    assert hits == (num_prompt_tokens - 1) // 16 * 16
    assert 0 <= server.metric("kv_cache_usage_perc") <= 1
    assert "specdec:num_preemptions_total" in httpx.get(f"{server.url}/metrics").text


def test_a_client_that_disconnects_mid_stream_is_aborted(server):
    before = server.metric("generation_tokens_total")
    body = {
        "model": MODEL,
        "prompt": "def add(a, b):",
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert data and server.metric("num_requests_running") == 1
    deadline = time.monotonic() + 10
    while server.metric("num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0
    assert server.metric("generation_tokens_total") - before < 1900  # stopped, not run to the end


def test_a_client_that_gives_up_on_a_whole_completion_is_aborted(server):
    before = server.metric("generation_tokens_total")
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while server.metric("num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0
    assert server.metric("generation_tokens_total") - before < 1900


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', None),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("temperature < 0", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("top_p 0", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("prompt too long", {"model": MODEL, "prompt": "def add(a, b): " * 600, "max_tokens": 4}, None),
    ("max_tokens past the context", {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT}, None),
    ("n 0", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("n over 128", {"model": MODEL, "prompt": "hi", "n": 129}, "n"),
    ("suffix, and no FIM tokens", {"model": MODEL, "prompt": "def f():", "suffix": "\n}"}, "suffix"),
    ("suffix after token ids", {"model": MODEL, "prompt": [5, 6], "suffix": "\n}"}, "suffix"),
    ("prompt_logprobs over 20", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("logprobs over 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("penalty past 2", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("vLLM's penalty 0", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("min_tokens > max_tokens", {"model": MODEL, "prompt": "hi", "min_tokens": 4, "max_tokens": 2}, "min_tokens"),
    ("logit_bias of no token", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias outside the vocabulary", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, None),
    ("best_of below n", {"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("best_of over 128", {"model": MODEL, "prompt": "hi", "best_of": 129}, "best_of"),
    ("best_of streamed", {"model": MODEL, "prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ("guided_json of no schema", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "objekt"}}, None),
    (
        "two structured outputs",
        {"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]},
        "guided_regex",
    ),
    ("a field no list knows", {"model": MODEL, "prompt": "hi", "temprature": 0}, "temprature"),
    ("no prompt", {"model": MODEL}, "prompt"),
    ("prompt of wrong type", {"model": MODEL, "prompt": {"text": "hi"}}, "prompt"),
    ("token id outside the vocabulary", {"model": MODEL, "prompt": [5, 99999]}, None),
    ("negative k", {"model": MODEL, "prompt": "hi", "num_speculative_tokens": -1}, "num_speculative_tokens"),
]


@pytest.mark.parametrize("name, body, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, name, body, param):
    if isinstance(body, bytes):
        response = httpx.post(
            f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError):  # the client sees it as OpenAI's own
        server.client().completions.create(model=MODEL, prompt="hi", n=0)
    ok = server.client().completions.create(model=MODEL, prompt="def", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_chat_bad_requests(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=CONTEXT)
    no_schema = {"type": "json_schema", "json_schema": {"name": "x", "strict": True}}
    for fields in (
        {"response_format": no_schema},
        {"extra_body": {"structured_outputs": {"structural_tag": "x"}}},
        {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
        {"extra_body": {"guided_decoding_backend": "xgrammar"}},
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **fields)
        assert refused.value.body["param"] == next(iter(fields.get("extra_body", fields)))  # pyright: ignore[reportIndexIssue, reportOptionalSubscript]
    assert httpx.post(f"{server.url}/v1/nothing", json={}).status_code == 404


def test_fields_that_cannot_change_the_output_are_accepted_and_change_nothing(server):
    """user, metadata, store and vLLM's priority are taken and dropped, as OpenAI and vLLM take
    them; the answer is the one without them."""
    client = server.client()
    messages = [{"role": "user", "content": "def add(a, b):"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    tagged = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        user="someone",
        metadata={"job": "tests"},
        store=False,
        extra_body={"priority": 3, "request_id": "r1"},
    )
    assert tagged.choices[0].message.content == plain.choices[0].message.content


def test_the_model_goes_by_each_of_its_names_and_an_unknown_one_is_a_404(server, dirs):
    """/v1/models lists every --served-model-name; a request may give any, and the response
    carries the first, as in vLLM; a request that names no model gets the one served, as in
    vLLM; a model not served is OpenAI's 404 model_not_found, for completions and chat. Each
    entry says what the server speculates with and why."""
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    for model in models:  # what it speculates with, and why (a vLLM client ignores the extra field)
        assert model.to_dict()["speculation"] == {
            "method": "draft_model",
            "model": str(dirs["draft"]),
            "reason": "given by the server's flags",
        }
    assert client.completions.create(model=ALIAS, prompt="def", max_tokens=2).model == MODEL
    unnamed = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def", "max_tokens": 2})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL
    for create in (
        lambda: client.completions.create(model="gpt-5", prompt="hi"),
        lambda: client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(openai.NotFoundError, match="gpt-5") as caught:
            create()
        assert (caught.value.code, caught.value.param, caught.value.type) == (
            "model_not_found",
            "model",
            "invalid_request_error",
        )


SURROGATES = [  # (route, body as JSON text: \udc00 is a lone surrogate once parsed, where it is)
    (
        "chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi\\udc00"}]}',
        "messages[0].content",
    ),
    (
        "chat/completions",
        '{"model": "tiny", "messages": [{"role": "us\\udc00er", "content": "hi"}]}',
        "messages[0].role",
    ),
    (
        "chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
    ("completions", '{"model": "tiny", "prompt": "hi\\udc00"}', "prompt"),
    ("completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\udfff"]}', "stop[0]"),
]


@pytest.mark.parametrize("route, body, where", SURROGATES, ids=[where for _, _, where in SURROGATES])
def test_a_lone_surrogate_is_a_400_that_says_where(server, route, body, where):
    """Text no tokenizer can take (the chat routes answered 500), refused with its place. The
    openai client cannot send it (it encodes the body as UTF-8): raw HTTP."""
    response = httpx.post(
        f"{server.url}/v1/{route}", content=body.encode(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"{where} is not valid text: it holds a lone surrogate"), error
    assert (error["type"], error["param"]) == ("invalid_request_error", where.split("[")[0])
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage.completion_tokens >= 1  # and it still serves


def test_an_oversize_body_is_a_413_and_a_long_prompt_holds_up_no_other_client(server):
    """A 10 MB body (the server takes 2 MB at this context) is refused with a 413 before it is
    read, whether it says its length or comes in chunks; a 1 MB prompt within the limit is
    tokenized in a thread (seconds, for the tiny model's tokenizer) and refused for the context.
    All the while /health answers within a second: it used to wait 7-39 s."""
    client = server.client()
    with HealthWatch(server.url) as health:
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="def add(a, b): " * 700_000, max_tokens=4)
        assert caught.value.status_code == 413 and caught.value.code == "request_too_large"
        assert "more than this server takes (2,000,000 bytes, --max-request-bytes)" in caught.value.message
        chunks = (b"[" + b"5, " * 10_000 for _ in range(500))  # no Content-Length: sent chunked
        response = httpx.post(
            f"{server.url}/v1/completions", content=chunks, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "def add(a, b): " * 70_000}], max_tokens=4
            )
    assert len(health.statuses) >= 3 and set(health.statuses) == {200} and health.slowest < 1.0, (
        health.statuses,
        health.slowest,
    )


def test_requests_running_past_the_shutdown_timeout_hear_why_they_end(dirs, tmp_path):
    """Served from where `specdec fetch` puts smollm2 (.../smollm2/hf) with no name given: the
    API calls the model smollm2, never hf. SIGTERM with --shutdown-timeout 0 while two streams
    and a whole completion run: each stream ends with an OpenAI error event, then data: [DONE];
    the completion is a 503 in OpenAI's shape (it was a plain-text 500); the server exits 0."""
    fetched = tmp_path / "smollm2" / "hf"
    fetched.parent.mkdir()
    fetched.symlink_to(dirs["target"], target_is_directory=True)
    server = Server([str(fetched), "--max-num-seqs", "3", "--shutdown-timeout", "0"], tmp_path / "server.log", names=())
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        body = {"model": "smollm2", "prompt": "def", "max_tokens": CONTEXT - 8, "temperature": 0}
        errors: dict[str, Exception] = {}

        def run(kind: str) -> None:
            try:
                if kind == "stream":
                    list(client.completions.create(**body, stream=True, extra_body={"ignore_eos": True}))
                else:
                    client.completions.create(**body, extra_body={"ignore_eos": True})
            except openai.APIError as e:
                errors[kind] = e

        threads = [threading.Thread(target=run, args=(kind,)) for kind in ("stream", "whole")]
        for thread in threads:
            thread.start()
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "ignore_eos": True, "stream": True}, timeout=60
        ) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            deadline = time.monotonic() + 30
            while server.metric("num_requests_running") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.metric("num_requests_running") == 3
            server.process.send_signal(signal.SIGTERM)
            events = [line.removeprefix("data: ") for line in lines if line]
        for thread in threads:
            thread.join(timeout=60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "shutting_down") and "shutting down" in error[
            "message"
        ]
        assert isinstance(errors["stream"], openai.APIError) and "shutting down" in errors["stream"].message
        whole = errors["whole"]
        assert isinstance(whole, openai.InternalServerError) and whole.status_code == 503
        assert whole.code == "shutting_down" and whole.response.headers["content-type"] == "application/json"
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()


def test_learn_records_each_answer(dirs, tmp_path, capsys):
    """--learn DIR: each finished answer's token ids, as the tokenizer gives the prompt and the
    response's text, in DIR once the server stops; a second server on DIR is refused."""
    from specdec.cli import main
    from specdec.serve.recorder import read_requests

    learn = tmp_path / "learn"
    server = Server([str(dirs["target"]), "--learn", str(learn), "--max-num-seqs", "2"], tmp_path / "server.log")
    try:
        client = server.client()
        texts = [
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for prompt in ("def add(a, b):", "class Point:")
        ]
        assert main(["serve", str(dirs["target"]), "--learn", str(learn), "--compile", "off"]) == 2
        assert "another server (pid" in capsys.readouterr().err
    finally:
        assert server.stop() == 0, server.output()
    llm = LLM(str(dirs["target"]), dtype="float32", speculative_method="none")
    recorded = read_requests(learn)
    assert [(r["prompt"], r["finish_reason"]) for r in recorded] == [
        (llm.tokenizer.encode(prompt), "length") for prompt in ("def add(a, b):", "class Point:")
    ]
    assert [llm.tokenizer.decode(r["output"]) for r in recorded] == texts


def test_learn_swaps_in_each_new_head_version_and_refuses_a_damaged_one(dirs, tmp_path):
    """An EAGLE head drafting, --learn DIR: a version published into DIR/heads (another head of
    the same shape) is swapped in while the server runs (/metrics: draft_head_version 1, draft
    tokens counted by version), and the text stays the target's; a damaged version 2 is refused
    with a warning naming it, and version 1 drafts on."""
    import shutil

    from helpers import save_random_head
    from specdec.serve.head_store import HeadStore

    heads = [save_random_head(dirs["target"], tmp_path / f"head{seed}", seed=seed) for seed in (1, 2)]
    learn = tmp_path / "learn"
    args = [str(dirs["target"]), "--draft", str(heads[0]), "-k", "4", "--k-policy", "fixed", "--learn", str(learn)]
    server = Server(args, tmp_path / "server.log")
    store = HeadStore(learn)

    def publish(head: Path, damage: bool = False) -> None:
        with store.adapting() as candidate:
            shutil.copytree(head, candidate)
            if damage:
                (candidate / "head.safetensors").write_bytes(b"not a safetensors file")
            store.publish(candidate, {"by": "the test"})

    def wait_for_version(version: int) -> None:
        deadline = time.monotonic() + 60
        while server.metric("draft_head_version") != version:
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.5)

    body = dict(model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    try:
        client = server.client()
        first = client.completions.create(**body).choices[0].text
        assert server.metric("spec_decode_num_draft_tokens_by_head_total", head_version="0") > 0
        publish(heads[1])
        wait_for_version(1)
        assert client.completions.create(**body).choices[0].text == first
        assert server.metric("spec_decode_num_draft_tokens_by_head_total", head_version="1") > 0
        publish(heads[1], damage=True)
        deadline = time.monotonic() + 60
        while "head version 2 refused" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.5)
        assert "head.safetensors" in server.output()
        assert client.completions.create(**body).choices[0].text == first
        assert server.metric("draft_head_version") == 1
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("scope", ["key", "global"])
def test_with_several_keys_a_request_drafts_from_its_own_keys_answers(dirs, tmp_path, scope):
    """Two API keys, suffix decoding (the default for a model the registry does not know), k
    fixed at 4. One answer asked for again with the other key: under --suffix-cache-scope key
    (the default) nothing of the first answer drafts for it, so it accepts what the first
    request accepted; asked for again with the first key, or under global, the first answer drafts
    most of it. The text is the same each time."""
    args = [str(dirs["target"]), "--api-key", "one", "--api-key", "two", "-k", "4", "--k-policy", "fixed"]
    server = Server([*args, "--suffix-cache-scope", scope], tmp_path / "server.log")
    body = dict(model=MODEL, prompt="def add(a, b):", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})

    def accepted(key: str) -> tuple[float, str]:
        before = server.metric("spec_decode_num_accepted_tokens_total")
        text = server.client(api_key=key).completions.create(**body).choices[0].text
        return server.metric("spec_decode_num_accepted_tokens_total") - before, text

    try:
        first, text = accepted("one")
        other_key, other_text = accepted("two")
        same_key, same_text = accepted("one")
        assert text == other_text == same_text
        assert same_key >= 24, (first, other_key, same_key)
        assert other_key == first if scope == "key" else other_key >= 24, (first, other_key, same_key)
    finally:
        assert server.stop() == 0, server.output()


def test_api_key_full_queue_and_sigterm(dirs, tmp_path):
    """One slot and no waiting room: a second request while one streams gets 429 with
    Retry-After; a key is needed for /v1 (from SPECDEC_API_KEY); SIGTERM with a request in
    flight drains (helpers.assert_drains), lets it finish and exits 0."""
    server = Server(
        [str(dirs["target"]), "--max-num-seqs", "1", "--max-waiting", "0"],
        tmp_path / "server.log",
        env={"SPECDEC_API_KEY": "sesame"},
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        headers = {"Authorization": "Bearer sesame"}
        for path in ("/health", "/metrics"):  # open, for probes and scrapers, as in vLLM
            assert httpx.get(f"{server.url}{path}").status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/nothing"):  # the rest asks for the key
            refused = httpx.get(f"{server.url}{path}")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(f"{server.url}{path}", headers=headers).status_code == (404 if "nothing" in path else 200)
        client = server.client(api_key="sesame")
        assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
        # no speculative flag: speculation on, suffix decoding for a model the registry does not know
        speculation = client.models.list().data[0].to_dict()["speculation"]
        assert (speculation["method"], speculation["model"]) == ("suffix", None), speculation
        assert speculation["reason"].startswith("no drafter is registered for this model"), speculation
        body = {
            "model": MODEL,
            "prompt": "def",
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            full = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=headers)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            assert int(full.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="def", max_tokens=2)
            server.process.send_signal(signal.SIGTERM)  # the stream in flight still ends properly
            assert_drains(server.url, "sesame", MODEL)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()


# --- fuzzing the schema --------------------------------------------------------------------------

FUZZ_CONTEXT = 32  # short requests: a fuzzed max_tokens runs a few steps at most


@pytest.fixture(scope="module")
def fuzzed_server(dirs, tmp_path_factory):
    server = Server(
        [str(dirs["target"]), "--max-model-len", str(FUZZ_CONTEXT), "--max-num-seqs", "2"],
        tmp_path_factory.mktemp("fuzz") / "server.log",
    )
    yield server
    assert server.stop() == 0, server.output()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_schema_fuzzed_gets_documented_statuses_and_openai_errors(fuzzed_server, mode):
    """schemathesis sends what the server's own OpenAPI schema allows (positive) and what it
    does not (negative), to every route: each answer is a status the schema documents, in the
    shape it documents (an error in OpenAI's), never a 500 or a dropped connection. Left out:
    that every request the schema allows is taken (the schema knows no context length or
    vocabulary: such a request is a documented 400) and that every one it does not is refused
    (the server takes what pydantic's lax mode takes, "seed": true as 1, as vLLM's does)."""
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")

    @given(case=schema.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=50, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def answered_as_documented(case):
        response = case.call(timeout=30)
        case.validate_response(response, excluded_checks=[positive_data_acceptance, negative_data_rejection])

    answered_as_documented()
