"""The SGLang engine's HTTP client: one call of the server's native API within a deadline,
tried again where that is safe, its failures mapped onto turnrl errors, and the wait for the
server's health at start.

Failures name the server URL: unreachable or HTTP 5xx/429 -> UnavailableError, too slow ->
DeadlineExceededError, other HTTP errors -> InvalidArgumentError (or the error the caller names
for a refusal of the server's state); an answer of the wrong shape (an incompatible server
version) is a RuntimeError. Only calls the caller marks idempotent (health, model info, abort,
pause, resume, flush) are tried again, `max_retries` times.
"""

import asyncio
import logging

import httpx
import tenacity

from rollout_svc.engines.sglang_api import WeightSyncReply, error_detail, parse_reply
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TurnrlError,
    UnavailableError,
)

log = logging.getLogger(__name__)

RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0


class SglangHttp:
    """Calls to the SGLang server at `url` over a pool of `max_connections` connections."""

    def __init__(
        self, url: str, max_connections: int, control_timeout_seconds: float, max_retries: int
    ) -> None:
        self.url = url.rstrip("/")
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
    ) -> httpx.Response:
        """Sends one request within `timeout_seconds` (default: the control timeout) and
        returns its 200 answer; the errors are those of the module docstring, a refusal (HTTP
        4xx but 429) as `rejected_error`.

        Not `turnrl.http_json.post_json`: several SGLang endpoints are GETs or answer with an
        empty or plain-text body.
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
        server = f"SGLang server at {self.url!r}"
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

    async def weight_sync_call(self, path: str, body: dict, timeout_seconds: float) -> None:
        """POSTs to one of the weight endpoints, which answer {success, message}; raises
        FailedPreconditionError, with the server's message, when it failed."""
        response = await self.call(
            "POST", path, body, timeout_seconds=timeout_seconds,
            rejected_error=FailedPreconditionError,
        )  # fmt: skip
        reply = parse_reply(response, WeightSyncReply, self.url)
        if not reply.success:
            raise FailedPreconditionError(
                f"SGLang server at {self.url!r} failed POST {path}: {reply.message!r}"
            )

    async def wait_until_healthy(
        self, timeout_seconds: float, process: asyncio.subprocess.Process | None
    ) -> None:
        """Polls GET /health_generate (which runs a one-token generation) until it answers
        200. Raises UnavailableError once `process` (a server this engine launched) exits,
        DeadlineExceededError after `timeout_seconds`."""

        async def healthy() -> bool:
            if process is not None and process.returncode is not None:
                raise UnavailableError(
                    f"SGLang server process {process.pid} exited with code "
                    f"{process.returncode} before {self.url!r} became healthy; its log is above"
                )
            try:
                response = await self._client.get(
                    f"{self.url}/health_generate", timeout=self._control_timeout_seconds
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
        log.info(
            "waiting up to %g s for the SGLang server at %s to be healthy",
            timeout_seconds,
            self.url,
        )
        try:
            async with asyncio.timeout(timeout_seconds):
                await retrying(healthy)
        except TimeoutError:
            raise DeadlineExceededError(
                f"SGLang server at {self.url!r} was not healthy within {timeout_seconds:g} s"
            ) from None

    async def close(self) -> None:
        await self._client.aclose()


def _is_retryable(response: httpx.Response) -> bool:
    return response.status_code == 429 or response.status_code >= 500
