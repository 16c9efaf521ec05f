"""Tool-call format of a conversation: Hermes/Qwen `<tool_call>` blocks that parse, and none
written while thinking.

Every assistant message is checked. A call is well formed when its `<tool_call>...</tool_call>`
block holds a JSON object with a string `name` and an object `arguments`, and, when
`extra_info["tool_names"]` lists the known tools, names one of them. An unclosed block or a
stray `</tool_call>` is malformed too. A message whose text has no `<tool_call>` tag but whose
`tool_calls` field lists calls (the rollout already split them out) is graded from that field,
where `arguments` may be the raw JSON text. With no messages, `response_text` is the one
assistant message.

A call counts as written while thinking when it starts inside `<think>...</think>` (or before
a leading `</think>`, when the prompt opened the thinking) or sits in `reasoning_content`.
The score is 1.0, or 0.0 when any call is malformed, minus
`extra_info["think_tool_call_penalty"]` (0.5) when any call was written while thinking;
never below 0.0. A conversation without tool calls scores 1.0.
"""

import json
import re
from typing import Any

from reward_svc.scorers.base import Score, ScoringRequest

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def score(request: ScoringRequest) -> Score:
    """Grades the tool-call format of every assistant message (see the module docstring).

    Raises ValueError when `tool_names` is not a list of strings.
    """
    tool_names = request.extra_info.get("tool_names")
    if tool_names is not None and not (
        isinstance(tool_names, list | tuple) and all(isinstance(n, str) for n in tool_names)
    ):
        raise ValueError(f"format tool_names {tool_names!r} is not a list of tool-name strings")
    penalty = float(request.extra_info.get("think_tool_call_penalty", 0.5))
    messages = request.messages or [{"role": "assistant", "content": request.response_text}]
    counts = {"tool_calls": 0, "malformed": 0, "calls_in_think": 0}
    for message in messages:
        if message.get("role") == "assistant":
            for is_valid, in_think in _message_calls(message, tool_names):
                counts["tool_calls"] += 1
                counts["malformed"] += not is_valid
                counts["calls_in_think"] += in_think
    reward = 0.0 if counts["malformed"] else 1.0
    if counts["calls_in_think"]:
        reward = max(0.0, reward - penalty)
    return Score(score=reward, extras=counts)


def _message_calls(
    message: dict[str, Any], tool_names: list[str] | None
) -> list[tuple[bool, bool]]:
    """(well formed, written while thinking) for each tool call of one assistant message."""
    calls = []
    texts = (
        (_text(message.get("reasoning_content")), True),
        (_text(message.get("content")), False),
    )
    for text, all_thinking in texts:
        think_spans = _think_spans(text)
        closed_blocks = 0
        for block in _CALL_BLOCK.finditer(text):
            closed = block.group(2) == "</tool_call>"
            closed_blocks += closed
            is_valid = closed and _is_valid_call(_json_or_none(block.group(1)), tool_names)
            in_think = all_thinking or any(s <= block.start() < e for s, e in think_spans)
            calls.append((is_valid, in_think))
        stray_closers = text.count("</tool_call>") - closed_blocks
        calls.extend([(False, all_thinking)] * stray_closers)
    # "tool_call>" ends both the opening and the closing tag.
    if not any("tool_call>" in text for text, _ in texts):
        for entry in message.get("tool_calls") or []:
            calls.append((_is_valid_structured_call(entry, tool_names), False))
    return calls


def _think_spans(text: str) -> list[tuple[int, int]]:
    """Character ranges of `text` written while thinking."""
    spans = [(block.start(), block.end()) for block in _THINK_BLOCK.finditer(text)]
    first_close = text.find("</think>")
    if first_close != -1 and not any(start < first_close for start, _ in spans):
        spans.append((0, first_close))
    return spans


def _is_valid_structured_call(entry: Any, tool_names: list[str] | None) -> bool:
    """Whether an OpenAI-style `tool_calls` entry ({"function": {...}} or flat) is well formed."""
    if not isinstance(entry, dict):
        return False
    function = entry.get("function", entry)
    if not isinstance(function, dict):
        return False
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = _json_or_none(arguments)
    return _is_valid_call({"name": function.get("name"), "arguments": arguments}, tool_names)


def _is_valid_call(call: Any, tool_names: list[str] | None) -> bool:
    """Whether `call` is {"name": str, "arguments": object} naming a known tool."""
    return (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments"), dict)
        and (tool_names is None or call["name"] in tool_names)
    )


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    # Deeply nested brackets exhaust the recursion limit: as malformed as bad syntax.
    except (json.JSONDecodeError, RecursionError):
        return None


def _text(content: Any) -> str:
    """The text of a message's content: a string, or OpenAI-style parts with "text" keys."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""
