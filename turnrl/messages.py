"""Chat messages between the wire (`turnrl.v1.Message`) and the OpenAI-style dicts that chat
templates, scorers and judges read."""

import json
from typing import Any

from turnrl.images import data_url
from turnrl.v1 import common_pb2

ROLE_NAMES = {
    common_pb2.Message.ROLE_SYSTEM: "system",
    common_pb2.Message.ROLE_USER: "user",
    common_pb2.Message.ROLE_ASSISTANT: "assistant",
    common_pb2.Message.ROLE_TOOL: "tool",
}
ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}


def openai_tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """One entry of an OpenAI assistant message's `tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def message_to_dict(message: common_pb2.Message) -> dict[str, Any]:
    """An OpenAI chat message: role, content (text, or a list of parts when there are images),
    tool_calls, tool_call_id, name and reasoning_content when set. Raises ValueError for an
    UNSPECIFIED role."""
    if message.role not in ROLE_NAMES:
        raise ValueError(f"message role {message.role!r} is not set; use ROLE_SYSTEM..ROLE_TOOL")
    result: dict[str, Any] = {"role": ROLE_NAMES[message.role]}
    if any(part.HasField("image") for part in message.content):
        result["content"] = [_part_to_dict(part) for part in message.content]
    else:
        result["content"] = "".join(part.text for part in message.content)
    if message.tool_calls:
        result["tool_calls"] = [
            openai_tool_call(call.id, call.name, call.arguments) for call in message.tool_calls
        ]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if value := getattr(message, key):
            result[key] = value
    return result


def _part_to_dict(part: common_pb2.ContentPart) -> dict[str, Any]:
    if part.HasField("text"):
        return {"type": "text", "text": part.text}
    image = part.image
    url = image.url or data_url(image.data, image.mime_type)
    return {"type": "image_url", "image_url": {"url": url}}


def dict_to_message(message: dict[str, Any]) -> common_pb2.Message:
    """The wire form of an OpenAI chat message (text content, or a list of text and image_url
    parts). Raises ValueError for an unknown role."""
    role = ROLES_BY_NAME.get(message.get("role", ""))
    if role is None:
        raise ValueError(f"unknown role {message.get('role')!r}; known: {sorted(ROLES_BY_NAME)}")
    content = message.get("content") or ""
    parts = [content] if isinstance(content, str) else content
    proto = common_pb2.Message(
        role=role,
        tool_call_id=message.get("tool_call_id", ""),
        name=message.get("name", ""),
        reasoning_content=message.get("reasoning_content", ""),
    )
    for part in parts:
        if isinstance(part, str):
            proto.content.add(text=part)
        elif part.get("type") == "text":
            proto.content.add(text=part["text"])
        else:
            proto.content.add(image=common_pb2.Image(url=part["image_url"]["url"]))
    for call in message.get("tool_calls", []):
        function = call["function"]
        arguments = function["arguments"]
        proto.tool_calls.add(
            id=call.get("id", ""),
            name=function["name"],
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
    return proto
