"""The gateway's replies in OpenAI's wire format: a `chat.completion`, the `chat.completion.chunk`
events of a stream, errors, the model list; and a session's trajectory as JSON."""

import dataclasses
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
    completion_id: str,
    created: int,
    model: str,
    turns: list[ModelTurn],
    logprobs: list[list | None],
) -> dict[str, Any]:
    """A `chat.completion` with a choice per turn (`logprobs`: each one's, or None)."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "message": {**_message(turn), "refusal": None},
                "logprobs": None if entries is None else {"content": entries, "refusal": None},
                "finish_reason": turn.finish_reason,
            }
            for index, (turn, entries) in enumerate(zip(turns, logprobs, strict=True))
        ],
        "usage": usage(turns),
    }


def usage(turns: list[ModelTurn]) -> dict[str, int]:
    """The prompt's tokens once, and every choice's sampled tokens."""
    prompt_tokens = turns[0].prompt_tokens
    completion_tokens = sum(len(turn.output_ids) for turn in turns)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_logprobs(tokenizer: Any, turn: ModelTurn) -> list[dict[str, Any]]:
    """`logprobs.content`: each sampled token, its text, bytes and logprob. The stop token or
    the tokens of the stop string a turn ended on are left out, as they are of the content."""
    kept = len(turn.output_ids) - turn.stop_token_count
    ids, logprobs = turn.output_ids[:kept], turn.logprobs[:kept]
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
    index: int = 0,
    finish_reason: str | None = None,
    logprobs: list | None = None,
    with_usage: bool = False,
    turn_usage: dict[str, int] | None = None,
) -> str:
    """One server-sent event holding a `chat.completion.chunk`: choice `index`'s delta, or
    (`delta` None) the usage chunk that has no choices. `with_usage`: the stream was asked for usage, so
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
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }
        ],
    }
    if with_usage:
        body["usage"] = turn_usage
    return event(body)


def turn_deltas(turn: ModelTurn, streamed: str = "") -> Iterator[dict[str, Any]]:
    """The deltas that follow the role's and the content `streamed` while the turn was
    sampled (where its content begins), as OpenAI streams them: the rest of the content,
    then each tool call's id and name, then its arguments."""
    message = _message(turn)
    content = message["content"] or ""
    assert content.startswith(streamed), (streamed, content)
    if rest := content[len(streamed) :]:
        yield {"content": rest}
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
    the policy version of each model segment, the segments, the [start, end) token positions
    of each part (history.py), the messages (each image a data URL) and the images' records
    (where each one's tokens are, its bytes' SHA-256 and its processed grid)."""
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
        "parts": trajectory.parts,
        "messages": trajectory.messages,
        "images": [dataclasses.asdict(image) for image in trajectory.images],
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
