"""The async loop's replay buffer and the prompt ledger, on hand-made trajectories."""

import json

from trainer_svc.data import PromptRecord
from trainer_svc.ledger import PromptLedger, prompt_key
from trainer_svc.replay_buffer import Admission, Group, ReplayBuffer
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory
from turnrl.v1 import common_pb2


def trajectory(
    index: int,
    score: float,
    versions: tuple[int, ...] = (1,),
    finish: FinishReason = FinishReason.STOP,
    reward_error: bool = False,
) -> Trajectory:
    """A trajectory whose model turns were sampled by `versions`, one segment each."""
    segments = [Segment(SegmentSource.PROMPT, [1, 2, 3])]
    for version in versions:
        segments.append(Segment(SegmentSource.MODEL, [4, 5], [-0.5, -0.25], version))
        segments.append(Segment(SegmentSource.TOOL, [6]))
    return Trajectory(
        trajectory_id=f"p/{index}",
        group_id="p",
        sample_index=index,
        segments=segments,
        finish_reason=finish,
        metrics={"model_tokens": 2.0 * len(versions), "tool_infra_errors": 0.0},
        reward=common_pb2.Reward(score=score, error=reward_error),
    )


def group(position: int, *trajectories: Trajectory) -> Group:
    record = PromptRecord(prompt_id=f"q{position}", messages=[], data_source="", ground_truth="")
    return Group(position, record, list(trajectories))


def failed_scorings(indices: tuple[int, ...], why: str) -> list[Trajectory]:
    """Trajectories the reward service could not score, for `why`."""
    failed = [trajectory(index, 0.0, reward_error=True) for index in indices]
    for one in failed:
        one.reward.error_message = why
    return failed


def aborted_trajectory(index: int) -> Trajectory:
    aborted = trajectory(index, 1.0, finish=FinishReason.ABORTED)
    aborted.error_message = "the engine went away"
    return aborted


def test_a_group_keeps_its_usable_trajectories_and_waits_in_order():
    buffer = ReplayBuffer(dynamic_sampling=False)
    failed_reward = trajectory(1, 0.0, reward_error=True)
    aborted = trajectory(2, 1.0, finish=FinishReason.ABORTED)
    first = group(5, trajectory(0, 1.0), failed_reward, aborted, trajectory(3, 0.0))
    assert buffer.add(first) is Admission.READY
    assert [t.sample_index for t in first.trajectories] == [0, 3]
    assert buffer.add(group(2, trajectory(0, 1.0))) is Admission.READY
    assert buffer.positions() == [5, 2]
    assert [g.position for g in buffer.take(1)] == [5]
    assert len(buffer) == 1


def test_a_group_with_nothing_usable_is_unusable_and_equal_rewards_are_filtered():
    buffer = ReplayBuffer(dynamic_sampling=True)
    everything_failed = group(0, trajectory(0, 0.0, reward_error=True))
    assert buffer.add(everything_failed) is Admission.UNUSABLE
    assert buffer.add(group(1, trajectory(0, 1.0), trajectory(1, 1.0))) is Admission.FILTERED
    assert buffer.add(group(2, trajectory(0, 1.0), trajectory(1, 0.0))) is Admission.READY
    assert buffer.positions() == [2]
    # Without dynamic sampling equal rewards are kept.
    assert ReplayBuffer(False).add(group(1, trajectory(0, 1.0))) is Admission.READY


def test_stale_groups_leave_by_their_oldest_model_token():
    buffer = ReplayBuffer(dynamic_sampling=False)
    buffer.add(group(0, trajectory(0, 1.0, versions=(3, 5))))  # oldest token: version 3
    buffer.add(group(1, trajectory(0, 1.0, versions=(4,)), trajectory(1, 0.0, versions=(5,))))
    buffer.add(group(2, trajectory(0, 1.0, versions=(5, 6))))
    assert buffer.remove_stale(policy_version=6, max_staleness=3) == []
    stale = buffer.remove_stale(policy_version=6, max_staleness=2)
    assert [g.position for g in stale] == [0]
    assert [g.position for g in buffer.remove_stale(6, 1)] == [1]
    assert buffer.positions() == [2]
    assert buffer.remove_stale(6, 0) != [] and len(buffer) == 0


def test_the_ledger_records_steps_and_rewinds_to_a_checkpoint(tmp_path):
    ledger = PromptLedger(tmp_path)
    ledger.record(1, trained=[prompt_key(0, "a"), prompt_key(1, "b")], filtered=[])
    ledger.record(2, trained=[prompt_key(2, "c")], filtered=[prompt_key(3, "d")])
    ledger.record(3, trained=[prompt_key(4, "e")])
    lines = [json.loads(line) for line in ledger.path.read_text().splitlines()]
    assert lines[0] == {"step": 1, "trained": ["0:a", "1:b"]}  # empty lists left out
    ledger.rewind(2)
    assert ledger.settled() == {"trained": ["0:a", "1:b", "2:c"], "filtered": ["3:d"]}
    PromptLedger(tmp_path / "nothing").rewind(5)  # no ledger yet: nothing to do


def test_an_unusable_group_says_why_each_trajectory_left_the_loss():
    unusable = group(3, aborted_trajectory(2), *failed_scorings((0, 1), "unknown data_source 'x'"))
    assert ReplayBuffer(dynamic_sampling=False).add(unusable) is Admission.UNUSABLE
    assert unusable.why_unusable() == (
        "2 x scoring failed: unknown data_source 'x'; 1 x aborted: the engine went away"
    )


def test_a_group_whose_judges_all_failed_says_so():
    # The async loop's _judge_group: the policy trajectories none of whose judges ran left the
    # group; the judges that failed stay with it, to say why.
    unjudged = group(4, aborted_trajectory(2))
    unjudged.judges = failed_scorings((0, 1), "reward service: unavailable")
    assert ReplayBuffer(dynamic_sampling=False).add(unjudged) is Admission.UNUSABLE
    assert unjudged.why_unusable() == (
        "2 x judge: scoring failed: reward service: unavailable; 1 x aborted: the engine went away"
    )
