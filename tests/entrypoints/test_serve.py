"""specdec serve, as a real server process on a free port, driven by the official openai
client (and raw HTTP for what the client will not send): completions and chat, streamed and
not, greedy float32 outputs identical to LLM.generate offline; a client that disconnects
mid-stream frees its slot; every bad request gets an OpenAI-style error and the server keeps
serving; the API key; a full queue answers 429; SIGTERM ends it with exit code 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers import save_tiny_model
from specdec import LLM, SamplingParams
from specdec.serve.process import ServerProcess

pytestmark = pytest.mark.slow  # a server process per module (about a minute)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CONTEXT = 2048
MODEL = "tiny"


class Server(ServerProcess):
    """specdec serve on the tiny model, float32, eager, served as MODEL."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        super().__init__([*args, "--served-model-name", MODEL, "--compile", "off", "--dtype", "float32"], log_path, env)

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
    assert [m.id for m in client.models.list().data] == [MODEL]
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
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, "model"),
    ("prompt too long", {"model": MODEL, "prompt": "def add(a, b): " * 600, "max_tokens": 4}, None),
    ("max_tokens past the context", {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT}, None),
    ("n > 1", {"model": MODEL, "prompt": "hi", "n": 2}, "n"),
    ("logprobs over 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("penalties", {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
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
        server.client().completions.create(model="gpt-5", prompt="hi")
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
    assert httpx.post(f"{server.url}/v1/nothing", json={}).status_code == 404


def test_api_key_full_queue_and_sigterm(dirs, tmp_path):
    """One slot and no waiting room: a second request while one streams gets 429 with
    Retry-After; a key is needed for /v1 (from SPECDEC_API_KEY); SIGTERM with a request in
    flight lets it finish and exits 0."""
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
        assert httpx.get(f"{server.url}/health").status_code == 200  # open, as are the metrics
        client = server.client(api_key="sesame")
        assert [m.id for m in client.models.list().data] == [MODEL]
        body = {
            "model": MODEL,
            "prompt": "def",
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": "Bearer sesame"}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            full = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=headers)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            assert int(full.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="def", max_tokens=2)
            server.process.send_signal(signal.SIGTERM)  # the stream in flight still ends properly
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()
