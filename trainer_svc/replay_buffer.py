"""The async loop's replay buffer: prompt groups whose trajectories have all come back, waiting
for a training step, oldest first.

A group (the `samples_per_prompt` trajectories of one prompt) enters when its Generate call
ends (with a co-trained judge, once the judges' call on it ends too: its rewards are theirs). Its usable trajectories are kept (`trainable`: model tokens, not aborted, not hit by an
infrastructure failure); a group with none left is rolled out again, and with dynamic sampling
a group whose rewards are all equal is dropped (DAPO). A step takes the oldest groups; before
that, groups that have grown too stale for the policy being trained leave the buffer to be
rolled out again.
"""

import enum
from collections import Counter, deque
from dataclasses import dataclass, field

from trainer_svc.data import PromptRecord
from trainer_svc.judge_training import ran_ok
from trainer_svc.ledger import prompt_key
from trainer_svc.rl_step import keep_groups_with_signal, trainable
from turnrl.trajectory import FinishReason, Trajectory


@dataclass
class Group:
    """One prompt's samples: the draw it came from and the trajectories that came back."""

    position: int  # in the EpochSampler: identifies the draw, for the ledger and checkpoints
    record: PromptRecord
    trajectories: list[Trajectory] = field(default_factory=list)
    # With trainer.judge_training: the verdicts on `trajectories`, every one that came back.
    judges: list[Trajectory] = field(default_factory=list)

    @property
    def key(self) -> str:
        return prompt_key(self.position, self.record.prompt_id)

    def oldest_version(self) -> int:
        """The oldest policy version among the group's model tokens."""
        return min(version for t in self.trajectories for version in t.policy_versions)

    def why_unusable(self) -> str:
        """What kept the group's trajectories out of the loss, each cause with its count, e.g.
        "4 x scoring failed: reward service: ..." (the checks of rl_step.trainable)."""
        causes = Counter(map(_why_untrainable, self.trajectories))
        causes.update(f"judge: {_why_untrainable(j)}" for j in self.judges if not ran_ok(j))
        return "; ".join(f"{n} x {cause}" for cause, n in causes.most_common()) or "no trajectory"


class Admission(enum.Enum):
    """What became of a group offered to the buffer."""

    READY = "ready"  # waits for a step
    FILTERED = "filtered"  # dynamic sampling: its rewards are all equal
    UNUSABLE = "unusable"  # no trajectory left to train on: roll it out again


class ReplayBuffer:
    """Complete groups in the order they completed; holds only their usable trajectories."""

    def __init__(self, dynamic_sampling: bool, enable_turn_rewards: bool = False) -> None:
        self._dynamic_sampling = dynamic_sampling
        self._enable_turn_rewards = enable_turn_rewards
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def positions(self) -> list[int]:
        return [group.position for group in self._groups]

    def add(self, group: Group) -> Admission:
        usable = [t for t in group.trajectories if trainable(t)]
        if not usable:
            return Admission.UNUSABLE
        if self._dynamic_sampling and not keep_groups_with_signal(
            usable, enable_turn_rewards=self._enable_turn_rewards
        ):
            return Admission.FILTERED
        group.trajectories = usable
        self._groups.append(group)
        return Admission.READY

    def remove_stale(self, policy_version: int, max_staleness: int) -> list[Group]:
        """Removes and returns the groups with a model token more than `max_staleness` versions
        older than `policy_version`."""
        fresh: deque[Group] = deque()
        stale: list[Group] = []
        for group in self._groups:
            too_old = policy_version - group.oldest_version() > max_staleness
            (stale if too_old else fresh).append(group)
        self._groups = fresh
        return stale

    def take(self, count: int) -> list[Group]:
        """The `count` oldest groups (the caller checks there are that many)."""
        assert len(self._groups) >= count, "take only a full batch"
        return [self._groups.popleft() for _ in range(count)]


def _why_untrainable(trajectory: Trajectory) -> str:
    """Why `trajectory`, which `trainable` refuses, is left out of the loss."""
    if trajectory.finish_reason in (FinishReason.ABORTED, FinishReason.ERROR):
        return f"{trajectory.finish_reason.name.lower()}: {trajectory.error_message}"
    if trajectory.reward is not None and trajectory.reward.error:
        return f"scoring failed: {trajectory.reward.error_message}"
    if trajectory.metrics.get("tool_infra_errors", 0) > 0:
        return "a tool call the tool service could not run"
    return "no model tokens"  # the check left
