"""PromptEncoder.load: a model's tokenizer and prompt checks from its tokenizer and config alone
(a Ray Serve ingress holds no weights), the same as the LLM's that loaded the model."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from gguf_files import tiny_hf_model, write_gguf
from helpers import make_tokenizer
from specdec import LLM, SamplingParams
from specdec.models.tokenizer import Tokenizer
from specdec.prompts import FIM_TOKENS, PromptEncoder

MESSAGES = [{"role": "user", "content": "hello there"}]


def refusal(function, *args) -> str:
    with pytest.raises(ValueError) as e:
        function(*args)
    return str(e.value)


def assert_same_prompts(encoder: PromptEncoder, llm: LLM) -> None:
    """Text, token ids and conversations come out as the LLM makes them; bad ones are refused
    with its words."""
    params = SamplingParams(max_tokens=4)
    assert (encoder.vocab_size, encoder.max_model_len) == (llm.prompts.vocab_size, llm.max_model_len)
    assert encoder.prompt_token_ids("def f(x):", params) == llm.prompt_token_ids("def f(x):", params)
    if llm.tokenizer is not None and llm.tokenizer.chat_template:
        assert encoder.chat_token_ids(MESSAGES) == llm.chat_token_ids(MESSAGES)
    else:  # the tiny pair's tokenizer has none
        assert refusal(encoder.chat_token_ids, MESSAGES) == refusal(llm.chat_token_ids, MESSAGES)
    too_long = SamplingParams(max_tokens=llm.max_model_len)
    outside = [llm.prompts.vocab_size]
    for prompt, p in (("def f(x):", too_long), (outside, params), ("", params)):
        assert refusal(encoder.prompt_token_ids, prompt, p) == refusal(llm.prompt_token_ids, prompt, p)


def test_a_model_directory_is_read_without_its_weights(tiny_pair, monkeypatch):
    llm = LLM(str(tiny_pair["target"]), dtype="float32", speculative_method="none")
    with monkeypatch.context() as patch:
        patch.setattr("specdec.models.loader.read_safetensors", no_weights)
        encoder = PromptEncoder.load(tiny_pair["target"])
    assert_same_prompts(encoder, llm)


def test_a_gguf_file_is_read_without_its_tensors_before_and_after_it_is_packed(tmp_path, monkeypatch):
    """A quantized file: from its metadata before specdec packed it, from the packed cache's
    index after (no vocabulary parsed again)."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf_model("qwen2"), "Q8_0")
    with monkeypatch.context() as patch:
        patch.setattr("specdec.models.gguf._hf_tensors", no_weights)
        before = PromptEncoder.load(path)
    llm = LLM(str(path), speculative_method="none")  # packs the file into the cache
    with monkeypatch.context() as patch:
        patch.setattr("specdec.models.gguf._hf_tensors", no_weights)
        patch.setattr("specdec.models.gguf._metadata", no_weights)
        after = PromptEncoder.load(path)
    assert_same_prompts(before, llm)
    assert_same_prompts(after, llm)


def no_weights(*args, **kwargs):
    raise AssertionError("the prompt encoder read the model's weights")


@pytest.mark.parametrize("family", range(len(FIM_TOKENS)))
def test_fill_in_the_middle_puts_the_models_fim_tokens_around_prefix_and_suffix(family):
    """Each family's FIM tokens (added as the models' tokenizers have them) around the prefix and
    suffix, prefix first, the middle's token last; a model without them is refused by name."""
    backend = make_tokenizer(320)
    before_prefix, before_suffix, before_middle = FIM_TOKENS[family]
    backend.add_special_tokens([AddedToken(name, special=True) for name in FIM_TOKENS[family]])
    encoder = PromptEncoder(Tokenizer(backend), backend.get_vocab_size(), 512)
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    encode = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert encoder.fill_in_the_middle_ids(prefix, suffix) == [
        backend.token_to_id(before_prefix),
        *encode(prefix),
        backend.token_to_id(before_suffix),
        *encode(suffix),
        backend.token_to_id(before_middle),
    ]
    backend.add_special_tokens([AddedToken("<|fim_pad|>", special=True)])
    assert encoder.fill_in_the_middle_stops() == (backend.token_to_id("<|fim_pad|>"),)  # what ends a middle
    plain = PromptEncoder(Tokenizer(make_tokenizer(320)), 320, 512)
    assert "suffix" in refusal(plain.fill_in_the_middle_ids, prefix, suffix)
