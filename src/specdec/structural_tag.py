"""Structural tags (vLLM's structured output `structural_tag`, xgrammar's "triggered tags"): free
text, in which each tag the model opens must be whole and hold JSON of the tag's schema.

    {"structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

Terms:
  trigger    a string that, wherever it appears in the output, starts a tag: the text must go
             on as the begin of one of the structures that starts with it
  structure  begin, then JSON that follows schema, then end; free text again after it

Outside the tags the text is anything that holds no trigger (a trigger's first characters at the
very end of the output are allowed: the output may end before a tag is opened). The tags become a
Lark grammar for llguidance (spec/grammar.py, which compiles it; StructuredOutputsParams checks
the tags when it is made): each stretch of free text up to a trigger is one
lexeme that ends at the trigger, its first occurrence; then the rest of a begin that starts with
that trigger, the JSON (llguidance's %json) and the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: dict
    end: str


@dataclass(frozen=True)
class StructuralTag:
    structures: tuple[Structure, ...]
    triggers: tuple[str, ...]


def parse(spec: dict | str) -> StructuralTag:
    """spec (a dict or its JSON text) as a StructuralTag; a ValueError names what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structural_tag is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structural_tag must be an object with structures and triggers, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag has fields {unknown} it does not take (structures, triggers)")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag's triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag's structures must be a non-empty list of {begin, schema, end}")
    tag = StructuralTag(tuple(_structure(s, i, triggers) for i, s in enumerate(structures)), tuple(triggers))
    idle = [t for t in triggers if not any(s.begin.startswith(t) for s in tag.structures)]
    if idle:
        raise ValueError(f"structural_tag's triggers {idle} begin no structure: each must start one's begin")
    return tag


def _structure(spec, index: int, triggers: list[str]) -> Structure:
    where = f"structural_tag's structures[{index}]"
    if not isinstance(spec, dict) or set(spec) != {"begin", "schema", "end"}:
        raise ValueError(f"{where} must be an object of exactly begin, schema and end")
    begin, schema, end = spec["begin"], spec["schema"], spec["end"]
    if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
        raise ValueError(f"{where}: begin and end must be strings and schema a JSON schema (an object)")
    if not any(begin.startswith(trigger) for trigger in triggers):
        raise ValueError(f"{where}: its begin {begin!r} starts with none of the triggers {triggers}")
    return Structure(begin, schema, end)


def lark_grammar(tag: StructuralTag) -> str:
    """The Lark grammar (llguidance's dialect) of the outputs tag allows."""
    any_trigger = "(" + "|".join(_regex_literal(t) for t in tag.triggers) + ")"
    lines = ["start: segment* TEXT?", "segment: " + " | ".join(f"tag_{i}" for i in range(len(tag.triggers)))]
    for k, trigger in enumerate(tag.triggers):
        # text holding no trigger, then this one (its first: none may end earlier)
        lines.append(f"text_then_{k}[lazy]: /(.|\\n)*{_regex_literal(trigger)}/ & ~/(.|\\n)*{any_trigger}(.|\\n)+/")
        tails = [
            f"text_then_{k} {_string(s.begin[len(trigger) :])} json_{i} {_string(s.end)}"
            for i, s in enumerate(tag.structures)
            if s.begin.startswith(trigger)
        ]
        lines.append(f"tag_{k}: " + " | ".join(tails))
    for i, structure in enumerate(tag.structures):
        lines.append(f"json_{i}: %json {json.dumps(structure.schema)}")
    lines.append(f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{any_trigger}(.|\\n)*/")
    return "\n".join(lines) + "\n"


def _string(text: str) -> str:
    """text as a Lark string literal (empty: nothing)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _regex_literal(text: str) -> str:
    """text as a regex matching it literally (inside Lark's /.../): every ASCII character but
    letters and digits as a \\x{..} escape."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):02X}}}" for c in text)
