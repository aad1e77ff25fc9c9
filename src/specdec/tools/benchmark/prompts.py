"""Prompt sets for benchmarks.

held-out code prompts: a held-out standard-library module's text cut just after one of its
function's `def` line (the signature, up to its colon), so the model writes the body. The line
break stays out of the prompt: byte-level BPE merges a line break with the next line's
indentation, so a prompt ending in a bare line break would tell the model that the next line
starts at column 0. Only modules in corpus.HELD_OUT_MODULES are used: the shipped pair never saw them.

repeated code prompts: a held-out module's function, whole, then a comment asking for the same
function under a new name and that renamed function's signature, so the body the model writes
copies code already in the prompt (editing and refactoring look like this; prompt lookup
shines here).

held-out chat prompts: a user message about a held-out module's function (training/chat_prompts.py:
write it from its docstring, edit it, explain it), for a chat model: the bench renders it with
the model's chat template. edit prompts: only the "edit this function" ones, whose answers
repeat much of the prompt.

batch job prompts: one instruction (describe a function as JSON) over held-out functions the
chat prompts do not use, sent one after another: what repeats is across requests (the JSON's
scaffolding), which only a drafter that remembers earlier answers (suffix decoding) can draft.
"""

from __future__ import annotations

import ast
import codeop
import textwrap
import warnings
from dataclasses import dataclass

from specdec.tools.training.corpus import HELD_OUT_MODULES, stdlib_path

MIN_BODY_LINES = 3  # repeated code prompts copy functions with at least this many lines of body


@dataclass(frozen=True)
class Prompt:
    name: str  # "module.py:function"
    text: str  # the prompt; a chat prompt's user message
    before: str = ""  # the file's text before `text`, cut off to keep the prompt short
    chat: bool = False  # text is a user message, to be rendered with the model's chat template

    def lines_that_parse(self, completion: str) -> tuple[int, int]:
        """(parsing, whole): of the completion's whole non-blank lines (its last, unfinished line
        left out), how many Python's parser accepts after the prompt: the longest run of them,
        from the first, that is valid Python after the file's text up to the prompt's end, either
        complete or valid so far (a block, bracket or string the cut left open, as the parser
        of the interactive prompt judges it). A body written well parses whole; one that is not
        Python parses none. A chat prompt's answer is prose around code: (0, 0)."""
        if self.chat:
            return 0, 0
        whole_lines = completion[: completion.rfind("\n") + 1].splitlines(keepends=True)
        ends = [i + 1 for i, line in enumerate(whole_lines) if line.strip()]  # just past each non-blank line
        for parsing in range(len(ends), 0, -1):
            if _valid_so_far(self.before + self.text + "".join(whole_lines[: ends[parsing - 1]])):
                return parsing, len(ends)
        return 0, len(ends)


def held_out_code_prompts(per_module: int = 2, max_chars: int = 1200) -> list[Prompt]:
    """Up to per_module prompts from each held-out module: the last max_chars characters of the
    file up to the end of a `def` line, starting at a line start."""
    prompts = []
    for module, source in held_out_sources():
        for name, cut in _def_line_ends(source)[:per_module]:
            start = 0
            if cut > max_chars:
                start = source.index("\n", cut - max_chars) + 1
            prompts.append(Prompt(f"{module}:{name}", source[start:cut], before=source[:start]))
    return prompts


def repeated_code_prompts(per_module: int = 1, max_chars: int = 1200) -> list[Prompt]:
    """Up to per_module prompts from each held-out module: one of its functions (dedented, with
    a body of at least MIN_BODY_LINES lines), a comment, and the same signature renamed to
    <name>_copy, ready for the copied body; each prompt at most max_chars long."""
    prompts = []
    for module, source in held_out_sources():
        fitting = []
        for span in _function_spans(source):
            text = _repeat_prompt(source, span)
            if text is not None and len(text) <= max_chars:
                fitting.append(Prompt(f"{module}:{span.name} (repeat)", text))
        step = max(1, len(fitting) // per_module)
        prompts += fitting[step // 2 :: step][:per_module]
    return prompts


def held_out_chat_prompts(
    per_module: int = 2, max_chars: int = 1200, kinds: tuple[str, ...] = ("write", "edit", "explain")
) -> list[Prompt]:
    """per_module chat prompts per held-out module (at most), of these kinds, about functions of
    at most max_chars characters."""
    from specdec.tools.training.chat_prompts import chat_prompts
    from specdec.tools.training.corpus import Corpus, Document

    sources = list(held_out_sources())
    corpus = Corpus(stdlib_path(), (), tuple(Document(module, source) for module, source in sources))
    prompts = chat_prompts(corpus, "held_out", kinds, limit=per_module * len(sources), max_source_chars=max_chars)
    return [Prompt(f"{p.source} ({p.kind})", p.messages[-1]["content"], chat=True) for p in prompts]


def held_out_edit_prompts(per_module: int = 2, max_chars: int = 1200) -> list[Prompt]:
    return held_out_chat_prompts(per_module, max_chars, kinds=("edit",))


# One instruction over many inputs, as a script or an agent sends it (suffix decoding's workload)
BATCH_INSTRUCTION = (
    'Describe this Python function as JSON with the keys "name", "parameters" (a list of objects with the keys '
    '"name", "type" and "default"), "returns" and "summary" (one sentence). Answer with the JSON alone.'
)
EVAL_KINDS = (("write",), ("edit",), ("write", "edit", "explain"))  # the chat sets the bench draws


def batch_job_prompts(per_module: int = 2, max_chars: int = 1200) -> list[Prompt]:
    """A batch job: BATCH_INSTRUCTION over the functions of the held-out modules that no chat
    set of the bench uses (for the same per_module and max_chars), per_module x 2 from each
    module at most, module by module: the bench sends them one after another."""
    from specdec.tools.training.chat_prompts import code_block, find_functions
    from specdec.tools.training.corpus import Document

    used = {
        prompt.name.rpartition(" (")[0]
        for kinds in EVAL_KINDS
        for prompt in held_out_chat_prompts(per_module, max_chars, kinds=kinds)
    }
    prompts = []
    for module, source in held_out_sources():
        functions, _ = find_functions([Document(module, source)], max_chars)
        unused = [f for f in functions if f.where not in used][: per_module * 2]
        prompts += [Prompt(f"{f.where} (batch)", f"{BATCH_INSTRUCTION}\n\n{code_block(f)}", chat=True) for f in unused]
    return prompts


def held_out_sources():
    """(module file name, source) of each held-out module this Python has."""
    for module in HELD_OUT_MODULES:
        file = stdlib_path() / module
        if file.is_file():
            yield module, file.read_text(encoding="utf-8")


@dataclass(frozen=True)
class _FunctionSpan:
    lineno: int
    name: str
    start: int  # offset of the `def` line's first character
    signature_end: int  # offset just past the signature's line break
    end: int  # offset just past the function's last line


def _repeat_prompt(source: str, span: _FunctionSpan) -> str | None:
    """The function, a comment, and its signature renamed; None for a body too short to copy."""
    lines = textwrap.dedent(source[span.start : span.end]).splitlines(keepends=True)
    num_signature_lines = source[span.start : span.signature_end].count("\n")
    if len(lines) - num_signature_lines < MIN_BODY_LINES or lines[0][:1].isspace():
        return None  # too short, or a string inside is less indented than the def
    new_name = f"{span.name}_copy"
    signature = "".join(lines[:num_signature_lines]).replace(f"def {span.name}(", f"def {new_name}(", 1)
    comment = f"# The same function again, renamed from {span.name} to {new_name}:\n"
    return "".join(lines).rstrip() + "\n\n\n" + comment + signature.rstrip("\r\n")  # no bare line break: see above


def _valid_so_far(source: str) -> bool:
    """Whether source is Python code, complete or cut off before its end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for a bad escape in a string the model wrote
        try:
            codeop.compile_command(source, symbol="exec")  # None for code cut off: still valid
        except (SyntaxError, ValueError, OverflowError):  # ValueError: a null byte; OverflowError: a huge literal
            return False
    return True


def _function_spans(source: str) -> list[_FunctionSpan]:
    """Every function whose body starts on a later line than its `def`, in source order."""
    lines = source.splitlines(keepends=True)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno > node.lineno:
            last = node.body[0].lineno - 2  # 0-based: the line before the body
            while last > node.lineno - 1 and (not lines[last].strip() or lines[last].lstrip().startswith("#")):
                last -= 1  # comments and blank lines between the signature and the body
            found.append(
                _FunctionSpan(
                    node.lineno,
                    node.name,
                    line_starts[node.lineno - 1],
                    line_starts[last + 1],
                    line_starts[node.end_lineno],  # pyright: ignore[reportCallIssue, reportArgumentType]  # parsed: set
                )
            )
    return sorted(found, key=lambda span: span.lineno)


def _def_line_ends(source: str) -> list[tuple[str, int]]:
    """(function name, offset just past its signature's colon), for functions whose body
    starts on a later line, spread evenly through the file."""
    found = _function_spans(source)
    step = max(1, len(found) // 4)
    return [(span.name, len(source[: span.signature_end].rstrip("\r\n"))) for span in found[step // 2 :: step]]
