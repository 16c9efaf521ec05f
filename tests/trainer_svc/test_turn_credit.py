"""Credit lands on the tokens of the turn that earned it: trajectories of model turns and tool
replies with per-turn rewards, through the trainer's own rollout_batch and prepare_update."""

import pytest
import torch

from tests.trainer_svc.test_rl_step import FixedLogprobs, trajectory
from trainer_svc.config import AlgorithmConfig
from trainer_svc.rl_step import prepare_update, rollout_batch, rollout_metrics
from turnrl.trajectory import SegmentSource as Source
from turnrl.trajectory import Trajectory, TurnReward, TurnRewardSource

# Prompt, then three model turns with a tool reply after each of the first two:
# positions 2-3 turn 0, 4 tool, 5-6 turn 1, 7-8 tool, 9 turn 2.
THREE_TURNS = [
    (Source.PROMPT, [1, 2], []),
    (Source.MODEL, [3, 4], [-0.5, -0.5]),
    (Source.TOOL, [5], []),
    (Source.MODEL, [6, 7], [-0.5, -0.5]),
    (Source.TOOL, [8, 9], []),
    (Source.MODEL, [10], [-0.5]),
]
TURN_TOKENS = {0: [2, 3], 1: [5, 6], 2: [9]}
TOOL_TOKENS = [4, 7, 8]


def rewarded(group: str, outcome: float, turn_rewards: dict[int, float]) -> Trajectory:
    result = trajectory(group, outcome, THREE_TURNS)
    result.turn_rewards = [
        TurnReward(turn, value, TurnRewardSource.TOOL, "calculator")
        for turn, value in turn_rewards.items()
    ]
    return result


def advantages_of(trajectories: list[Trajectory], **algorithm) -> torch.Tensor:
    rollouts = rollout_batch(trajectories, pad_token_id=0)
    policy = FixedLogprobs(rollouts.batch.extras["rollout_logprobs"])
    prepare_update(rollouts, policy, None, None, AlgorithmConfig(**algorithm))
    return rollouts.batch.extras["advantages"]


def test_rollout_batch_numbers_turns_across_parts_and_sums_turn_rewards():
    in_parts = [
        (Source.PROMPT, [1], []),
        (Source.MODEL, [2, 3], [-1.0, -1.0]),
        (Source.PROMPT, [1, 4], []),  # the agent rewrote its history: a second part
        (Source.MODEL, [5], [-1.0]),
        (Source.USER, [6], []),
        (Source.MODEL, [7], [-1.0]),
    ]
    one_part = rewarded("a", 0.0, {1: 0.5})
    one_part.turn_rewards.append(TurnReward(1, 0.25, TurnRewardSource.SCORER, "judge"))
    rollouts = rollout_batch([one_part, trajectory("a", 1.0, in_parts)], pad_token_id=0)
    assert rollouts.turn_index.tolist() == [
        [-1, -1, 0, 0, -1, 1, 1, -1, -1, 2],
        [-1, 0, 0, -1, -1, -1, -1, -1, -1, -1],
        [-1, -1, 1, -1, 2, -1, -1, -1, -1, -1],
    ]  # fmt: skip
    assert rollouts.turn_rewards.tolist() == [[0, 0.75, 0], [0, 0, 0], [0, 0, 0]]


def test_turn_reinforce_with_turn_gamma_zero_credits_only_the_rewarded_turn():
    # Turn 1 of the first trajectory earned 1; no outcome, no other turn reward.
    advantages = advantages_of(
        [rewarded("g", 0.0, {1: 1.0}), rewarded("g", 0.0, {})],
        advantage_estimator="turn_reinforce_plus_plus",
        turn_gamma=0.0,
        enable_turn_rewards=True,
    )
    credited = advantages[0, TURN_TOKENS[1]]
    uncredited = torch.cat(
        [advantages[0, TURN_TOKENS[0] + TURN_TOKENS[2]]]
        + [advantages[1, TURN_TOKENS[k]] for k in range(3)]
    )
    # Whitening shifts every model token alike: the rewarded turn's tokens stand above all the
    # others, which are all equal (no credit of their own).
    assert (credited > 0).all() and torch.equal(credited, credited[0].expand(2))
    assert torch.equal(uncredited, uncredited[0].expand_as(uncredited))
    assert (uncredited < 0).all()
    assert not advantages[:, TOOL_TOKENS].any() and not advantages[:, :2].any()


def test_turn_grpo_signs_each_turn_against_the_same_turn_of_the_group():
    # A earned on turn 1, B on turn 2; turn 0 is alike in both.
    advantages = advantages_of(
        [rewarded("g", 0.0, {1: 1.0}), rewarded("g", 0.0, {2: 1.0})],
        advantage_estimator="turn_grpo",
        turn_gamma=0.0,
        enable_turn_rewards=True,
    )
    assert not advantages[:, TURN_TOKENS[0]].any()
    assert (advantages[0, TURN_TOKENS[1]] > 0).all() and (advantages[1, TURN_TOKENS[1]] < 0).all()
    assert (advantages[0, TURN_TOKENS[2]] < 0).all() and (advantages[1, TURN_TOKENS[2]] > 0).all()
    assert not advantages[:, TOOL_TOKENS].any()


class ZeroValues:
    """A stand-in critic whose values, before the update, are all 0."""

    def values(self, batch):
        return torch.zeros(batch.input_ids.shape)


def test_turn_gae_returns_each_turns_reward_on_its_tokens_for_the_critic():
    rollouts = rollout_batch([rewarded("g", 0.0, {1: 1.0}), rewarded("g", 0.0, {})], pad_token_id=0)
    policy = FixedLogprobs(rollouts.batch.extras["rollout_logprobs"])
    algorithm = AlgorithmConfig(
        advantage_estimator="turn_gae", turn_gamma=0.0, enable_turn_rewards=True
    )
    metrics = prepare_update(rollouts, policy, None, ZeroValues(), algorithm)
    # With V = 0, lambda 1 and turn_gamma 0 a turn's return is its own reward.
    returns = rollouts.batch.extras["returns"]
    expected = torch.zeros_like(returns)
    expected[0, TURN_TOKENS[1]] = 1.0
    assert torch.equal(returns, expected)
    advantages = rollouts.batch.extras["advantages"]
    assert (advantages[0, TURN_TOKENS[1]] > advantages[0, TURN_TOKENS[0]]).all()
    assert metrics["critic/return_mean"] == pytest.approx(2 / 10)  # over the 10 model tokens


def test_turn_rewards_are_ignored_unless_enabled_and_then_add_to_the_outcome():
    group = [rewarded("g", 1.0, {0: -0.5, 2: -1.0}), rewarded("g", 0.0, {})]
    off = advantages_of(group, advantage_estimator="dr_grpo")
    # Dr.GRPO on outcomes 1 and 0: +0.5 and -0.5 on every model token.
    assert off[0, 2].item() == 0.5 and off[1, 2].item() == -0.5
    on = advantages_of(group, advantage_estimator="dr_grpo", enable_turn_rewards=True)
    # The first trajectory's reward is now 1 - 0.5 - 1 = -0.5: -0.25 and +0.25, on all its
    # model tokens alike (outcome-only credit).
    mask = rollout_batch(group, pad_token_id=0).batch.loss_mask
    assert on[0][mask[0]].tolist() == [-0.25] * 5 and on[1][mask[1]].tolist() == [0.25] * 5
    metrics = rollout_metrics(group)
    assert metrics["turn_reward_mean"] == pytest.approx(-0.75)


def test_turn_rewards_of_a_trajectory_in_parts_are_refused_naming_it():
    in_parts = [
        (Source.PROMPT, [1], []),
        (Source.MODEL, [2], [-1.0]),
        (Source.PROMPT, [1, 4], []),
        (Source.MODEL, [5], [-1.0]),
    ]
    split = trajectory("g", 1.0, in_parts)
    split.turn_rewards = [TurnReward(0, 1.0, TurnRewardSource.INTERACTION, "user")]
    with pytest.raises(ValueError, match="'g/x' is in 2 parts and has turn rewards"):
        advantages_of([split], enable_turn_rewards=True)
    # Off, its turn rewards are not read: the outcome alone trains.
    assert advantages_of([split, trajectory("g", 0.0, in_parts)]).any()


def test_a_turn_reward_for_a_turn_the_trajectory_lacks_is_refused_naming_it():
    bad = rewarded("g", 0.0, {3: 1.0})  # three model turns: 0, 1, 2
    with pytest.raises(ValueError, match="'g/x': a tool reward from 'calculator' is for turn 3, "):
        rollout_batch([bad], pad_token_id=0)
