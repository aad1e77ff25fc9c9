"""ShareGPT's first messages as chat prompts: read from a JSON array cut short as the package's
file is, split by the ids' digests, shuffled by the seed; chat-data answers them."""

from __future__ import annotations

import io
import json

import pytest

from helpers import fake_sharegpt
from specdec.tools.training import sharegpt_prompts as sharegpt
from specdec.tools.training.sharegpt_prompts import conversations, is_held_out, sharegpt_prompts


@pytest.mark.parametrize("chunk_chars", [64, 1000, 1 << 20])
def test_every_whole_conversation_is_read_and_the_cut_one_left_out(chunk_chars):
    text, entries = fake_sharegpt(60, seed=1)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert list(conversations(io.StringIO(text), chunk_chars)) == entries
    whole, _ = fake_sharegpt(60, seed=1, cut=False)
    assert list(conversations(io.StringIO(whole), chunk_chars)) == entries


def test_prompts_are_first_human_messages_split_by_id_and_shuffled_by_seed(monkeypatch):
    monkeypatch.setattr(sharegpt, "HELD_OUT_SHARE", 0.25)  # enough held out among 300 to see
    text, entries = fake_sharegpt(300, seed=2)
    expected = {
        split: {
            f"sharegpt:{e['id']}": e["conversations"][0]["value"].strip()
            for e in entries
            if e["conversations"][0]["from"] == "human"
            and 0 < len(e["conversations"][0]["value"].strip()) <= 2000
            and is_held_out(e["id"]) == (split == "held_out")
        }
        for split in ("train", "held_out")
    }
    assert expected["train"] and expected["held_out"]
    for split in ("train", "held_out"):
        prompts = sharegpt_prompts(split, seed=3, data=io.StringIO(text))
        assert {p.source: p.messages[0]["content"] for p in prompts} == expected[split]
        assert all(p.messages[0]["role"] == "user" and len(p.messages) == 1 for p in prompts)
        again = sharegpt_prompts(split, limit=5, seed=3, data=io.StringIO(text))
        other = sharegpt_prompts(split, seed=4, data=io.StringIO(text))
        assert again == prompts[:5] and [p.source for p in other] != [p.source for p in prompts]


def test_the_split_is_a_digest_of_the_id_alone():
    ids = [f"id{i}" for i in range(4000)]
    held_out = sum(map(is_held_out, ids))
    assert 0.02 < held_out / len(ids) < 0.045  # HELD_OUT_SHARE is 1/32
    assert [is_held_out(i) for i in ids] == [is_held_out(i) for i in ids]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="split must be"):
        sharegpt_prompts("test", data=io.StringIO("[]"))
    with pytest.raises(ValueError, match="limit must be"):
        sharegpt_prompts("train", limit=-1, data=io.StringIO("[]"))
