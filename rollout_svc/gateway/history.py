"""The prefix rule: how a session's later requests send its history back, and the part rule: what
happens when they do not.

A session's first request renders its messages as the prompt (`ConversationTokens.prompt_ids`,
with the request's tools). A later request continues the session's current part when it sends
that part's whole history back, as it is, then new messages of role `tool` or `user` only:

- the messages the part recorded come first, in order: its prompt's, each assistant message
  the model generated, each message appended since. An assistant message matches when its
  content and its tool calls (name and parsed JSON arguments; call ids are not compared) are
  the model's; any other message when its role, content, name and tool_call_id are the same;
- the new messages are appended with the delta rule (`ConversationTokens.append_messages`), so
  the model's own ids are never re-tokenized;
- `tools` and `stop` are the first request's (sessions.py checks them).

A request that does not (`HistoryRewrittenError`: an agent that summarised, truncated or
edited its history, or appended messages of its own such as an assistant or system message)
starts a new part of the session: its messages are rendered as a new prompt, as a first
request's, and the session goes on from there. The parts before it stay recorded as they were:
the session's trajectory holds each part in turn, every part from a PROMPT segment
(`Trajectory.parts`), and the trainer trains each part as a sequence of its own under the
episode's reward. So the model is trained on exactly the context it sampled in, never on a
history it did not see. With `gateway.history_rewrites: refuse` such a request is refused
instead (400, naming the first message that differs) and nothing recorded changes.

Two requests are neither: one that sends the current part's history with nothing new is
refused (400); one that repeats the previous request's messages exactly is a retry (the agent
never received the answer: a timeout, a dropped connection, the SDK's own retries) and
replaces that answer (sessions.py).
"""

import json
from typing import Any

from rollout_svc.gateway.requests import RequestFieldError

NEW_MESSAGE_ROLES = ("tool", "user")


class HistoryRewrittenError(RequestFieldError):
    """A request's messages do not continue the session's current part: a new part starts."""


def new_messages(
    history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages after the current part's `history` (the prefix rule). Raises
    HistoryRewrittenError naming the first message that breaks it, RequestFieldError when
    nothing follows the history."""
    for index, recorded in enumerate(history):
        if index >= len(messages):
            raise HistoryRewrittenError(
                f"messages has {len(messages)} entries, the session's history {len(history)}: "
                "send the whole history back, then the new tool or user messages",
                "messages",
            )
        if not _same_message(recorded, messages[index]):
            raise HistoryRewrittenError(
                f"messages[{index}] differs from the session's history: expected "
                f"{_summary(recorded)}, got {_summary(messages[index])}; this gateway refuses a "
                "rewritten history (gateway.history_rewrites: refuse)",
                f"messages.{index}",
            )
    new_messages = messages[len(history) :]
    if not new_messages:
        raise RequestFieldError(
            "no new messages after the session's history; append tool results or a user turn",
            "messages",
        )
    for index, message in enumerate(new_messages, start=len(history)):
        if message["role"] not in NEW_MESSAGE_ROLES:
            raise HistoryRewrittenError(
                f"messages[{index}] has role {message['role']!r}; after the session's history "
                f"only {list(NEW_MESSAGE_ROLES)} messages may follow",
                f"messages.{index}.role",
            )
    return new_messages


def _same_message(recorded: dict[str, Any], sent: dict[str, Any]) -> bool:
    if recorded["role"] != sent["role"] or recorded["content"] != sent["content"]:
        return False
    if recorded["role"] == "assistant":
        return _calls(recorded) == _calls(sent)
    keys = ("name", "tool_call_id")
    return all(recorded.get(key) == sent.get(key) for key in keys)


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (name, arguments) of each tool call: the arguments parsed, or as text where they are
    not JSON (a call the prompt held), so they compare as written."""
    calls = []
    for call in message.get("tool_calls") or []:
        text = call["function"]["arguments"]
        try:
            arguments = ("json", json.loads(text))
        except ValueError:
            arguments = ("text", text)
        calls.append((call["function"]["name"], arguments))
    return calls


def _summary(message: dict[str, Any]) -> str:
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    text = f"a {message['role']!r} message with content {message['content']!r:.120}"
    return text + (f" and tool calls {calls!r:.200}" if calls else "")
