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
infrastructure failure, or aborted) is rolled out again too, and logged with its causes, within
bounds (`async_loop.max_group_attempts`, `max_unusable_share`) past which the run stops naming
them. Any other failure of the tasks that start and roll out groups stops the run with its
error at once.

With a co-trained judge (`trainer.judge_training`), a group's call is followed by its judges'
call on it, and the group enters the buffer rewarded by their verdicts (dynamic sampling then
filters on those); a step trains the verdicts on the groups it takes beside them.

A checkpoint holds, beside the sync loop's state, the positions of every prompt drawn and not
yet settled (in flight, buffered, filtered since the last step, waiting to be rolled out
again); a resumed run rolls those out first, so no prompt is skipped or trained twice. A step
writes its one line of the prompt ledger (trainer_svc/ledger.py) when it takes its batch: the
groups it trains and those filtered since the step before. So the ledger's lines up to a step
are final before that step's checkpoint, whose pending positions are every drawn group they
do not settle, taken at one moment of the event loop.
"""

import asyncio
import collections
import logging
import time
from typing import Any

from trainer_svc.controller import Controller
from trainer_svc.judge_training import judged_policy, ran_ok
from trainer_svc.replay_buffer import Admission, Group, ReplayBuffer
from trainer_svc.rl_step import RolloutBatch, infra_failed, trainable
from trainer_svc.weight_push import CONTROL_TIMEOUT_SECONDS, PushResult
from turnrl.trajectory import Trajectory

logger = logging.getLogger(__name__)
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
        algorithm = self.config.algorithm
        self.buffer = ReplayBuffer(algorithm.dynamic_sampling, algorithm.enable_turn_rewards)
        # Set on every change the producer or the trainer may be waiting for: a group back,
        # a batch taken, a push.
        self._changed = asyncio.Condition()
        self._producer: asyncio.Task | None = None  # starts the groups; from the first step on
        self._in_flight: dict[int, asyncio.Task] = {}  # by sampler position
        self._again: collections.deque[int] = collections.deque()  # to roll out again first
        # Filtered since the last step: settled in the next step's ledger line.
        self._filtered: list[Group] = []
        self._unusable_attempts: collections.Counter[int] = collections.Counter()  # by position
        self._taken_unpushed = 0  # groups of the step being trained, until its push
        self._pushed_steps = 0
        self._failure: Exception | None = None
        self._counts: collections.Counter[str] = collections.Counter()  # since the last step
        # With trainer.judge_training: the verdicts and trajectories left out, since the last step.
        self._judge_counts: collections.Counter[str] = collections.Counter()
        self._groups_back = 0  # groups whose call ended since the last step, usable or not
        self._generated_tokens = 0
        self._infra_failures = 0  # trajectories a tool or reward call could not run for
        self._last_take = time.monotonic()

    def _resume_from(self, state: dict[str, Any]) -> None:
        super()._resume_from(state)
        self._again.extend(state.get("pending_positions", []))

    def _loop_state(self) -> dict[str, Any]:
        pending = {
            *self._in_flight,
            *self.buffer.positions(),
            *self._again,
            *(group.position for group in self._filtered),
        }
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
        """Starts prompt groups whenever the staleness budget and `max_groups_in_flight` allow;
        a failure stops the run."""
        async with self._changed:
            try:
                while True:
                    await self._changed.wait_for(self._may_start_group)
                    position = (
                        self._again.popleft() if self._again else self.sampler.next_positions(1)[0]
                    )
                    group = Group(position, self.sampler.record_at(position))
                    self._in_flight[position] = asyncio.create_task(self._roll_out(group))
            except Exception as e:
                self._fail(RuntimeError(f"starting a prompt group failed: {e!r}"), e)
                self._changed.notify_all()

    def _fail(self, error: Exception, cause: BaseException | None = None) -> None:
        """Stops the run with `error` (the first one: the next step raises it)."""
        logger.error("async loop: %s", error, exc_info=cause)
        error.__cause__ = cause
        self._failure = self._failure or error

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
        """One group's Generate call, into the buffer; any failure (the rollout service's, or
        a request that cannot be built) stops the run. The group stays in flight then, so a
        checkpoint still counts it pending."""
        try:
            request = self._generate_request(
                [group.record], [group.key], f"g{group.key}", training=True
            )
            group.trajectories = await self.router.generate(
                request, timeout_seconds=self.config.rollout.timeout_seconds
            )
            if self.config.judge_training is not None:
                await self._judge_group(group)
        except Exception as e:
            self._fail(RuntimeError(f"prompt group {group.key}: {type(e).__name__}: {e}"), e)
        else:
            del self._in_flight[group.position]
            self._admit(group)
        async with self._changed:
            self._changed.notify_all()

    async def _judge_group(self, group: Group) -> None:
        """Rewards `group`'s usable trajectories by their judges' verdicts (as the sync loop's
        step does), keeping the judges with the group; the ones none of whose judges ran leave
        it, counted."""
        usable = [t for t in group.trajectories if trainable(t)]
        verdicts = await self._judge(usable, f"g{group.key}.judge", training=True)
        judged = judged_policy(usable, verdicts, self.config.judge_training)
        self._judge_counts.update(judged.counts())
        unusable = [t for t in group.trajectories if not trainable(t)]
        group.trajectories, group.judges = judged.policy + unusable, verdicts

    def _admit(self, group: Group) -> None:
        self._infra_failures += sum(map(infra_failed, group.trajectories))
        self._generated_tokens += sum(
            t.metrics["model_tokens"] for t in group.trajectories + group.judges
        )
        self._groups_back += 1
        admission = self.buffer.add(group)
        if admission is Admission.UNUSABLE:
            self._again.append(group.position)
            self._counts["regenerated_unusable_groups"] += 1
            self._check_unusable(group)
            return
        del self._unusable_attempts[group.position]
        if admission is Admission.FILTERED:
            self._filtered.append(group)
            self._counts["filtered_groups"] += 1

    def _check_unusable(self, group: Group) -> None:
        """Logs why `group` came back unusable; stops the run when it or its step's groups
        passed their bound."""
        settings = self.config.async_loop
        self._unusable_attempts[group.position] += 1
        attempts = self._unusable_attempts[group.position]
        why = group.why_unusable()
        logger.warning(
            "prompt group %s came back unusable (attempt %d of %d): %s",
            group.key,
            attempts,
            settings.max_group_attempts,
            why,
        )
        unusable, back = self._counts["regenerated_unusable_groups"], self._groups_back
        if attempts >= settings.max_group_attempts:
            self._fail(
                RuntimeError(
                    f"prompt group {group.key} came back unusable {attempts} times "
                    f"(async_loop.max_group_attempts={settings.max_group_attempts}); the last "
                    f"time: {why}"
                )
            )
        elif back >= self.config.rollout.prompts_per_step and (
            unusable / back > settings.max_unusable_share
        ):
            self._fail(
                RuntimeError(
                    f"{unusable} of the {back} prompt groups back since step {self.step} were "
                    f"unusable, more than async_loop.max_unusable_share="
                    f"{settings.max_unusable_share}; the last ({group.key}): {why}"
                )
            )

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
                    raise RuntimeError(f"step {self.step}: {self._failure}") from self._failure
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
        filtered, self._filtered = self._filtered, []
        self.ledger.record(
            self.step, trained=[g.key for g in groups], filtered=[g.key for g in filtered]
        )
        now = time.monotonic()
        metrics = {
            "time/rollout": now - started,  # waiting for a batch: 0 when one was ready
            "rollout/tokens_per_s": self._generated_tokens / max(now - self._last_take, 1e-9),
            "rollout/infra_failed_trajectories": float(self._infra_failures),
            "async/groups_in_flight": float(len(self._in_flight)),
            "async/buffered_groups": float(len(self.buffer)),
            **{f"async/{name}": float(self._counts[name]) for name in COUNTED},
        }
        batch = [t for group in groups for t in group.trajectories]
        if self.config.judge_training is not None:
            metrics.update({name: float(n) for name, n in self._judge_counts.items()})
            judges = [j for group in groups for j in group.judges if ran_ok(j)]
            batch += self._judges_to_train(batch, judges, metrics)
        self._counts.clear()
        self._judge_counts.clear()
        self._groups_back = 0
        self._generated_tokens, self._infra_failures, self._last_take = 0, 0, now
        return batch, metrics
