"""The HTTP client of the engines that run in a server of their own (SGLang, vLLM): one call of
the server's API within a deadline, tried again where that is safe, its failures mapped onto
turnrl errors, the server's answers parsed, and the wait for the server's health at start.

Failures name the server URL: unreachable or HTTP 5xx/429 -> UnavailableError, too slow ->
DeadlineExceededError, other HTTP errors -> InvalidArgumentError (or the error the caller names
for a refusal of the server's state); an answer of the wrong shape (an incompatible server
version) is a RuntimeError. Only calls the caller marks idempotent (health, model info, abort,
pause, resume, flush) are tried again, `max_retries` times.
"""

import asyncio
import json
import logging
from typing import TypeVar

import httpx
import tenacity
from pydantic import BaseModel, ValidationError

from turnrl.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    TurnrlError,
    UnavailableError,
)
from turnrl.http_json import MAX_ERROR_BODY_CHARS

log = logging.getLogger(__name__)

RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0

ReplyT = TypeVar("ReplyT", bound=BaseModel)


class EngineHttp:
    """Calls to the server at `url` over a pool of `max_connections` connections; `server`
    names its kind in errors ("SGLang", "vLLM"), `health_path` is the call that says it can
    generate."""

    def __init__(
        self,
        server: str,
        url: str,
        max_connections: int,
        control_timeout_seconds: float,
        max_retries: int,
        health_path: str,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = f"{server} server at {self.url!r}"
        self._health_path = health_path
        self._control_timeout_seconds = control_timeout_seconds
        self._max_retries = max_retries
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        # Deadlines come from asyncio.timeout per call; no proxy from the environment.
        self._client = httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)

    async def call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_seconds: float | None = None,
        idempotent: bool = False,
        rejected_error: type[TurnrlError] = InvalidArgumentError,
        answered_statuses: tuple[int, ...] = (),
    ) -> httpx.Response:
        """Sends one request within `timeout_seconds` (default: the control timeout) and
        returns its 200 answer, or one of `answered_statuses` for the caller to read; the
        errors are those of the module docstring, a refusal (HTTP 4xx but 429) as
        `rejected_error`.

        Not `turnrl.http_json.post_json`: several engine endpoints are GETs, take query
        parameters or answer with an empty or plain-text body.
        """
        timeout_seconds = timeout_seconds or self._control_timeout_seconds
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(httpx.TransportError)
            | tenacity.retry_if_result(_is_retryable),
            stop=tenacity.stop_after_attempt(self._max_retries + 1 if idempotent else 1),
            wait=tenacity.wait_exponential_jitter(
                multiplier=RETRY_BASE_SECONDS, max=RETRY_MAX_SECONDS, jitter=RETRY_BASE_SECONDS
            ),
            # After the last attempt: its response, or its exception, as it came.
            retry_error_callback=lambda state: state.outcome.result(),
        )
        server = self.name
        try:
            async with asyncio.timeout(timeout_seconds):
                response = await retrying(self._client.request, method, self.url + path, json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise DeadlineExceededError(
                f"{server} did not answer {method} {path} within {timeout_seconds:g} s"
            ) from None
        except httpx.TransportError as e:
            raise UnavailableError(
                f"{server} is unreachable for {method} {path} ({type(e).__name__}: {e})"
            ) from None
        if response.status_code in answered_statuses:
            return response
        if _is_retryable(response):
            raise UnavailableError(
                f"{server} failed {method} {path}: HTTP {response.status_code} "
                f"{error_detail(response)!r}"
            )
        if response.status_code != 200:
            raise rejected_error(
                f"{server} rejected {method} {path}: HTTP {response.status_code} "
                f"{error_detail(response)!r}"
            )
        return response

    def parse(self, response: httpx.Response, model: type[ReplyT]) -> ReplyT:
        """The server's answer as `model`; RuntimeError (an incompatible server: a bug to
        report, not a caller's mistake) when it does not fit."""
        try:
            return model.model_validate_json(response.content)
        except ValidationError as e:
            raise RuntimeError(
                f"{self.name} sent a malformed answer to {response.request.method} "
                f"{response.request.url.path} ({e.errors()[0]['msg']} at "
                f"{e.errors()[0]['loc']}): {response.text[:MAX_ERROR_BODY_CHARS]!r}"
            ) from None

    async def wait_until_healthy(
        self, timeout_seconds: float, process: asyncio.subprocess.Process | None
    ) -> None:
        """Polls GET `health_path` until it answers 200. Raises UnavailableError once `process` (a server this engine launched) exits,
        DeadlineExceededError after `timeout_seconds`."""

        async def healthy() -> bool:
            if process is not None and process.returncode is not None:
                raise UnavailableError(
                    f"{self.name}: process {process.pid} exited with code "
                    f"{process.returncode} before it became healthy; its log is above"
                )
            try:
                response = await self._client.get(
                    self.url + self._health_path, timeout=self._control_timeout_seconds
                )
            except httpx.TransportError:
                return False
            return response.status_code == 200

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_result(lambda is_healthy: not is_healthy),
            wait=tenacity.wait_exponential_jitter(
                multiplier=RETRY_BASE_SECONDS, max=RETRY_MAX_SECONDS, jitter=RETRY_BASE_SECONDS
            ),
        )
        log.info("waiting up to %g s for the %s to be healthy", timeout_seconds, self.name)
        try:
            async with asyncio.timeout(timeout_seconds):
                await retrying(healthy)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{self.name} was not healthy within {timeout_seconds:g} s"
            ) from None

    async def close(self) -> None:
        await self._client.aclose()


def _is_retryable(response: httpx.Response) -> bool:
    return response.status_code == 429 or response.status_code >= 500


def error_detail(response: httpx.Response) -> str:
    """The server's error message ({"error": {"message"}}, {"message"}, {"detail"} or text),
    clipped."""
    try:
        body = response.json()
    except json.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = (
            error.get("message")
            if isinstance(error, dict)
            else body.get("message", body.get("detail"))
        )
        if isinstance(message, str):
            return message[:MAX_ERROR_BODY_CHARS]
    return response.text[:MAX_ERROR_BODY_CHARS]
