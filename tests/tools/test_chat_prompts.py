"""Chat prompts from a Python corpus (training/chat_prompts.py): well-formed conversations of
the kinds asked, splits that never share a document, a deterministic order for a seed, the
size and docstring bounds, edits that fit their function, unparsable files skipped."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from specdec.tools.training.chat_prompts import (
    KINDS,
    ChatPrompt,
    chat_prompts,
    describe,
    find_functions,
    kind_of,
    summary,
)
from specdec.tools.training.corpus import HELD_OUT_MODULES, load_corpus

LONG_DOCSTRING = "Compute something. " * 25  # 475 characters: too long a summary for a write prompt
HUGE_BODY = "".join(f"    x = x + {i}  # step {i} of a long computation\n" for i in range(60))

SHAPES = f'''"""Shapes."""
import asyncio
import math


def area(radius):
    """Return the area of a circle
    of the given radius.

    The radius must not be negative.
    """
    return math.pi * radius ** 2


def tiny(x):
    """Tiny doc."""
    y = x + 1
    return y


def verbose(x):
    """{LONG_DOCSTRING}"""
    return x * 2


def walk(tree):
    """Yields every node of a tree, depth first."""
    yield tree
    for child in tree.children:
        yield from walk(child)


def factorial(n):
    if n <= 1:
        return 1
    return n * factorial(n - 1)


def two_lines(x):
    return x


def huge(x):
{HUGE_BODY}    return x


def clamp(value, low, high):
    """Limit value to the range from low to high."""
    return max(low, min(value, high))


class Square:
    def __init__(self, side):
        self.side = side
        self.name = "square"

    def describe(self, prefix="A"):
        """Describes the square in words, with its side length."""
        return "%s square of side %d" % (prefix, self.side)

    def greet(self, name):
        """Greet someone by name, in a word or two."""
        return "héllo wörld, " + name + "—" + self.name

    async def fetch(self, url, timeout=10):
        """Fetch the url and return its body after a wait."""
        await asyncio.sleep(timeout)
        return url
'''

COPIES = '''def clamp(value, low, high):
    """Limit value to the range from low to high."""
    return max(low, min(value, high))


def mean(values):
    total = sum(values)
    return total / len(values)
'''

HELD_OUT = '''def indent_lines(text, prefix):
    """Add prefix to the beginning of every line of text."""
    lines = text.splitlines(True)
    return "".join(prefix + line for line in lines)


def shorten(text, width):
    if len(text) > width:
        return text[:width]
    return text
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = {
        "shapes.py": SHAPES,
        "copies.py": COPIES,
        "textwrap.py": HELD_OUT,
        "broken.py": "def broken(:\n    pass\n",
        "more/util.py": COPIES.replace("mean", "median"),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    corpus = load_corpus(root)
    assert [d.name for d in corpus.held_out] == ["textwrap.py"]  # a HELD_OUT_MODULES name is held out
    return corpus


def code_of(prompt: ChatPrompt) -> str:
    return re.search(r"```python\n(.*)\n```$", prompt.messages[-1]["content"], re.S)[1]


def function_of(prompt: ChatPrompt) -> ast.FunctionDef | ast.AsyncFunctionDef:
    return ast.parse(code_of(prompt)).body[0]


def check_conversation(prompt: ChatPrompt, documents: set[str]) -> None:
    messages = prompt.messages
    assert isinstance(messages, tuple) and messages and messages[-1]["role"] == "user"
    assert [m["role"] for m in messages] in (["user"], ["system", "user"])
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in messages)
    assert prompt.kind in KINDS
    document, _, qualname = prompt.source.rpartition(":")
    assert document in documents and re.fullmatch(r"[A-Za-z_][\w.]*", qualname), prompt.source
    content = messages[-1]["content"]
    if prompt.kind == "write":
        assert f"`{qualname.split('.')[-1]}(" in content and "```" not in content
    else:
        start = "Edit this function so that it " if prompt.kind == "edit" else "Explain what this Python code does:"
        assert content.startswith(start)
        assert function_of(prompt).name == qualname.split(".")[-1]


def test_prompts_are_well_formed_conversations_of_the_kinds_asked(corpus):
    for split, documents in (("train", corpus.train), ("held_out", corpus.held_out)):
        prompts = chat_prompts(corpus, split)
        assert prompts
        for prompt in prompts:
            check_conversation(prompt, {d.name for d in documents})
    assert {p.kind for p in chat_prompts(corpus)} == set(KINDS)
    for kinds in (("write",), ("edit",), ("explain",), ("edit", "explain"), "explain"):
        prompts = chat_prompts(corpus, kinds=kinds)
        assert prompts and {p.kind for p in prompts} <= set((kinds,) if isinstance(kinds, str) else kinds)
    # each function makes one prompt: every usable function of the train split appears once
    functions, _ = find_functions(corpus.train)
    sources = sorted(p.source for p in chat_prompts(corpus, kinds=("edit", "explain")))
    assert sources == sorted(f.where for f in functions)


def test_a_prompts_kind_is_read_back_from_its_message(corpus):
    prompts = chat_prompts(corpus)
    assert {p.kind for p in prompts} == set(KINDS)
    assert all(kind_of(p.messages[-1]["content"]) == p.kind for p in prompts)


def test_held_out_and_train_never_share_a_document(corpus):
    train = {p.document for p in chat_prompts(corpus, "train")}
    held_out = {p.document for p in chat_prompts(corpus, "held_out")}
    assert held_out == {"textwrap.py"} and "textwrap.py" not in train
    assert train == {"shapes.py", "copies.py", "more/util.py"}


@pytest.mark.slow
def test_real_standard_library_keeps_held_out_modules_out_of_train():
    corpus = load_corpus()  # the standard library; parsing its ~700 training files takes a few seconds
    train = chat_prompts(corpus, "train")
    held_out = chat_prompts(corpus, "held_out")
    assert not {p.document for p in train} & set(HELD_OUT_MODULES)
    assert {p.document for p in held_out} == set(HELD_OUT_MODULES)
    assert len(train) > 5000 and len(held_out) > 100 and not train.unparsed
    for prompts, documents in ((train, corpus.train), (held_out, corpus.held_out)):
        for prompt in prompts[:300]:
            check_conversation(prompt, {d.name for d in documents})
        counts = {kind: sum(p.kind == kind for p in prompts) for kind in KINDS}
        assert counts["write"] > counts["explain"] > 0 and counts["edit"] > counts["explain"]
    assert chat_prompts(corpus, "held_out", limit=20) == held_out[:20]


def test_deterministic_for_a_seed_and_different_for_another(corpus):
    first = chat_prompts(corpus, seed=3)
    assert first == chat_prompts(corpus, seed=3)
    assert first != chat_prompts(corpus, seed=4)
    assert chat_prompts(corpus, seed=3, limit=5) == first[:5] and len(first) > 5
    assert chat_prompts(corpus, seed=3, limit=0) == []


def test_a_caller_changing_its_list_leaves_the_next_calls_prompts_as_they_were(corpus):
    """A split's prompts are kept for the next call with the same arguments: each call still
    gets a list of its own."""
    first = chat_prompts(corpus, seed=5)
    expected = list(first)
    first.reverse()
    first.pop()
    assert chat_prompts(corpus, seed=5) == expected
    assert chat_prompts(corpus, seed=5).unparsed == ("broken.py",)


def test_kinds_are_interleaved_evenly():
    from specdec.tools.training.chat_prompts import _interleave

    merged = _interleave([list("aaaaaa"), list("bbb"), list("c")])
    assert "".join(merged) == "abaabcaaba"  # item i of a group of n at (i + 0.5) / n: any prefix keeps the mix


def test_source_size_and_docstring_bounds(corpus):
    functions, _ = find_functions(corpus.train, max_source_chars=200)
    assert functions and all(len(f.source) <= 200 and f.source.count("\n") + 1 >= 3 for f in functions)
    names = {f.qualname for f in find_functions(corpus.train)[0]}
    assert "huge" not in names and "two_lines" not in names and "area" in names  # > 1200 characters, 2 lines
    assert "huge" in {f.qualname for f in find_functions(corpus.train, max_source_chars=5000)[0]}
    for prompt in chat_prompts(corpus, kinds=("edit", "explain"), max_source_chars=200):
        assert len(code_of(prompt)) <= 200
    written = {p.source for p in chat_prompts(corpus, kinds=("write",))}
    # tiny's summary is under 20 characters, verbose's over 400, factorial and mean have none
    assert written == {
        "shapes.py:area",
        "shapes.py:walk",
        "copies.py:clamp",
        "shapes.py:Square.describe",
        "shapes.py:Square.greet",
        "shapes.py:Square.fetch",
    }
    for function in find_functions(corpus.train)[0]:
        text = summary(function.node)
        assert text is None or (20 <= len(text) <= 400 and "\n" not in text)


def test_write_prompts_read_well(corpus):
    contents = [p.messages[-1]["content"] for seed in range(12) for p in chat_prompts(corpus, kinds="write", seed=seed)]
    area = [c for c in contents if "`area(radius)`" in c]
    # the first paragraph only, on one line; "Return" lower-cased, "returns" after "that"
    assert area and all("must not be negative" not in c and "circle of the given radius" in c for c in area)
    assert all(re.search(r"(that returns|to return|should return) the area", c) for c in area)
    assert any("an async method `fetch(self, url, timeout=10)` of a Python class `Square`" in c for c in contents)
    walk = [c for c in contents if "`walk(tree)`" in c]
    assert all(re.search(r"(that yields|to yield|should yield) every node", c) for c in walk)


def test_edits_fit_their_function(corpus):
    renames = 0
    for seed in range(40):
        for prompt in chat_prompts(corpus, kinds=("edit",), seed=seed):
            function, content = function_of(prompt), prompt.messages[-1]["content"]
            parameters = [a.arg for a in function.args.args + function.args.kwonlyargs]
            rename = re.search(r"uses the name `(\w+)` for its parameter `(\w+)`", content)
            if rename:
                new, old = rename.groups()
                renames += 1
                assert old in parameters and old not in ("self", "cls") and new not in parameters
            if "instead of yielding" in content:
                assert any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(function))
            if "without recursion" in content:
                assert prompt.source in ("shapes.py:walk", "shapes.py:factorial")
            if "type hints" in content:
                assert not any(a.annotation for a in function.args.args) and function.returns is None
            if "has a docstring" in content:
                assert ast.get_docstring(function) is None
    assert renames > 0


def test_unparsable_document_is_skipped_and_counted(corpus):
    prompts = chat_prompts(corpus)
    assert prompts.unparsed == ("broken.py",)
    assert not any(p.document == "broken.py" for p in prompts)
    assert "skipped 1 documents that do not parse" in describe(prompts)
    line = describe(chat_prompts(corpus, "held_out"))
    assert re.fullmatch(r"\d+ chat prompts \(.*\) from 1 source documents", line), line


def test_identical_functions_appear_once(corpus):
    clamps = [p for p in chat_prompts(corpus) if p.source.endswith(":clamp")]
    assert [p.source for p in clamps] == ["copies.py:clamp"]  # the first in name order; shapes.py's is the same
    assert sum(p.source.endswith(":mean") for p in chat_prompts(corpus)) == 1  # copies.py's; util.py has median


def test_sources_match_ast_get_source_segment_and_parse(corpus):
    for document in corpus.train:
        if document.name == "broken.py":
            continue
        found = {f.qualname.split(".")[-1]: f.source for f in find_functions([document], max_source_chars=10**6)[0]}
        for node in ast.walk(ast.parse(document.text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in found:
                assert found[node.name] == textwrap.dedent(ast.get_source_segment(document.text, node, padded=True))
                ast.parse(found[node.name])


def test_bad_split_or_kind_is_a_value_error(corpus):
    with pytest.raises(ValueError, match="train, held_out"):
        chat_prompts(corpus, "test")
    with pytest.raises(ValueError, match="summarize.*write, edit, explain"):
        chat_prompts(corpus, kinds=("write", "summarize"))
    with pytest.raises(ValueError, match="write, edit, explain"):
        chat_prompts(corpus, kinds=())
    with pytest.raises(ValueError, match="limit"):
        chat_prompts(corpus, limit=-1)


def test_a_corpus_of_one_file(tmp_path: Path):
    file = tmp_path / "one.py"
    file.write_text(SHAPES + "\n\n" + COPIES.replace("clamp", "clip"), encoding="utf-8")
    corpus = load_corpus(file)  # the last tenth is held out
    prompts = chat_prompts(corpus)
    assert prompts and all(p.document == "one.py" for p in prompts)
