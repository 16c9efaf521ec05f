"""The async controller loop (`trainer.loop: async`): generation never waits for training, and
training never waits for the long tail of a batch.

    generate  prompt groups (one Generate call of samples_per_prompt each) are started as the
              staleness budget allows; each streams back into the `ReplayBuffer` when its last
              trajectory is in, usable trajectories only, filtered as it completes
    step      take the oldest prompts_per_step groups as soon as there are that many fresh
              ones -> train (as the sync loop) -> push: the rollout service pauses, loads the
              new weights between two decode steps and goes on, so in-flight trajectories
              continue, each token keeping the policy version that sampled it

The staleness bound η (`async_loop.max_staleness`) holds twice. A group is started only while
the groups in flight, buffered and taken by the unpushed step number at most (η + 1) x
prompts_per_step (AReaL's rule: the k-th batch's rollouts start no earlier than policy
version k - η; η = 0 is on-policy, the sync loop's order of events). And a buffered group with
a model token more than η versions older than the policy being trained is not trained on: its
prompt is rolled out again with the current policy (re-generated rather than dropped, so that
no prompt of the epoch goes untrained). A group with no usable trajectory (every one hit by an
infrastructure failure, or aborted) is rolled out again too.

A checkpoint holds, beside the sync loop's state, the positions of every prompt drawn and not
yet settled (in flight, buffered, waiting to be rolled out again); a resumed run rolls those
out first, so no prompt is skipped or trained twice (trainer_svc/ledger.py writes what each
step settled).
"""

import asyncio
import collections
import time
import uuid
from typing import Any

from trainer_svc.controller import Controller
from trainer_svc.replay_buffer import Admission, Group, ReplayBuffer
from trainer_svc.rl_step import RolloutBatch, infra_failed
from trainer_svc.weight_push import CONTROL_TIMEOUT_SECONDS, PushResult
from turnrl.trajectory import Trajectory

# What each step reports of the groups and trajectories since the step before.
COUNTED = (
    "filtered_groups",  # dynamic sampling: rewards all equal
    "regenerated_unusable_groups",  # no usable trajectory: rolled out again
    "regenerated_stale_groups",  # older than max_staleness: rolled out again
)


class AsyncController(Controller):
    """Runs one RL run with the async loop, to its end or until `request_stop`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer = ReplayBuffer(self.config.algorithm.dynamic_sampling)
        # Set on every change the producer or the trainer may be waiting for: a group back,
        # a batch taken, a push.
        self._changed = asyncio.Condition()
        self._producer: asyncio.Task | None = None  # starts the groups; from the first step on
        self._in_flight: dict[int, asyncio.Task] = {}  # by sampler position
        self._again: collections.deque[int] = collections.deque()  # to roll out again first
        self._taken_unpushed = 0  # groups of the step being trained, until its push
        self._pushed_steps = 0
        self._failure: Exception | None = None
        self._counts: collections.Counter[str] = collections.Counter()  # since the last step
        self._generated_tokens = 0
        self._infra_failures = 0  # trajectories a tool or reward call could not run for
        self._last_take = time.monotonic()
        # Generate request ids of this process: a resumed run's never collide with calls of
        # the killed one that the rollout service may still be ending.
        self._calls = uuid.uuid4().hex[:8]

    def _resume_from(self, state: dict[str, Any]) -> None:
        super()._resume_from(state)
        self._again.extend(state.get("pending_positions", []))

    def _loop_state(self) -> dict[str, Any]:
        pending = set(self._in_flight) | set(self.buffer.positions()) | set(self._again)
        return {**super()._loop_state(), "pending_positions": sorted(pending)}

    async def _train_to_end(self) -> None:
        try:
            await super()._train_to_end()
        finally:
            tasks = [*self._in_flight.values(), *([self._producer] if self._producer else [])]
            # Cancelling a group's task cancels its Generate call; the rollout service then
            # ends its trajectories. Their positions stay in `_in_flight` for the checkpoint.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _train(self, rollouts: RolloutBatch, metrics: dict[str, float]) -> None:
        if not self.config.async_loop.generate_while_training:
            # Tool calls and scoring go on; the engine waits for the push, which resumes it.
            await self.router.pause(timeout_seconds=CONTROL_TIMEOUT_SECONDS)
        await super()._train(rollouts, metrics)

    async def _push(self) -> PushResult:
        pushed = await super()._push()
        self._pushed_steps = self.step
        self._taken_unpushed = 0
        async with self._changed:
            self._changed.notify_all()
        return pushed

    async def _keep_generating(self) -> None:
        """Starts prompt groups whenever the staleness budget and `max_groups_in_flight` allow."""
        async with self._changed:
            while True:
                await self._changed.wait_for(self._may_start_group)
                position = (
                    self._again.popleft() if self._again else self.sampler.next_positions(1)[0]
                )
                group = Group(position, self.sampler.record_at(position))
                self._in_flight[position] = asyncio.create_task(self._roll_out(group))

    def _may_start_group(self) -> bool:
        settings = self.config.async_loop
        per_step = self.config.rollout.prompts_per_step
        remaining = (self.total_steps - self._pushed_steps) * per_step
        budget = min((settings.max_staleness + 1) * per_step, remaining)
        budget += settings.oversample_groups
        outstanding = len(self._in_flight) + len(self.buffer) + self._taken_unpushed
        limit = settings.max_groups_in_flight or budget
        return self._failure is None and outstanding < budget and len(self._in_flight) < limit

    async def _roll_out(self, group: Group) -> None:
        """One group's Generate call, into the buffer; a failed call stops the run."""
        request = self._generate_request(
            [group.record], [group.key], f"{self._calls}/g{group.key}", training=True
        )
        try:
            group.trajectories = await self.router.generate(
                request, timeout_seconds=self.config.rollout.timeout_seconds
            )
        except Exception as e:  # the rollout service failed; the next step reports it
            self._failure = self._failure or e
        else:
            del self._in_flight[group.position]
            self._admit(group)
        async with self._changed:
            self._changed.notify_all()

    def _admit(self, group: Group) -> None:
        self._infra_failures += sum(map(infra_failed, group.trajectories))
        self._generated_tokens += sum(t.metrics["model_tokens"] for t in group.trajectories)
        admission = self.buffer.add(group)
        if admission is Admission.UNUSABLE:
            self._again.append(group.position)
            self._counts["regenerated_unusable_groups"] += 1
        elif admission is Admission.FILTERED:
            # Settled now, in the step under way: a checkpoint taken after this no longer
            # counts the group as pending, and one taken before it does (and the resumed run,
            # rewinding the ledger to that step, rolls it out again).
            self.ledger.record(self.step, filtered=[group.key])
            self._counts["filtered_groups"] += 1

    async def _rollout(self) -> tuple[list[Trajectory], dict[str, float]]:
        """The oldest prompts_per_step fresh groups of the buffer, once there are that many;
        writes the step's line of the prompt ledger."""
        started = time.monotonic()
        if self._producer is None:  # after the starting policy's evaluation, as in the sync loop
            self._producer = asyncio.create_task(self._keep_generating())
            self._last_take = started
        per_step = self.config.rollout.prompts_per_step
        async with self._changed:
            while True:
                if self._failure is not None:
                    raise RuntimeError(
                        f"step {self.step}: a Generate call failed: {self._failure}"
                    ) from self._failure
                stale = self.buffer.remove_stale(
                    self._policy_version, self.config.async_loop.max_staleness
                )
                if stale:
                    self._again.extend(group.position for group in stale)
                    self._counts["regenerated_stale_groups"] += len(stale)
                    self._changed.notify_all()
                if len(self.buffer) >= per_step:
                    break
                await self._changed.wait()
            groups = self.buffer.take(per_step)
            self._taken_unpushed = per_step
        self.ledger.record(self.step, trained=[g.key for g in groups])
        now = time.monotonic()
        metrics = {
            "time/rollout": now - started,  # waiting for a batch: 0 when one was ready
            "rollout/tokens_per_s": self._generated_tokens / max(now - self._last_take, 1e-9),
            "rollout/infra_failed_trajectories": float(self._infra_failures),
            "async/groups_in_flight": float(len(self._in_flight)),
            "async/buffered_groups": float(len(self.buffer)),
            **{f"async/{name}": float(self._counts[name]) for name in COUNTED},
        }
        self._counts.clear()
        self._generated_tokens, self._infra_failures, self._last_take = 0, 0, now
        return [t for group in groups for t in group.trajectories], metrics
