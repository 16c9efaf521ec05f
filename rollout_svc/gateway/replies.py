"""The gateway's replies in OpenAI's wire format: a `chat.completion`, the `chat.completion.chunk`
events of a stream, errors, the model list; and a session's trajectory as JSON."""

import json
from collections.abc import Iterator
from typing import Any

from rollout_svc.gateway.session_state import ModelTurn
from turnrl.trajectory import Trajectory

# OpenAI's error `type` by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    error_type = ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def model_list(model_name: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "turnrl"}],
    }


def completion(
    completion_id: str, created: int, model: str, turn: ModelTurn, logprobs: list | None
) -> dict[str, Any]:
    """A `chat.completion` with one choice."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {**_message(turn), "refusal": None},
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": turn.finish_reason,
            }
        ],
        "usage": usage(turn),
    }


def usage(turn: ModelTurn) -> dict[str, int]:
    completion_tokens = len(turn.output_ids)
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": turn.prompt_tokens + completion_tokens,
    }


def token_logprobs(tokenizer: Any, turn: ModelTurn) -> list[dict[str, Any]]:
    """`logprobs.content`: each sampled token, its text, bytes and logprob. The stop token a
    turn ended on is left out, as it is of the content."""
    ids, logprobs = turn.output_ids, turn.logprobs
    if turn.finish_reason != "length":
        ids, logprobs = ids[:-1], logprobs[:-1]
    entries = []
    for token_id, logprob in zip(ids, logprobs, strict=True):
        text = tokenizer.decode([token_id])
        entries.append(
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        )
    return entries


def chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    *,
    finish_reason: str | None = None,
    logprobs: list | None = None,
    with_usage: bool = False,
    turn_usage: dict[str, int] | None = None,
) -> str:
    """One server-sent event holding a `chat.completion.chunk`: a choice's delta, or (`delta`
    None) the usage chunk that has no choices. `with_usage`: the stream was asked for usage, so
    every chunk carries the field, null but in the last."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }
        ],
    }
    if with_usage:
        body["usage"] = turn_usage
    return event(body)


def turn_deltas(turn: ModelTurn) -> Iterator[dict[str, Any]]:
    """The deltas that follow the role's, as OpenAI streams them: the content, then each tool
    call's id and name, then its arguments."""
    message = _message(turn)
    if message["content"]:
        yield {"content": message["content"]}
    for index, call in enumerate(message.get("tool_calls", [])):
        function = call["function"]
        opening = {"name": function["name"], "arguments": ""}
        yield {
            "tool_calls": [
                {"index": index, "id": call["id"], "type": "function", "function": opening}
            ]
        }
        yield {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]}


def event(body: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <JSON>` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def trajectory_json(trajectory: Trajectory) -> dict[str, Any]:
    """A session's trajectory: ids, masks, the engine's logprob per token (0 outside the loss),
    the policy version of each model segment, the segments and the messages."""
    return {
        "trajectory_id": trajectory.trajectory_id,
        "finish_reason": trajectory.finish_reason.name.lower()
        if trajectory.finish_reason
        else None,
        "token_ids": trajectory.token_ids,
        "loss_mask": trajectory.loss_mask,
        "response_mask": trajectory.response_mask,
        "logprobs": trajectory.rollout_logprobs,
        "policy_versions": trajectory.policy_versions,
        "segments": [
            {
                "source": segment.source.name.lower(),
                "token_ids": segment.token_ids,
                "logprobs": segment.logprobs,
                "policy_version": segment.policy_version,
            }
            for segment in trajectory.segments
        ],
        "messages": trajectory.messages,
        "metrics": trajectory.metrics,
    }


def _message(turn: ModelTurn) -> dict[str, Any]:
    """The assistant message as OpenAI returns it: content null beside tool calls when empty."""
    message = turn.message
    result: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        result["content"] = message["content"] or None
        result["tool_calls"] = message["tool_calls"]
    return result
