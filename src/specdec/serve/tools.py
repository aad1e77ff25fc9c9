"""Tool calls in chat completions: OpenAI's tools, tool_choice and parallel_tool_calls, in the format
the model's chat template teaches it (vLLM's parser names):

  hermes       Qwen2.5's, Hermes', SmolLM's: after any text, each call as
                   <tool_call>
                   {"name": "get_weather", "arguments": {"city": "Paris"}}
                   </tool_call>
  llama3_json  Llama 3.1-3.3's: the whole answer a call, {"name": ..., "parameters": {...}}, or
               several joined by "; "; an answer that does not start with "{" is text

format_for(chat_template) tells them apart (a template that writes <tool_call> is hermes's, one
that asks for "parameters" in JSON with Llama's ipython role llama3_json's; hermes otherwise);
`serve --tool-call-parser` says it where a template does not.

The tools reach the model through its chat template (its `tools` variable, as transformers and
vLLM render them). What the model may answer is held by structured output (spec/grammar.py: a Lark
grammar for llguidance, the calls' JSON inside it), so that every call names a given function and
its arguments follow that function's parameters schema:

  auto       text, or calls (hermes: text, then any calls; no call: a plain answer)
  required   one call or more, no text
  named      ({"type": "function", "function": {"name": f}}) one call of f
  none       no tools in the prompt: a plain answer

parallel_tool_calls false: one call at most. Where the tokenizer has <tool_call> and </tool_call>
as tokens of their own (Qwen2.5's), the grammar names those tokens; elsewhere it spells them out.

The answer is read back into OpenAI's message: content (the text before the calls; None when
empty) and tool_calls ([{id, type: "function", function: {name, arguments: a JSON string}}]),
with finish_reason "tool_calls" where calls were made ("stop" for a named tool, as OpenAI answers).
A stream sends the text as it comes (held back where it may begin a call), then each call whole
in one delta, once it is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdec.config import StructuredOutputsParams
from specdec.models.tokenizer import Tokenizer

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
TOOL_FORMATS = (HERMES, LLAMA3_JSON)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_SEPARATOR = "; "  # between calls in one llama3_json answer
# the calls' JSON as the chat templates write it (tojson: ", " and ": "), nothing else between tokens
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be used; the message names the field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools (OpenAI's {"type": "function", "function": {...}} entries), how it lets
    the model call them (mode: auto, required, named, none; name: the named function's), whether
    several calls may come at once, and the format the model writes them in (TOOL_FORMATS)."""

    tools: tuple[dict, ...]
    mode: str
    name: str | None = None
    parallel: bool = True
    format: str = HERMES

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template renders as the tools (None: none, for tool_choice none)."""
        return None if self.mode == "none" else list(self.tools)

    @property
    def functions(self) -> list[dict]:
        """The functions a call may name."""
        return [tool["function"] for tool in self.tools if self.name in (None, tool["function"]["name"])]

    def structured_outputs(self, tokenizer: Tokenizer | None) -> StructuredOutputsParams | None:
        """The grammar that holds the answer to the calls this choice allows (None for none)."""
        if self.mode == "none":
            return None
        grammar = _llama3_grammar(self) if self.format == LLAMA3_JSON else _hermes_grammar(self, tokenizer)
        return StructuredOutputsParams(grammar=grammar)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """An answer's (content, tool_calls) in OpenAI's shapes (see the module)."""
        return parse_llama3(text) if self.format == LLAMA3_JSON else parse(text)

    def stream(self):
        """A new stream of an answer's deltas (ToolCallStream's feed and num_calls)."""
        return Llama3CallStream() if self.format == LLAMA3_JSON else ToolCallStream()

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """OpenAI's finish reason of an answer (made_calls: whether it called a tool)."""
        return "tool_calls" if made_calls and reason == "stop" and self.mode != "named" else reason


def _hermes_grammar(choice: ToolChoice, tokenizer: Tokenizer | None) -> str:
    schema = {"anyOf": [_call_schema(f, "arguments") for f in choice.functions], "x-guidance": CALL_JSON_OPTIONS}
    has_tags = tokenizer is not None and all(tokenizer.token_to_id(tag) is not None for tag in (OPEN, CLOSE))
    open_tag, close_tag = (OPEN, CLOSE) if has_tags else (json.dumps(OPEN), json.dumps(CLOSE))
    more = "" if choice.mode == "named" or not choice.parallel else f" ({open_tag} call_body)*"
    lines = [
        f'call_body: "\\n" call "\\n" {close_tag} /\\n?/',
        f"call: %json {json.dumps(schema)}",
    ]
    if choice.mode != "auto":
        lines.insert(0, f"start: {open_tag} call_body{more}")
    elif has_tags:  # text holds no tag token: it ends where a call starts
        lines[:0] = [f"start: TEXT | TEXT {open_tag} call_body{more}", "TEXT: /(.|\\n)*/"]
    else:  # text without the tag, or text up to the first tag (a lazy match: it ends there)
        lines[:0] = [
            f"start: TEXT | text_then_tag call_body{more}",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{OPEN}(.|\\n)*/",
            f"text_then_tag[lazy]: /(.|\\n)*{OPEN}/",
        ]
    return "\n".join(lines) + "\n"


def _llama3_grammar(choice: ToolChoice) -> str:
    """Calls as Llama 3 writes them: the answer one JSON object {"name", "parameters"} (or several
    joined by "; "), or (auto) text that does not start with "{"."""
    schema = {"anyOf": [_call_schema(f, "parameters") for f in choice.functions], "x-guidance": CALL_JSON_OPTIONS}
    more = "" if choice.mode == "named" or not choice.parallel else f" ({json.dumps(LLAMA3_SEPARATOR)} call)*"
    lines = [f"calls: call{more}", f"call: %json {json.dumps(schema)}"]
    if choice.mode == "auto":
        lines[:0] = ["start: calls | TEXT", "TEXT: /[^{](.|\\n)*/"]
    else:
        lines.insert(0, "start: calls")
    return "\n".join(lines) + "\n"


def format_for(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (see the module)."""
    template = chat_template or ""
    if OPEN in template:
        return HERMES
    if '"parameters"' in template and ("ipython" in template or "python_tag" in template):
        return LLAMA3_JSON
    return HERMES


def tool_choice_from(tools, tool_choice, parallel_tool_calls, format: str = HERMES) -> ToolChoice | None:
    """A request's tool fields, checked (a ToolError names the field); None without tools.
    format: the model's tool-call format (format_for)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError(
                f"tool_choice={tool_choice!r} needs tools; give tools, or leave tool_choice out", "tool_choice"
            )
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    if len(set(names)) < len(names):
        raise ToolError(f"tools name a function twice: {sorted({n for n in names if names.count(n) > 1})}", "tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice in (None, "auto", "required", "none"):
        return ToolChoice(tuple(tools), tool_choice or "auto", parallel=bool(parallel), format=format)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, got {tool_choice!r}",
            "tool_choice",
        )
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is none of the tools ({', '.join(names)})", "tool_choice")
    return ToolChoice(tuple(tools), "named", name, bool(parallel), format)


def _check_tool(tool, index: int) -> str:
    """The function name of tools[index], checked."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise ToolError(f"tools[{index}] must be {{type: function, function: {{name, parameters}}}}", "tools")
    name, parameters = function.get("name"), function.get("parameters", {})
    if not isinstance(name, str) or not name:
        raise ToolError(f"tools[{index}].function.name must be a non-empty string", "tools")
    if not isinstance(parameters, dict):
        raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
    return name


def _call_schema(function: dict, arguments: str) -> dict:
    """The JSON schema of one call of function: its name, and under the key arguments (hermes:
    "arguments", llama3_json: "parameters") what follows its parameters."""
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments: parameters},
        "required": ["name", arguments],
        "additionalProperties": False,
    }


def parse(text: str) -> tuple[str | None, list[dict]]:
    """An answer's (content, tool_calls): the text before the first call (None if it is empty),
    and each whole call in OpenAI's shape. A call cut short (max_tokens) is left out."""
    content, _, rest = text.partition(OPEN)
    calls = []
    while rest:
        body, closed, rest = rest.partition(CLOSE)
        if not closed:
            break
        call = json.loads(body)
        calls.append(_openai_call(call["name"], call["arguments"]))
        rest = rest.partition(OPEN)[2]
    return (content.strip() if calls else content) or None, calls


def parse_llama3(text: str) -> tuple[str | None, list[dict]]:
    """A llama3_json answer's (content, tool_calls): calls where it starts with "{" (each whole
    one; one cut short by max_tokens left out), else its text."""
    if not text.lstrip().startswith("{"):
        return text or None, []
    calls, _ = _llama3_calls(text)
    return None, calls


def _llama3_calls(text: str, start: int = 0) -> tuple[list[dict], int]:
    """The whole calls in text from start on, and where the first one not whole begins."""
    decoder, calls = json.JSONDecoder(), []
    while True:
        position = start
        while position < len(text) and text[position] in " \n\t;":
            position += 1
        try:
            call, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls, start
        calls.append(_openai_call(call["name"], call["parameters"]))
        start = end


def _openai_call(name: str, arguments) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallStream:
    """An answer's text, fed as it streams, as OpenAI's deltas: content as it comes (less a tail
    that may begin a call), then each call whole, once its closing tag is there."""

    def __init__(self) -> None:
        self.text = ""  # all fed so far
        self.sent = 0  # how much of it the deltas have covered
        self.num_calls = 0

    def feed(self, new_text: str, final: bool = False) -> list[dict]:
        """The deltas new_text makes (final: the answer is over; a tail held back goes out)."""
        self.text += new_text
        deltas = []
        start = self.text.find(OPEN, self.sent) if self.num_calls == 0 else self.sent
        if self.num_calls == 0:
            end = len(self.text) if start < 0 else start
            if start < 0 and not final:  # hold back what may begin a call
                end -= max((n for n in range(1, len(OPEN)) if self.text.endswith(OPEN[:n])), default=0)
            if end > self.sent:
                deltas.append({"content": self.text[self.sent : end]})
                self.sent = end
            if start < 0:
                return deltas
        while True:
            closing = self.text.find(CLOSE, self.sent)
            if closing < 0:
                return deltas
            body = json.loads(self.text[self.sent : closing].partition(OPEN)[2])
            call = {"index": self.num_calls, **_openai_call(body["name"], body["arguments"])}
            deltas.append({"tool_calls": [call]})
            self.num_calls += 1
            self.sent = closing + len(CLOSE)


class Llama3CallStream:
    """A llama3_json answer fed as it streams, as OpenAI's deltas: text as it comes where the
    answer does not start with "{", else each call whole once its JSON object is complete."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.num_calls = 0
        self.calls: bool | None = None  # whether the answer is calls (None: not known yet)

    def feed(self, new_text: str, final: bool = False) -> list[dict]:
        self.text += new_text
        if self.calls is None and self.text.strip():
            self.calls = self.text.lstrip().startswith("{")
        if not self.calls:
            if self.calls is None:  # only whitespace so far: it may still start a call
                return [{"content": self.text}] if final and self.text else []
            deltas = [{"content": self.text[self.sent :]}] if len(self.text) > self.sent else []
            self.sent = len(self.text)
            return deltas
        calls, self.sent = _llama3_calls(self.text, self.sent)
        deltas = [{"tool_calls": [{"index": self.num_calls + i, **call}]} for i, call in enumerate(calls)]
        self.num_calls += len(calls)
        return deltas


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as a chat template reads them: an assistant's tool calls' arguments as objects
    (OpenAI sends them as JSON strings; templates write them with tojson, as vLLM passes them)."""
    return [_with_parsed_arguments(message) for message in messages]


def _with_parsed_arguments(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(function, dict) and isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except json.JSONDecodeError:
                raise ToolError(f"a tool call's arguments are not JSON: {arguments[:60]!r}", "messages") from None
        parsed.append(call)
    return {**message, "tool_calls": parsed}
