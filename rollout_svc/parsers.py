"""Tool-call parsers: the tool calls in the text of one model turn.

The agent loop decodes a model turn's output ids (special tokens kept, the end-of-turn token
left out) and asks the parser named in the config for the calls in it. Each parser is a plain
function `parse(text) -> ParsedTurn`, registered in `PARSERS`.

Malformed calls are not dropped silently (verl's hermes parser logs and drops them): each one
becomes an entry of `ParsedTurn.errors` saying what was wrong, with the offending text, so the
agent loop can answer it with a tool error the model learns from. A call is well formed when
it is a JSON object with a string `name` and an object of arguments; `arguments` is handed on
as JSON text (`json.dumps(obj, ensure_ascii=False)`, the same text the chat templates render),
because the tool service takes text. NaN and Infinity are not JSON and count as malformed, as
do a number too large for a float (`1e999`, which would come back as Infinity) and a string
escaping half of a surrogate pair (`"\\ud800"`, which no UTF-8 text, so no request, can hold).

Calls written while thinking (`<tool_call>` inside `<think>...</think>`, which Qwen3 models
sometimes do) are parsed and run like any other call, as verl and SGLang do. The rollout
records what the model did; judging it is the reward's job (reward_svc's `format` scorer
subtracts its think-tool-call penalty), and a run that ignored those calls would end the
trajectory on a turn the model meant as a tool call.
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnrl.messages import openai_tool_call

MAX_ERROR_TEXT_CHARS = 200
# How much text before a stray `</tool_call>` its error message quotes.
STRAY_CLOSER_CONTEXT_CHARS = 150


@dataclass(frozen=True)
class ParsedToolCall:
    """One well-formed tool call."""

    id: str  # "call_<n>": n counts the turn's well-formed calls from 0, in order
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its text and its tool calls."""

    # The turn's text without tool-call markup, stripped of surrounding whitespace; the text
    # exactly as given when it holds no tool-call markup at all.
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    # One message per malformed call: what was wrong and the offending text (clipped).
    errors: list[str] = field(default_factory=list)

    def assistant_message(self) -> dict[str, Any]:
        """The OpenAI assistant message that stands for the turn in the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                openai_tool_call(call.id, call.name, call.arguments) for call in self.tool_calls
            ]
        return message


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


_JSON = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def _clipped(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_TEXT_CHARS else text[:MAX_ERROR_TEXT_CHARS] + "..."


def _malformed(problem: str, text: str) -> str:
    return f"malformed tool call ({problem}): {_clipped(text)!r}"


def _json_problem(error: Exception, start: int = 0) -> str:
    """What was wrong with JSON text that begins at char `start` of the decoded string."""
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg} at char {error.pos - start}"
    if isinstance(error, RecursionError):
        return "not JSON: nested too deeply"
    return f"not JSON: {error}"


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _validated_call(
    value: Any, argument_keys: tuple[str, ...], index: int, text: str
) -> ParsedToolCall | str:
    """The call `value` describes, or an error message saying why it is malformed."""
    if not isinstance(value, dict):
        return _malformed(f"a JSON {_json_type(value)}, not an object", text)
    if not isinstance(value.get("name"), str):
        return _malformed("no string 'name'", text)
    key = next((k for k in argument_keys if k in value), None)
    if key is None:
        return _malformed(f"no {argument_keys[0]!r} object", text)
    if not isinstance(value[key], dict):
        return _malformed(f"{key!r} is a JSON {_json_type(value[key])}, not an object", text)
    arguments = json.dumps(value[key], ensure_ascii=False)
    try:
        (value["name"] + arguments).encode()
    except UnicodeEncodeError:
        return _malformed("a \\u escape of half a surrogate pair is not text", text)
    return ParsedToolCall(id=f"call_{index}", name=value["name"], arguments=arguments)


def _collect(result: ParsedToolCall | str, calls: list[ParsedToolCall], errors: list[str]) -> None:
    (calls if isinstance(result, ParsedToolCall) else errors).append(result)


# A block ends at its closing tag; an unclosed one at the next opening tag or the end of text.
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_HERMES_CLOSE = "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes-style calls (Qwen2.5, Qwen3, Hermes): any number of
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks anywhere in the text.

    A block that is never closed (generation cut off) or holds no valid call, and a
    `</tool_call>` with no opening tag, each give one error. `content` is the text with every
    block removed.
    """
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    block_ends: set[int] = set()
    for block in _HERMES_BLOCK.finditer(text):
        body = block.group(1)
        if block.group(2) != _HERMES_CLOSE:
            errors.append(_malformed("<tool_call> never closed by </tool_call>", body))
            continue
        block_ends.add(block.end())
        try:
            value = _JSON.decode(body.strip())
        except (ValueError, RecursionError) as e:
            errors.append(_malformed(_json_problem(e), body))
            continue
        _collect(_validated_call(value, ("arguments",), len(calls), body), calls, errors)
    for closer in re.finditer(_HERMES_CLOSE, text):
        if closer.end() not in block_ends:
            preceding = text[max(0, closer.start() - STRAY_CLOSER_CONTEXT_CHARS) : closer.end()]
            errors.append(_malformed("</tool_call> without an opening <tool_call>", preceding))
    if not calls and not errors:
        return ParsedTurn(content=text)
    return ParsedTurn(content=_HERMES_BLOCK.sub("", text).strip(), tool_calls=calls, errors=errors)


_PYTHON_TAG = "<|python_tag|>"
# Where to pick up again after a call that is not JSON: the next object opening with "name".
_LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.1/3.2 JSON calls: the turn is `{"name": ..., "parameters": {...}}`, optionally
    after text ending in `<|python_tag|>`; several calls are separated by `;` (SGLang's
    convention), newlines, or given as one JSON array.

    The Llama templates render a call as the whole assistant message, so text that opens with
    `{` or `[` is read as calls even without the tag. Arguments may also be under "arguments"
    (Llama 3.2 models use both). Text after the last call is kept as content. Built-in tool
    calls (`brave_search.call(query=...)`, raw Python after the tag) are not JSON: errors.
    """
    before, tag, after = text.partition(_PYTHON_TAG)
    if tag:
        prefix, region = before, after
    elif text.lstrip().startswith(("{", "[")):
        prefix, region = "", text
    else:
        return ParsedTurn(content=text)
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    if tag and not region.strip():
        errors.append(_malformed("nothing after <|python_tag|>", text))
    trailing = ""
    position = _skip_space(region, 0)
    while position < len(region):
        try:
            value, end = _JSON.raw_decode(region, position)
        except (ValueError, RecursionError) as e:
            resume = _LLAMA_CALL_START.search(region, position + 1)
            stop = resume.start() if resume else len(region)
            bad_text = region[position:stop].rstrip("; \n")
            errors.append(_malformed(_json_problem(e, start=position), bad_text))
            position = stop
            continue
        call_text = region[position:end]
        for item in value if isinstance(value, list) else [value]:
            result = _validated_call(item, ("parameters", "arguments"), len(calls), call_text)
            _collect(result, calls, errors)
        position = _skip_space(region, end)
        if region.startswith(";", position):
            position = _skip_space(region, position + 1)
        elif not region.startswith(("{", "["), position):
            trailing = region[position:]
            break
    content = "\n".join(part for part in (prefix.strip(), trailing.strip()) if part)
    return ParsedTurn(content=content, tool_calls=calls, errors=errors)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}

# The text that may open a call, per parser. A turn's text before the first of these is its
# content as it is being written, so the gateway streams it; what follows may be a call.
CALL_OPENINGS: dict[Callable[[str], ParsedTurn], tuple[str, ...]] = {
    parse_hermes: ("<tool_call>",),
    parse_llama3_json: (_PYTHON_TAG, "{", "["),  # a brace anywhere: JSON calls need no tag
}
