"""The engine wrappers of `rollout_async_vs_batch.py`: one that keeps the time the engine was
busy, and one that turns request-level rollouts into a batch-level one (verl's original
rollout), so that both modes run through the same RolloutService."""

import asyncio
import time
from collections.abc import Callable, Sequence

from rollout_svc.engines.base import Engine, EngineImage, GenerateOutput, SamplingParams


class ClockedEngine:
    """The engine, keeping the time it was busy: at least one generate() in flight."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._in_flight = 0
        self._busy_since = 0.0
        self.busy_seconds = 0.0

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        session_id: str = "",
        *,
        images: Sequence[EngineImage] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerateOutput:
        if not self._in_flight:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        try:
            return await self._engine.generate(
                input_ids, sampling, request_id, session_id, images=images, on_tokens=on_tokens
            )
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self.busy_seconds += time.perf_counter() - self._busy_since

    @property
    def broken_push_version(self) -> int | None:
        return self._engine.broken_push_version

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def end_session(self, session_id: str) -> None:
        await self._engine.end_session(session_id)


class Lockstep:
    """A barrier for a group that shrinks: wait() returns once every member still in the group
    has called it; leave() takes a finished member out."""

    def __init__(self, members: int) -> None:
        self._members = members
        self._arrived = 0
        self._released = asyncio.Event()

    async def wait(self) -> None:
        released = self._released
        self._arrived += 1
        self._release_if_all_arrived()
        await released.wait()

    def leave(self) -> None:
        self._members -= 1
        self._release_if_all_arrived()

    def _release_if_all_arrived(self) -> None:
        if self._arrived and self._arrived == self._members:
            self._released.set()
            self._released, self._arrived = asyncio.Event(), 0


class BatchLevelEngine(ClockedEngine):
    """Turns request-level trajectories into a batch-level rollout: a generate() starts when
    every live trajectory has asked for its turn, and returns when every one has its turn, so
    the batch's tool calls start together and the next turn waits for the slowest of them.
    A trajectory leaves the batch when the agent loop ends its engine session."""

    def __init__(self, engine: Engine, trajectories: int) -> None:
        super().__init__(engine)
        self._lockstep = Lockstep(trajectories)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        session_id: str = "",
        *,
        images: Sequence[EngineImage] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerateOutput:
        await self._lockstep.wait()
        output = await super().generate(
            input_ids, sampling, request_id, session_id, images=images, on_tokens=on_tokens
        )
        await self._lockstep.wait()
        return output

    async def end_session(self, session_id: str) -> None:
        self._lockstep.leave()
        await super().end_session(session_id)
