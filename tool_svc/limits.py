"""Per-tool limits that hold for every caller: a concurrency cap with a bounded queue, and a
token-bucket rate limit."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from tool_svc.config import ToolLimits
from turnrl.errors import ResourceExhaustedError


class RateLimitedError(Exception):
    """No rate-limit token within the allowed wait; the model sees a RATE_LIMITED error."""


def replica_share(limits: ToolLimits, replicas: int) -> ToolLimits:
    """The limits one of `replicas` replicas of the tool service enforces: an even split of
    the rate limit and its burst (at least 1), so that the configured rate holds for the
    whole service. An even split keeps a shared limiter off the call path; while a replica is
    down its share goes unused (the service runs below the rate, never above it). The concurrency
    cap and the queue stay whole: they protect the replica's own machine."""
    if replicas == 1:
        return limits
    return limits.model_copy(
        update={
            "rate_limit_per_second": limits.rate_limit_per_second / replicas,
            "rate_limit_burst": max(1, limits.rate_limit_burst // replicas),
        }
    )


class TokenBucket:
    """`rate` tokens per second, up to `burst` saved. A caller reserves a token and waits for
    it; reservations may drive the balance below zero, which orders waiters fairly."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = float(burst)
        self._updated = time.monotonic()

    def reserve(self, max_wait_seconds: float) -> float | None:
        """Takes a token, returning how long to wait for it; None (and no token taken) when
        the wait would exceed `max_wait_seconds`."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
        self._updated = now
        wait = max(0.0, (1.0 - self._tokens) / self._rate)
        if wait > max_wait_seconds:
            return None
        self._tokens -= 1.0
        return wait


class ToolLimiter:
    """The limits of one tool: `async with limiter.slot(deadline):` around each call."""

    def __init__(self, tool_name: str, limits: ToolLimits) -> None:
        self._tool_name = tool_name
        self._limits = limits
        unlimited = limits.max_concurrency == 0
        self._semaphore = None if unlimited else asyncio.Semaphore(limits.max_concurrency)
        self._bucket = (
            TokenBucket(limits.rate_limit_per_second, limits.rate_limit_burst)
            if limits.rate_limit_per_second > 0
            else None
        )
        self.waiting = 0
        self.running = 0

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float | None) -> AsyncIterator[None]:
        """Holds a concurrency slot and a rate token for one call.

        `deadline` is a `loop.time()` by which the call must start. Raises
        ResourceExhaustedError when the queue is full or no slot frees up before the
        deadline, RateLimitedError when the rate limit would make the call wait too long.
        """
        if self._semaphore is not None:
            await self._acquire_slot(deadline)
        try:
            if self._bucket is not None:
                await self._wait_for_token(deadline)
            self.running += 1
            try:
                yield
            finally:
                self.running -= 1
        finally:
            if self._semaphore is not None:
                self._semaphore.release()

    async def _acquire_slot(self, deadline: float | None) -> None:
        assert self._semaphore is not None
        if self._semaphore.locked() and self.waiting >= self._limits.max_queue:
            raise ResourceExhaustedError(
                f"tool {self._tool_name!r} is busy: {self.waiting} calls already wait "
                f"(max_queue {self._limits.max_queue}); retry later"
            )
        self.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._semaphore.acquire()
        except TimeoutError:
            raise ResourceExhaustedError(
                f"tool {self._tool_name!r} had no free slot before the deadline "
                f"({self._limits.max_concurrency} calls running, {self.waiting - 1} waiting)"
            ) from None
        finally:
            self.waiting -= 1

    async def _wait_for_token(self, deadline: float | None) -> None:
        assert self._bucket is not None
        max_wait = self._limits.max_rate_wait_seconds
        if deadline is not None:
            max_wait = min(max_wait, deadline - asyncio.get_running_loop().time())
        wait = self._bucket.reserve(max(max_wait, 0.0))
        if wait is None:
            raise RateLimitedError(
                f"tool {self._tool_name!r} is rate limited to "
                f"{self._limits.rate_limit_per_second:g} calls/s; try again later"
            )
        if wait > 0:
            await asyncio.sleep(wait)  # the reserved token becomes available then
