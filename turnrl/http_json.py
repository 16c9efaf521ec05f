"""Calling another system's JSON-over-HTTP API (a retriever, Sandbox Fusion, an LLM judge):
one POST within a deadline, retries for what a retry can fix, and failures phrased for the
caller's own error messages."""

import asyncio
from typing import TypeVar

import httpx
import tenacity
from pydantic import BaseModel, ValidationError

ReplyT = TypeVar("ReplyT", bound=BaseModel)
RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0
MAX_ERROR_BODY_CHARS = 200


class ChatCompletionMessage(BaseModel):
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    message: ChatCompletionMessage


class ChatCompletion(BaseModel):
    """The part of an OpenAI-compatible `/chat/completions` answer its callers read."""

    choices: list[ChatCompletionChoice]


class HttpJsonError(Exception):
    """The call failed. The message completes a sentence about the server, e.g. "did not
    answer within 10 s", so callers prefix it with what the server is: "retriever at '...'"."""


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    reply_model: type[ReplyT],
    *,
    timeout_seconds: float,
    max_retries: int = 0,
) -> ReplyT:
    """POSTs `body` to `url` and parses a 200 answer as `reply_model`.

    Connection failures, HTTP 429 and 5xx are retried up to `max_retries` times with
    jittered back-off; all attempts together stay within `timeout_seconds`. Raises
    HttpJsonError when the server is unreachable, too slow, answers another status, or sends
    a body that does not fit `reply_model`.
    """
    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(httpx.ConnectError)
        | tenacity.retry_if_result(lambda r: r.status_code == 429 or r.status_code >= 500),
        stop=tenacity.stop_after_attempt(max_retries + 1),
        wait=tenacity.wait_exponential_jitter(
            multiplier=RETRY_BASE_SECONDS, max=RETRY_MAX_SECONDS, jitter=RETRY_BASE_SECONDS
        ),
        # After the last attempt: its response, or its exception, as it came.
        retry_error_callback=lambda state: state.outcome.result(),
    )
    try:
        async with asyncio.timeout(timeout_seconds):
            response = await retrying(client.post, url, json=body)
    except (TimeoutError, httpx.TimeoutException):
        raise HttpJsonError(f"did not answer within {timeout_seconds} s") from None
    except httpx.TransportError as e:
        raise HttpJsonError(f"is unreachable ({type(e).__name__}: {e})") from None
    if response.status_code != 200:
        raise HttpJsonError(
            f"answered HTTP {response.status_code}: {response.text[:MAX_ERROR_BODY_CHARS]!r}"
        )
    try:
        return reply_model.model_validate_json(response.content)
    except ValidationError as e:
        raise HttpJsonError(
            f"sent a malformed answer ({e.errors()[0]['msg']}): "
            f"{response.text[:MAX_ERROR_BODY_CHARS]!r}"
        ) from None
