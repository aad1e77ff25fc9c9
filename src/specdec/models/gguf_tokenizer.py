"""A `tokenizers.Tokenizer` rebuilt from the tokenizer metadata of a GGUF file (llama.cpp's format).

A GGUF file carries no tokenizer.json: its vocabulary, merges and special tokens are metadata
under llama.cpp's key names. This module turns them back into a Hugging Face tokenizer that
splits text the way llama.cpp does (src/llama-vocab.cpp).

Terms:
  metadata     the file's key/value pairs as plain Python values, e.g.
               metadata["tokenizer.ggml.tokens"] == ["<unk>", "<s>", ...]
               (`metadata_from_reader` reads them from a `gguf.GGUFReader`)
  model type   tokenizer.ggml.model: "gpt2" = byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2),
               "llama" = SentencePiece-style BPE (Llama 1/2, Mistral); no other is read
  token type   tokenizer.ggml.token_type, one per token: 1 normal, 2 unknown, 3 control,
               4 user-defined, 5 unused, 6 byte (a SentencePiece byte-fallback token "<0x0A>")
  byte-level alphabet  GPT-2's map of the 256 byte values onto printable characters (a space is
               "Ġ"); a gpt2-type vocabulary spells its ordinary tokens in it
  pre type     tokenizer.ggml.pre: llama.cpp's name for how a gpt2-type tokenizer cuts text into
               words before BPE (one or more regexes, see PRE_TYPES)
  merge        a pair of tokens BPE may join, "a b" in the file; the earlier, the sooner it applies
  added token  a token matched whole in the raw text before anything else runs: control and
               unknown tokens (special: skipped when decoding with skip_special_tokens) and
               user-defined ones (not special), as llama.cpp matches them

tokenizer_from_gguf(metadata) gives the tokenizer and the tokenizer_config.json fields
transformers would write for it. Bad or unsupported metadata raises GGUFTokenizerError, whose
message names the key, the problem and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["GGUFTokenizerError", "PRE_TYPES", "metadata_from_reader", "tokenizer_from_gguf", "derive_merges"]

# token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space

_KEY = "tokenizer.ggml."


class GGUFTokenizerError(ValueError):
    """The GGUF file's tokenizer metadata cannot be turned into a tokenizer; the message names the
    key, the problem and what to do."""


# ---------------------------------------------------------------------------------------------
# Pre types: how llama.cpp cuts text into words before byte-level BPE
# ---------------------------------------------------------------------------------------------

# GPT-2's regex (also what pre_tokenizers.ByteLevel(use_regex=True) splits on)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's tokenizer.json regex
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's tokenizer.json regex: Llama 3's with digits one by one
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken tokenizer.json regex (Mistral Nemo): words split before capitals, digits one by one
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreType:
    """What one family of tokenizer.ggml.pre names means to llama.cpp.

    splits: regexes applied in turn, each cutting every piece the one before produced; the
        stretches a regex matches and those between its matches are both kept (llama.cpp's
        unicode_regex_split, `pre_tokenizers.Split(behavior="isolated")` here).
    ignore_merges: a word that is itself in the vocabulary is taken whole, merges unused
        (llama.cpp's ignore_merges, Llama 3's tokenizer.json).
    add_bos: whether BOS is added when the file has no tokenizer.ggml.add_bos_token.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreType((GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = PreType((r"\p{N}", GPT2_SPLIT))  # each digit its own word, then GPT-2's regex
_LLAMA3 = PreType((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX_ONLY = PreType((LLAMA3_SPLIT,))
_QWEN2 = PreType((QWEN2_SPLIT,))
_TEKKEN = PreType((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)
# llama.cpp's "default" (also used when the file has no pre type): punctuation runs cut out first,
# then GPT-2's regex, then number runs, then numbers in threes. It is not GPT-2's regex alone:
# "don't" -> "don", "'", "t" (GPT-2: "don", "'t").
_LLAMA_CPP_DEFAULT = PreType((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))

# tokenizer.ggml.pre -> its PreType, as llama.cpp's llama_vocab::impl::load maps them ("gpt2" is
# an alias of "gpt-2" that llama.cpp itself does not accept)
PRE_TYPES: dict[str, PreType] = {
    "default": _LLAMA_CPP_DEFAULT,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "exaone4", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b", "mellum2"),
        _DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _LLAMA3_REGEX_ONLY),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"), _QWEN2
    ),
    "tekken": _TEKKEN,
}
MISSING_PRE_TYPE = "default"  # what llama.cpp uses for a gpt2-type file without tokenizer.ggml.pre

MODEL_TYPES = ("gpt2", "llama")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    """Every metadata field of a `gguf.GGUFReader`, as a plain Python value (`field.contents()`):
    str, int, float, bool, or a list of them."""
    return {name: field.contents() for name, field in reader.fields.items()}


def tokenizer_from_gguf(metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer a GGUF file's metadata describes, and its tokenizer_config.json fields.

    The config holds bos_token / eos_token / unk_token / pad_token (the token strings, where
    the file gives their ids), add_bos_token, add_eos_token, chat_template (if the file has
    one), tokenizer_class and clean_up_tokenization_spaces. The tokenizer adds BOS / EOS itself
    (its post-processor) when add_bos_token / add_eos_token say so.
    """
    model_type = _model_type(metadata)
    tokens = _tokens(metadata)
    token_types = _token_types(metadata, len(tokens))
    special_ids = _special_ids(metadata, tokens, model_type)
    if model_type == "gpt2":
        tokenizer, add_bos_default = _byte_level_tokenizer(metadata, tokens)
    else:
        tokenizer, add_bos_default = _sentencepiece_tokenizer(metadata, tokens, special_ids.get("unk_token")), True
    add_bos = _flag(metadata, "add_bos_token", add_bos_default)
    add_eos = _flag(metadata, "add_eos_token", False)
    _add_whole_tokens(tokenizer, tokens, token_types)
    tokenizer.post_processor = _bos_eos_processor(tokens, special_ids, add_bos, add_eos)
    return tokenizer, _tokenizer_config(metadata, tokens, special_ids, add_bos, add_eos)


# ---------------------------------------------------------------------------------------------
# Reading and checking the metadata
# ---------------------------------------------------------------------------------------------


def _model_type(metadata: dict[str, Any]) -> str:
    model_type = metadata.get(_KEY + "model")
    if model_type is None:
        raise GGUFTokenizerError(
            f"the file has no {_KEY}model, so its tokenizer is unknown; convert the model "
            "again with llama.cpp's convert_hf_to_gguf.py"
        )
    if model_type not in MODEL_TYPES:
        raise GGUFTokenizerError(
            f"{_KEY}model {model_type!r} is not supported: only 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece BPE) tokenizers are read; use the model's Hugging Face checkpoint "
            "(tokenizer.json) instead"
        )
    return model_type


def _as_list(value: Any) -> list | None:
    """value as a list if it is one (a list, a tuple, a 1-D numpy array), else None."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):
        return value.tolist()
    return None


def _tokens(metadata: dict[str, Any]) -> list[str]:
    """The vocabulary, in id order. An empty token is renamed "[EMPTY_<id>]" as llama.cpp does."""
    value = metadata.get(_KEY + "tokens")
    tokens = _as_list(value)
    if not tokens:
        what = "no" if value is None else "an empty or malformed"
        raise GGUFTokenizerError(
            f"the file has {what} {_KEY}tokens (the vocabulary); without it there is no "
            "tokenizer: convert the model again with llama.cpp's convert_hf_to_gguf.py"
        )
    first_id: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if not isinstance(token, str):
            raise GGUFTokenizerError(
                f"{_KEY}tokens[{token_id}] is {type(token).__name__}, not a string; "
                "the file is corrupt: convert the model again"
            )
        if token == "":
            token = tokens[token_id] = f"[EMPTY_{token_id}]"
        if token in first_id:
            raise GGUFTokenizerError(
                f"{_KEY}tokens holds {token!r} twice (ids {first_id[token]} and {token_id}); "
                "llama.cpp refuses such a vocabulary too: convert the model again"
            )
        first_id[token] = token_id
    return tokens


def _per_token(metadata: dict[str, Any], name: str, count: int, kind: type) -> list | None:
    """tokenizer.ggml.<name>: one number per token (or more; the extra are ignored), or None."""
    value = metadata.get(_KEY + name)
    if value is None:
        return None
    values = _as_list(value)
    if values is None or len(values) < count:
        size = f"{len(values)} entries" if values is not None else f"a {type(value).__name__}"
        raise GGUFTokenizerError(
            f"{_KEY}{name} has {size} for {count} tokens; the file is corrupt: convert the model again"
        )
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values[:count]):
        raise GGUFTokenizerError(
            f"{_KEY}{name} holds values that are not {kind.__name__}s; the file is corrupt: convert the model again"
        )
    return values[:count]


def _token_types(metadata: dict[str, Any], count: int) -> list[int]:
    """The token types; all normal where the file has none."""
    types = _per_token(metadata, "token_type", count, Integral)
    return [int(t) for t in types] if types is not None else [NORMAL] * count


_SPECIAL_ID_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_SENTENCEPIECE_DEFAULT_IDS = {"bos_token": 1, "eos_token": 2, "unk_token": 0}  # llama.cpp's, for "llama"


def _special_ids(metadata: dict[str, Any], tokens: list[str], model_type: str) -> dict[str, int]:
    """{"bos_token": id, ...} for the special tokens the file names. In a "llama" file, a BOS /
    EOS / unknown id the file does not give is llama.cpp's default (1, 2, 0)."""
    ids: dict[str, int] = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        value = metadata.get(_KEY + key)
        if value is None:
            default = _SENTENCEPIECE_DEFAULT_IDS.get(name) if model_type == "llama" else None
            if default is not None and default < len(tokens):
                ids[name] = default
            continue
        # numbers.Integral's stub lacks the reflected comparisons
        if not isinstance(value, Integral) or isinstance(value, bool) or not 0 <= value < len(tokens):  # pyright: ignore[reportOperatorIssue]
            raise GGUFTokenizerError(
                f"{_KEY}{key} is {value!r}, not a token id (0 to {len(tokens) - 1}); the "
                "file is corrupt or was edited wrongly: fix the id (gguf's "
                "gguf_set_metadata.py) or convert the model again"
            )
        ids[name] = int(value)
    return ids


def _flag(metadata: dict[str, Any], name: str, default: bool) -> bool:
    value = metadata.get(_KEY + name, default)
    if not isinstance(value, (bool, Integral)):
        raise GGUFTokenizerError(f"{_KEY}{name} is {value!r}, not a boolean; fix it or convert the model again")
    return bool(value)


def _file_merges(metadata: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]] | None:
    """tokenizer.ggml.merges as pairs, or None where the file has none. Each "a b" is cut at its
    first space after the first character (as llama.cpp does); a, b and a+b must be tokens."""
    value = metadata.get(_KEY + "merges")
    if value is None:
        return None
    merges = _as_list(value)
    if merges is None:
        raise GGUFTokenizerError(
            f"{_KEY}merges is a {type(value).__name__}, not a list of strings; the file "
            "is corrupt: convert the model again"
        )
    pairs = []
    for index, merge in enumerate(merges):
        cut = merge.find(" ", 1) if isinstance(merge, str) else -1
        if cut < 0:
            raise GGUFTokenizerError(
                f"{_KEY}merges[{index}] is {merge!r}, not two tokens joined by a space; "
                "the file is corrupt: convert the model again"
            )
        left, right = merge[:cut], merge[cut + 1 :]
        missing = [t for t in (left, right, left + right) if t not in vocab]
        if missing:
            raise GGUFTokenizerError(
                f"{_KEY}merges[{index}] ({merge!r}) refers to {missing[0]!r}, which is not "
                f"in {_KEY}tokens; the merges do not belong to this vocabulary: convert "
                "the model again"
            )
        pairs.append((left, right))
    return pairs


# ---------------------------------------------------------------------------------------------
# The two tokenizers
# ---------------------------------------------------------------------------------------------


def _pre_type(metadata: dict[str, Any]) -> PreType:
    name = metadata.get(_KEY + "pre", MISSING_PRE_TYPE)
    if not isinstance(name, str) or name not in PRE_TYPES:
        raise GGUFTokenizerError(
            f"{_KEY}pre {name!r} is not a pre-tokenizer this reader knows (llama.cpp refuses unknown ones "
            f"too); supported: {', '.join(sorted(PRE_TYPES))}. Use the model's Hugging Face checkpoint "
            "(tokenizer.json) instead"
        )
    return PRE_TYPES[name]


def _byte_level_tokenizer(metadata: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, bool]:
    """Byte-level BPE with the file's merges, text cut into words as its pre type says; and
    whether that pre type adds BOS by default."""
    pre_type = _pre_type(metadata)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = _file_merges(metadata, vocab)
    if merges is None:
        raise GGUFTokenizerError(
            f"the file has no {_KEY}merges, which a 'gpt2' (byte-level BPE) tokenizer needs "
            "(llama.cpp refuses it too): convert the model again"
        )
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, ignore_merges=pre_type.ignore_merges, fuse_unk=False, byte_fallback=False
        )
    )
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre_type.splits]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre_type.add_bos


def _sentencepiece_tokenizer(metadata: dict[str, Any], tokens: list[str], unk_id: int | None) -> Tokenizer:
    """SentencePiece-style BPE: spaces spelled "▁" (and one put in front of the text, and after
    every added token, where tokenizer.ggml.add_space_prefix is true or absent, as llama.cpp
    does), unknown characters as their bytes' <0xXX> tokens; merges from the file or, where it
    has none, derived from the vocabulary and its scores."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = _file_merges(metadata, vocab)
    if merges is None:
        scores = _per_token(metadata, "scores", len(tokens), Real)
        merges = derive_merges(tokens, [float(s) for s in scores] if scores is not None else [0.0] * len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = _flag(metadata, "add_space_prefix", True)
    spaces = [normalizers.Replace(" ", SPIECE_SPACE)]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), *spaces] if prefix else spaces)
    tokenizer.pre_tokenizer = None
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: (left, right) for every token that cuts
    into two tokens left + right, ranked by the whole token's score, highest first, then by
    left's id, then right's. BPE then joins the best-scored pair first, as SentencePiece (and
    llama.cpp's SPM tokenizer) do. Linear in the vocabulary's total length."""
    ids = {token: token_id for token_id, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left_id = ids.get(token[:cut])
            if left_id is None:
                continue
            right_id = ids.get(token[cut:])
            if right_id is not None:
                ranked.append((-score, left_id, right_id))
    ranked.sort()
    return [(tokens[left_id], tokens[right_id]) for _, left_id, right_id in ranked]


# ---------------------------------------------------------------------------------------------
# Added tokens, BOS / EOS, tokenizer_config.json
# ---------------------------------------------------------------------------------------------


def _add_whole_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added
    tokens: matched in the raw text, not normalized, so "<|im_start|>" is one token, as in
    llama.cpp. Each keeps its id (it is in the vocabulary). A token is special by its type alone,
    as in llama.cpp: a BOS / EOS / padding id that names an ordinary token (Llama 3 files with
    padding id 0, "!") does not make it one, or "!" would be cut out of text and dropped."""
    special = [i for i, t in enumerate(token_types) if t in (CONTROL, UNKNOWN)]
    user_defined = [i for i, t in enumerate(token_types) if t == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])


def _bos_eos_processor(tokens: list[str], special_ids: dict[str, int], add_bos: bool, add_eos: bool):
    """A post-processor putting BOS before / EOS after each sequence as asked, or None."""
    added = [name for name, wanted in (("bos_token", add_bos), ("eos_token", add_eos)) if wanted]
    for name in added:
        if name not in special_ids:
            raise GGUFTokenizerError(
                f"{_KEY}add_{name} is true, but {_KEY}{_SPECIAL_ID_KEYS[name]} is not set; "
                f"set one of them (gguf's gguf_set_metadata.py) or convert the model again"
            )
    if not added:
        return None
    # the template names each token by its text, or BOS / EOS where the text would not parse ("a:b", "$A")
    names = {name: _template_name(tokens[special_ids[name]], name[:3].upper()) for name in added}

    def sequence(piece: str, type_id: int) -> list[str]:
        bos = [f"{names['bos_token']}:{type_id}"] if add_bos else []
        eos = [f"{names['eos_token']}:{type_id}"] if add_eos else []
        return [*bos, f"{piece}:{type_id}", *eos]

    special = {
        names[name]: {"id": names[name], "ids": [special_ids[name]], "tokens": [tokens[special_ids[name]]]}
        for name in added
    }
    return processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=list(special.values())
    )


def _template_name(token: str, fallback: str) -> str:
    readable = token and not token.startswith("$") and ":" not in token and not any(c.isspace() for c in token)
    return token if readable else fallback


def _tokenizer_config(
    metadata: dict[str, Any], tokens: list[str], special_ids: dict[str, int], add_bos: bool, add_eos: bool
) -> dict[str, Any]:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update({name: tokens[token_id] for name, token_id in special_ids.items()})
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise GGUFTokenizerError(
                f"tokenizer.chat_template is a {type(template).__name__}, not a string; "
                "fix it or convert the model again"
            )
        config["chat_template"] = template
    return config
