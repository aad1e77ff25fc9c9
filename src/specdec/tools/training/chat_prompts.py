"""Chat prompts about the functions of a Python corpus, for a chat target to answer: its answers
are the text a draft model is distilled on.

Terms:
  function      a function or method (def / async def, at any depth) of a corpus document,
                with its source: its `def` line through its last line (its source segment),
                less the def line's indentation. Only those of at least MIN_LINES lines and at
                most max_source_chars characters are used, and a function whose source is
                identical to an earlier one's (in another document or the same) counts once.
  summary       the first paragraph of a function's docstring, on one line; it qualifies for a
                write prompt at SUMMARY_CHARS characters (20 to 400) unless it ends in a colon
                (it introduces a list that is left out) or holds a doctest
  kind          what a prompt asks of its function:
                  write    write it, from its signature and summary, in one of a few phrasings
                           drawn by the seeded RNG; a summary that starts with a verb ("Return x",
                           "Returns x") reads on lower-cased ("... that returns x", "... to
                           return x"), any other is quoted as written
                  edit     edit its source in one way that fits it (EDIT_INSTRUCTIONS)
                  explain  explain its source
  source        where a prompt's function is: "<document name>:<qualified name>", e.g.
                "textwrap.py:TextWrapper.wrap"
  conversation  a prompt's messages, ChatML-style dicts {"role": ..., "content": ...}: one user
                message (a system message may come first)

Each function makes at most one prompt. Its kind is drawn by the seeded RNG among the asked
kinds it qualifies for (every function qualifies for edit and explain; write needs a summary),
in proportion to KIND_WEIGHTS, so explain prompts stay a small share. Each kind's prompts are
shuffled and the kinds interleaved evenly, so any first `limit` prompts keep the mix and
chat_prompts(..., limit=n) is chat_prompts(...)[:n]. Documents that do not parse as Python
are skipped; the result's `unparsed` names them.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import warnings
from collections import Counter
from dataclasses import dataclass

from specdec.tools.training.corpus import Corpus, Document

KINDS = ("write", "edit", "explain")
SPLITS = ("train", "held_out")
KIND_WEIGHTS = {"write": 12, "edit": 6, "explain": 1}
MIN_LINES = 3
SUMMARY_CHARS = (20, 400)

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[dict, ...]  # the conversation: [{"role": "user", "content": "..."}]
    kind: str  # "write" | "edit" | "explain"
    source: str  # "<document>:<qualified name>"

    @property
    def document(self) -> str:
        return self.source.rpartition(":")[0]


class PromptList(list):
    """The prompts (a list of ChatPrompt), and the names of the documents that did not parse."""

    unparsed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Function:
    document: str
    qualname: str  # "name", "Class.name" or "outer.name"
    class_name: str | None  # the class it is a method of, if any
    node: FunctionNode
    source: str  # unindented, at most max_source_chars characters and at least MIN_LINES lines

    @property
    def where(self) -> str:
        return f"{self.document}:{self.qualname}"


def chat_prompts(
    corpus: Corpus,
    split: str = "train",
    kinds=KINDS,
    limit: int | None = None,
    seed: int = 0,
    max_source_chars: int = 1200,
) -> PromptList:
    """The prompts of one split of the corpus, in a deterministic order for the seed."""
    documents = _split_documents(corpus, split)
    kinds = _check_kinds(kinds)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, not {limit}")
    every = _every_prompt(documents, kinds, seed, max_source_chars)
    result = PromptList(every[:limit])
    result.unparsed = every.unparsed
    return result


@functools.lru_cache(maxsize=4)
def _every_prompt(documents: tuple[Document, ...], kinds: tuple[str, ...], seed: int, max_chars: int) -> PromptList:
    """Every prompt of documents, in the seed's order. Kept for the next call with the same
    arguments: parsing the standard library takes seconds, and the first n prompts depend on all
    of them (the order is drawn over the whole list)."""
    functions, unparsed = find_functions(documents, max_chars)
    rng = random.Random(seed)
    by_kind: dict[str, list[ChatPrompt]] = {kind: [] for kind in kinds}
    for function in functions:
        prompt = _prompt(function, kinds, rng)
        if prompt is not None:
            by_kind[prompt.kind].append(prompt)
    for prompts in by_kind.values():
        rng.shuffle(prompts)
    every = PromptList(_interleave(list(by_kind.values())))
    every.unparsed = tuple(unparsed)
    return every


def describe(prompts: list[ChatPrompt]) -> str:
    """One line: the prompts by kind, their source documents, the documents that did not parse."""
    counts = Counter(p.kind for p in prompts)
    by_kind = ", ".join(f"{kind} {counts[kind]}" for kind in KINDS if counts[kind])
    documents = len({p.document for p in prompts})
    unparsed = getattr(prompts, "unparsed", ())
    skipped = f"; skipped {len(unparsed)} documents that do not parse" if unparsed else ""
    return f"{len(prompts)} chat prompts ({by_kind or 'none'}) from {documents} source documents{skipped}"


def _split_documents(corpus: Corpus, split: str) -> tuple[Document, ...]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return corpus.train if split == "train" else corpus.held_out


def _check_kinds(kinds) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"unknown prompt kinds {unknown}; choose one or more of {', '.join(KINDS)}"
            if unknown
            else f"no prompt kinds asked for; choose one or more of {', '.join(KINDS)}"
        )
    return tuple(dict.fromkeys(kinds))


# --- functions ---------------------------------------------------------------------------------


def find_functions(documents, max_source_chars: int = 1200) -> tuple[list[Function], list[str]]:
    """(the functions of the documents, in document and source order, each distinct source
    once; the names of the documents that do not parse)."""
    functions, unparsed, seen = [], [], set()
    for document in documents:
        tree = _parse(document.text)
        if tree is None:
            unparsed.append(document.name)
            continue
        for function in _functions_in(document, tree, max_source_chars):
            if function.source not in seen:
                seen.add(function.source)
                functions.append(function)
    return functions, unparsed


def _parse(text: str) -> ast.Module | None:
    with warnings.catch_warnings():  # invalid escape sequences and the like: not our concern here
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None


def _functions_in(document: Document, tree: ast.Module, max_chars: int) -> list[Function]:
    lines = _split_lines(document.text)
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str, class_name: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child.name)
            elif isinstance(child, FunctionNode):
                qualname = prefix + child.name
                if child.end_lineno - child.lineno + 1 >= MIN_LINES:  # pyright: ignore[reportOptionalOperand]  # parsed: set
                    source = _source(lines, child)
                    if len(source) <= max_chars:
                        found.append(Function(document.name, qualname, class_name, child, source))
                visit(child, qualname + ".", None)
            elif isinstance(child, _HOLDS_STATEMENTS):  # expressions hold no def: not walked
                visit(child, prefix, class_name)

    visit(tree, "", None)
    return found


_HOLDS_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)
_LINE = re.compile(r"(.*?(?:\r\n|\n|\r|$))")  # as ast.get_source_segment splits (form feeds stay)


def _split_lines(text: str) -> list[str]:
    return [match[0] for match in _LINE.finditer(text)]


def _source(lines: list[str], node: ast.stmt) -> str:
    """ast.get_source_segment(text, node) (which would split the whole text into lines once per
    function; column offsets count UTF-8 bytes), less the def line's indentation on every line
    that starts with it. (textwrap.dedent would leave a method indented when a string in it
    has a line less indented.)"""
    start, end, start_col, end_col = node.lineno, node.end_lineno, node.col_offset, node.end_col_offset
    assert end is not None and end_col is not None  # ast.parse sets them
    first, last = lines[start - 1].encode(), lines[end - 1].encode()
    if start == end:
        return first[start_col:end_col].decode()
    indent = first[:start_col].decode()  # whitespace: a def statement starts its line
    rest = "".join(lines[start : end - 1]) + last[:end_col].decode()
    rest = "".join(line[len(indent) :] if line.startswith(indent) else line for line in _split_lines(rest))
    return _unix_newlines(first[start_col:].decode() + rest)


def _unix_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _own_nodes(node: ast.AST):
    """The nodes of a function's own body: not of the functions, lambdas and classes in it."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(child))


def _parameters(node: FunctionNode, is_method: bool) -> list[str]:
    """Its named parameters (not *args, **kwargs), without a method's self or cls."""
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
    if is_method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return names


def summary(node: FunctionNode) -> str | None:
    """The first paragraph of its docstring on one line, if it qualifies (see the terms)."""
    docstring = ast.get_docstring(node, clean=True)
    if not docstring:
        return None
    text = " ".join(re.split(r"\n\s*\n", docstring.strip(), maxsplit=1)[0].split())
    low, high = SUMMARY_CHARS
    if not low <= len(text) <= high or text.endswith(":") or ">>>" in text:
        return None
    return text


# --- prompts -----------------------------------------------------------------------------------


def _prompt(function: Function, kinds: tuple[str, ...], rng: random.Random) -> ChatPrompt | None:
    text = summary(function.node) if "write" in kinds else None
    fitting = [kind for kind in kinds if kind != "write" or text is not None]
    if not fitting:
        return None
    kind = rng.choices(fitting, weights=[KIND_WEIGHTS[k] for k in fitting])[0]
    if kind == "write":
        assert text is not None  # "write" fits only with a summary
        content = _write_request(function, text, rng)
    elif kind == "edit":
        content = f"{EDIT_OPENING} so that it {_edit_instruction(function, rng)}:\n\n{code_block(function)}"
    else:
        content = f"{EXPLAIN_OPENING} Python code does:\n\n{code_block(function)}"
    return ChatPrompt(({"role": "user", "content": content},), kind, function.where)


EDIT_OPENING = "Edit this function"  # how an edit request starts
EXPLAIN_OPENING = "Explain what this"  # how an explain request starts (a write request starts otherwise)


def kind_of(user_message: str) -> str:
    """The kind of a user message these prompts wrote (write, edit or explain), from its opening."""
    if user_message.startswith(EDIT_OPENING):
        return "edit"
    return "explain" if user_message.startswith(EXPLAIN_OPENING) else "write"


def code_block(function: Function) -> str:
    """The function's source as a Markdown Python block, as the prompts show code."""
    return f"```python\n{function.source.rstrip()}\n```"


VERB_TEMPLATES = (  # for a summary that starts with a verb: {third} "returns ...", {base} "return ..."
    "Write {callable} that {third}.",
    "Can you write {callable} that {third}?",
    "Implement {callable}. It should {base}.",
    "I need {callable} to {base}. Please write it.",
    "Write the code of {callable}: it should {base}.",
)
DESCRIPTION_TEMPLATES = (  # for any other summary, quoted as it is
    'Write {callable}. Its docstring says: "{text}"',
    "Implement {callable} that matches this description: {text}",
    "Write {callable} as described here: {text}",
)
# Verbs docstring summaries start with ("Return the ...", "Returns the ..."): these read on after
# "that" and "to"; any other first word is quoted in a description template.
VERBS = frozenset(
    """
    acquire activate add adjust append apply ask assert bind build calculate call cancel change check
    clean clear close collect compare compile compute configure connect construct convert copy count create
    decode define delegate delete describe determine display do dump emit encode ensure escape evaluate execute
    expand extend extract fetch fill filter find finish flush format generate get guess handle ignore
    initialize insert install invoke iterate join load log look make mark match merge move normalize notify
    open parse perform prepare print process produce push put query quote raise read receive register
    release remove render replace report reset resolve restore retrieve return reverse run save schedule
    search select send set show skip sort split start stop store strip take test toggle transform translate
    try turn unbind unquote unregister update validate verify wait wake walk wrap write yield
""".split()
)
_IRREGULAR = {"do": "does", "have": "has", "go": "goes", "be": "is"}


def _write_request(function: Function, text: str, rng: random.Random) -> str:
    node = function.node
    is_async = isinstance(node, ast.AsyncFunctionDef)
    signature = f"`{node.name}({ast.unparse(node.args)})`"
    if function.class_name is None:
        callable_ = f"{'an async' if is_async else 'a'} Python function {signature}"
    else:
        callable_ = f"{'an async' if is_async else 'a'} method {signature} of a Python class `{function.class_name}`"
    first, _, rest = text.partition(" ")
    base = _base_form(first)
    if base is None:
        return rng.choice(DESCRIPTION_TEMPLATES).format(callable=callable_, text=text)
    rest = rest.rstrip(".")
    return rng.choice(VERB_TEMPLATES).format(
        callable=callable_, third=f"{_third_person(base)} {rest}".rstrip(), base=f"{base} {rest}".rstrip()
    )


def _base_form(word: str) -> str | None:
    """ "Return" or "Returns" -> "return"; None for a word that is not a capitalized verb of VERBS."""
    if not (word[:1].isupper() and word[1:].islower() and word.isalpha()):
        return None  # "URL", "True", "sys.path", "Internal:": keep as written
    word = word.lower()
    if word in VERBS:
        return word
    candidates = [base for base, third in _IRREGULAR.items() if third == word]
    candidates += [word[:-3] + "y", word[:-2], word[:-1]]
    return next((c for c in candidates if c in VERBS and _third_person(c) == word), None)


def _third_person(verb: str) -> str:
    if verb in _IRREGULAR:
        return _IRREGULAR[verb]
    if verb.endswith(("s", "x", "z", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in tuple("aeiou"):
        return verb[:-1] + "ies"
    return verb + "s"


# Edits, each for "Edit this function so that it ...", and which functions each fits.
EDIT_INSTRUCTIONS = {
    "type hints": "has type hints for its parameters and return value",
    "docstring": "has a docstring that says what it does",
    "rename": "uses the name `{new}` for its parameter `{old}` (rename it everywhere)",
    "validate": "raises ValueError when it is given invalid input",
    "list": "returns a list instead of yielding its items",
    "logging": "logs what it does with the logging module",
    "simplify": "is simpler, without changing its behaviour",
    "f-strings": "uses f-strings for its string formatting",
    "none": "handles arguments that are None",
    "iterative": "works without recursion",
    "early return": "returns early instead of nesting its conditions",
    "comments": "has comments explaining each step",
}
RENAMES = {
    "s": "text",
    "n": "count",
    "x": "value",
    "v": "value",
    "i": "index",
    "k": "key",
    "f": "file",
    "fn": "func",
    "func": "callback",
    "cb": "callback",
    "d": "mapping",
    "l": "items",
    "lst": "items",
    "seq": "sequence",
    "obj": "target",
    "o": "obj",
    "c": "char",
    "p": "path",
    "m": "match",
    "a": "first",
    "b": "second",
    "e": "error",
    "t": "value",
    "fp": "stream",
    "buf": "buffer",
    "msg": "message",
    "val": "value",
    "num": "number",
    "sep": "separator",
    "name": "label",
    "data": "payload",
}


def _edit_instruction(function: Function, rng: random.Random) -> str:
    key = rng.choice(_fitting_edits(function))
    if key != "rename":
        return EDIT_INSTRUCTIONS[key]
    old = rng.choice(_parameters(function.node, function.class_name is not None))
    return EDIT_INSTRUCTIONS["rename"].format(old=old, new=_new_name(function.node, old))


def _fitting_edits(function: Function) -> list[str]:
    node = function.node
    own = list(_own_nodes(node))
    has_parameters = bool(_parameters(node, function.class_name is not None))
    fits = {
        "type hints": node.returns is None and not any(a.annotation for a in _all_arguments(node)),
        "docstring": ast.get_docstring(node) is None,
        "rename": has_parameters,
        "validate": has_parameters,
        "list": isinstance(node, ast.FunctionDef) and any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in own),
        "logging": True,
        "simplify": True,
        "f-strings": any(_old_formatting(n) for n in own),
        "none": has_parameters,
        "iterative": any(_calls_itself(n, node.name) for n in own),
        "early return": any(
            isinstance(n, ast.If) and (n.orelse or any(isinstance(b, ast.If) for b in n.body)) for n in own
        ),
        "comments": "#" not in function.source,
    }
    return [key for key in EDIT_INSTRUCTIONS if fits[key]]


def _all_arguments(node: FunctionNode) -> list[ast.arg]:
    args = node.args
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]


def _old_formatting(node: ast.AST) -> bool:
    """ "..." % args or "...".format(...)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
    )


def _calls_itself(node: ast.AST, name: str) -> bool:
    """A call of name(...), self.name(...) or cls.name(...)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == name
    return (
        isinstance(func, ast.Attribute)
        and func.attr == name
        and isinstance(func.value, ast.Name)
        and func.value.id in ("self", "cls")
    )


def _new_name(node: FunctionNode, old: str) -> str:
    """A new name for parameter old that no name of the function uses yet."""
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in _all_arguments(node)}
    used.add(node.name)
    candidates = [RENAMES.get(old), f"input_{old}", f"{old}_value", *(f"{old}_{i}" for i in range(2, len(used) + 3))]
    return next(c for c in candidates if c and c not in used)


def _interleave(groups: list[list]) -> list:
    """The groups merged evenly: item i of a group of n sits at (i + 0.5) / n of the way."""
    keyed = [((i + 0.5) / len(group), g, i) for g, group in enumerate(groups) for i in range(len(group))]
    return [groups[g][i] for _, g, i in sorted(keyed)]
