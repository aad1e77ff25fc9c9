"""Every field a client may send in a request body, and what this server does with it.

A field is one of three kinds:
  honoured  a field of the request models (protocol.py) that specdec does what the API says
            with (temperature, stop, logprobs, ...);
  refused   a field of OpenAI's or vLLM's API that changes what is generated, or the shape of the
            answer, and that specdec does not do yet: a request that sets it to anything but
            its neutral value (the API's default, which changes nothing) is a 400 that names it;
  ignored   a field that cannot change what is generated (who sent it, how to bill or cache it):
            accepted and dropped, as OpenAI and vLLM accept it.
A field in none of these lists is refused as well: the server cannot know that a field it has
never heard of leaves the output alone, and an application that believes its output follows a
schema because the server answered 200 is worse off than one told no.

The lists follow the official openai client's request types (tests walk them) and vLLM's
OpenAI server (vllm/entrypoints/openai/protocol.py: its sampling and extra parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

COMPLETIONS, CHAT = "completions", "chat"


@dataclass(frozen=True)
class Refused:
    """A field specdec does not do: neutral(value) says whether the value changes nothing;
    instead: what to do instead, in the error."""

    neutral: Callable[[object], bool]
    instead: str = "leave it out"


def _one_of(*values) -> Callable[[object], bool]:
    """Neutral when the value is one of values (a bool is never taken for 0 or 1)."""
    return lambda value: any(type(value) is type(v) and value == v for v in values)


def _absent(value) -> bool:
    return value is None


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _unit(value) -> bool:
    return value is None or (type(value) in (int, float) and value == 1)


def _no_tool(value) -> bool:
    return value is None or value == "none"


def _text_only(value) -> bool:
    return value is None or value == ["text"]


STRUCTURED_BACKEND = "structured output runs on llguidance here; leave it out, or give 'guidance'"
TOOLS = "functions and function_call are OpenAI's older names: send tools and tool_choice"

# field -> which of its values change nothing, and what to do instead (on both endpoints)
REFUSED: dict[str, Refused] = {
    # OpenAI's API
    "functions": Refused(_empty, TOOLS),
    "function_call": Refused(_no_tool, TOOLS),
    "audio": Refused(_absent, "this server answers in text; leave it out"),
    "modalities": Refused(_text_only, "this server answers in text; leave it out or send ['text']"),
    "reasoning_effort": Refused(_absent),
    "verbosity": Refused(_absent),
    "web_search_options": Refused(_absent, "this server has no web search; leave it out"),
    "moderation": Refused(_absent),
    # vLLM's sampling parameters
    "use_beam_search": Refused(_one_of(None, False)),
    "length_penalty": Refused(_unit),
    "spaces_between_special_tokens": Refused(_one_of(None, True)),
    "logits_processors": Refused(_empty),
    # vLLM's structured output
    "guided_decoding_backend": Refused(_one_of(None, "auto", "guidance", "llguidance"), STRUCTURED_BACKEND),
    # vLLM's extra parameters: what the prompt is made of, and the answer's shape
    "chat_template": Refused(_empty, "the model's own chat template renders every conversation; leave it out"),
    "mm_processor_kwargs": Refused(_empty, "this server takes text; leave it out"),
    "prompt_embeds": Refused(_empty, "send the prompt as text or token ids"),
    "vllm_xargs": Refused(_empty),
    "include_reasoning": Refused(_one_of(None, True)),
}

# fields that cannot change what is generated, with why
IGNORED: dict[str, str] = {
    "user": "who the end user is, for the provider's abuse checks",
    "safety_identifier": "who the end user is, for the provider's abuse checks",
    "metadata": "tags for the provider's dashboard",
    "store": "whether the provider keeps the answer",
    "service_tier": "the provider's billing tier",
    "prompt_cache_key": "a hint for the provider's prompt cache",
    "prompt_cache_retention": "a hint for the provider's prompt cache",
    "prompt_cache_options": "a hint for the provider's prompt cache",
    "cache_salt": "vLLM's prefix cache isolation (specdec scopes its caches by API key)",
    "prediction": "predicted output: a hint for speed that never changes the answer",
    "priority": "vLLM's scheduling priority: when, not what",
    "request_id": "vLLM's id for its logs",
    "kv_transfer_params": "vLLM's disaggregated serving",
}


def problems(sent: dict, honoured: Iterable[str], endpoint: str) -> list[tuple[str, str]]:
    """(field, message) for each field in sent (the request's JSON body) that is refused: a
    refused field at a value that is not neutral, or a field this server does not know."""
    honoured = set(honoured)
    found = []
    for name, value in sent.items():
        refused = REFUSED.get(name)
        if refused is not None:
            if not refused.neutral(value):
                found.append((name, f"{name}={_short(value)}: not supported by this server; {refused.instead}"))
        elif name not in honoured and name not in IGNORED:
            found.append(
                (
                    name,
                    f"{name}: not a field this server knows, so it cannot tell whether it would change "
                    "the output; leave it out (fields that cannot change it, such as user, are accepted)",
                )
            )
    return found


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
