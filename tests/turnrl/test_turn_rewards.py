"""Per-turn rewards on the trajectory record: which tokens a turn is, and the wire."""

import pytest

from turnrl.errors import InvalidArgumentError
from turnrl.trajectory import (
    FinishReason,
    Segment,
    SegmentSource,
    Trajectory,
    TurnReward,
    TurnRewardSource,
)


def two_turns() -> Trajectory:
    """Prompt, a first turn split by a weight push, a tool reply, a second turn."""
    return Trajectory(
        trajectory_id="g/0",
        group_id="g",
        sample_index=0,
        segments=[
            Segment(SegmentSource.PROMPT, [1, 2, 3]),
            Segment(SegmentSource.MODEL, [4, 5], [-0.5, -0.25], policy_version=1),
            Segment(SegmentSource.MODEL, [6], [-0.125], policy_version=2),
            Segment(SegmentSource.TOOL, [7, 8]),
            Segment(SegmentSource.TEMPLATE, [9]),
            Segment(SegmentSource.MODEL, [10, 11], [-1.0, -2.0], policy_version=2),
        ],
        finish_reason=FinishReason.STOP,
    )


def test_a_turn_a_weight_push_split_is_one_span() -> None:
    assert two_turns().model_turn_spans() == [(3, 6), (9, 11)]


def test_turn_rewards_cross_the_wire_with_their_sources() -> None:
    trajectory = two_turns()
    trajectory.turn_rewards = [
        TurnReward(0, 0.5, TurnRewardSource.TOOL, "calculator"),
        TurnReward(1, -0.25, TurnRewardSource.INTERACTION, "gsm8k"),
        TurnReward(1, 1.0, TurnRewardSource.SCORER, "calc_chain"),
    ]
    assert Trajectory.from_proto(trajectory.to_proto()).turn_rewards == trajectory.turn_rewards


@pytest.mark.parametrize("turn", [2, -1])
def test_a_reward_for_a_turn_that_does_not_exist_is_refused(turn: int) -> None:
    trajectory = two_turns()
    trajectory.turn_rewards = [TurnReward(turn, 1.0, TurnRewardSource.TOOL, "calculator")]
    with pytest.raises(InvalidArgumentError, match=f"turn {turn}, but .* has 2 model turns"):
        Trajectory.from_proto(trajectory.to_proto())


def test_a_turn_reward_without_a_source_is_refused() -> None:
    proto = two_turns().to_proto()
    proto.turn_rewards.add(turn=0, value=1.0)
    with pytest.raises(InvalidArgumentError, match="TurnRewardSource"):
        Trajectory.from_proto(proto)
