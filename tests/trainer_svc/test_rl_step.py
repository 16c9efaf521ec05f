"""From trajectories to an update: tensors aligned with the engine's tokens, the loss shares
that add up to the full-batch loss across micro-batches, the behaviour correction, staleness,
dynamic sampling, infrastructure failures, metrics."""

import math

import pytest
import torch

from trainer_svc.batch import Batch
from trainer_svc.config import AlgorithmConfig, CriticConfig
from trainer_svc.losses import policy_loss, value_loss
from trainer_svc.rl_step import (
    accurate,
    infra_failed,
    keep_groups_with_signal,
    make_loss_fn,
    make_value_loss_fn,
    prepare_update,
    rollout_batch,
    rollout_metrics,
    staleness_metrics,
    trainable,
)
from turnrl.trajectory import FinishReason, Segment, Trajectory, TurnReward, TurnRewardSource
from turnrl.trajectory import SegmentSource as Source
from turnrl.v1 import common_pb2


def trajectory(group: str, reward: float, segments, acc: bool | None = None) -> Trajectory:
    """A trajectory of (source, token ids, logprobs[, policy_version]) segments, as the rollout
    service sends."""
    result = Trajectory(
        trajectory_id=f"{group}/x",
        group_id=group,
        sample_index=0,
        segments=[Segment(*segment) for segment in segments],
        finish_reason=FinishReason.STOP,
        metrics={"tool_calls": 1.0, "tool_errors": 0.0},
        reward=common_pb2.Reward(score=reward),
    )
    if acc is not None:
        result.reward.extras.update({"acc": acc})
    return result


TWO_TURNS = [
    (Source.PROMPT, [1, 2, 3], []),
    (Source.MODEL, [4, 5], [-0.5, -0.25]),
    (Source.TOOL, [6, 7, 8], []),
    (Source.MODEL, [9], [-1.5]),
]


def test_rollout_batch_keeps_the_engines_tokens_and_logprobs_in_place():
    short = [(Source.PROMPT, [1, 2], []), (Source.MODEL, [3], [-2.0])]
    rollouts = rollout_batch(
        [trajectory("a", 1.0, TWO_TURNS), trajectory("b", 0.0, short), trajectory("a", 0.5, short)],
        pad_token_id=0,
    )
    batch = rollouts.batch
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert batch.input_ids[1].tolist() == [1, 2, 3, 0, 0, 0, 0, 0, 0]
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert batch.extras["rollout_logprobs"][0].tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.5]
    assert batch.extras["rollout_logprobs"][1, 2] == -2.0
    assert rollouts.rewards.tolist() == [1.0, 0.0, 0.5]
    assert rollouts.group_index.tolist() == [0, 1, 0]


def test_a_trajectory_in_parts_is_a_row_per_part_scored_once_in_its_group():
    """An agent that rewrote its history: a row per part (each its own context), every row
    under the trajectory's reward, and GRPO's group statistics over trajectories, not rows:
    the two-part trajectory counts once against its group's other sample."""
    in_parts = [
        (Source.PROMPT, [1, 2], []),
        (Source.MODEL, [3, 4], [-0.5, -0.25]),
        (Source.PROMPT, [1, 5, 6], []),
        (Source.MODEL, [7], [-1.0]),
        (Source.USER, [8], []),
        (Source.MODEL, [9], [-2.0]),
    ]
    short = [(Source.PROMPT, [1, 2], []), (Source.MODEL, [3], [-2.0])]
    two_parts, single = trajectory("a", 1.0, in_parts), trajectory("a", 0.0, short)
    assert two_parts.parts == [(0, 4), (4, 10)] and single.parts == [(0, 3)]
    rollouts = rollout_batch([two_parts, single], pad_token_id=0)
    batch = rollouts.batch
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 0, 0], [1, 5, 6, 7, 8, 9], [1, 2, 3, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [
        [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 1], [0, 0, 1, 0, 0, 0]
    ]  # fmt: skip
    assert batch.extras["rollout_logprobs"][1].tolist() == [0, 0, 0, -1.0, 0, -2.0]
    assert rollouts.rewards.tolist() == [1.0, 1.0, 0.0]
    assert rollouts.group_index.tolist() == [0, 0, 0]
    assert rollouts.sequence_index.tolist() == [0, 0, 1]
    # Dr.GRPO's r - group mean over the two samples: +0.5 and -0.5 (over the three rows it
    # would be +1/3 and -2/3).
    policy = FixedLogprobs(batch.extras["rollout_logprobs"])
    prepare_update(rollouts, policy, None, None, AlgorithmConfig(advantage_estimator="dr_grpo"))
    advantages = batch.extras["advantages"]
    assert advantages[batch.loss_mask].tolist() == [0.5, 0.5, 0.5, 0.5, -0.5]


def test_rollout_batch_with_a_policy_version_holds_each_model_tokens_staleness():
    # A partial rollout: its first turn by version 3, its second by version 5.
    partial = [
        (Source.PROMPT, [1, 2, 3], []),
        (Source.MODEL, [4, 5], [-0.5, -0.25], 3),
        (Source.TOOL, [6, 7, 8], []),
        (Source.MODEL, [9], [-1.5], 5),
    ]
    fresh = [(Source.PROMPT, [1, 2], []), (Source.MODEL, [3], [-2.0], 5)]
    trajectories = [trajectory("a", 1.0, partial), trajectory("b", 0.0, fresh)]
    staleness = rollout_batch(trajectories, 0, policy_version=5).batch.extras["policy_staleness"]
    assert staleness.tolist() == [[0, 0, 0, 2, 2, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert "policy_staleness" not in rollout_batch(trajectories, 0).batch.extras
    with pytest.raises(ValueError, match="'a/x' has model tokens of policy_version 5, newer"):
        rollout_batch(trajectories, 0, policy_version=4)


def test_staleness_metrics_count_each_trajectory_by_its_oldest_model_token():
    def by_versions(*versions: int) -> Trajectory:
        segments = [(Source.PROMPT, [1], [])]
        segments += [(Source.MODEL, [2], [-1.0], version) for version in versions]
        return trajectory("g", 0.0, segments)

    trajectories = [by_versions(7, 8), by_versions(8), by_versions(8), by_versions(5, 8)]
    trajectories.append(trajectory("g", 0.0, [(Source.PROMPT, [1], [])]))  # no model tokens
    # Staleness 1, 0, 0, 3 at version 8.
    assert staleness_metrics(trajectories, policy_version=8) == {
        "staleness/mean": 1.0,
        "staleness/max": 3.0,
        "staleness/0": 0.5,
        "staleness/1": 0.25,
        "staleness/3": 0.25,
    }
    assert staleness_metrics([], policy_version=8) == {"staleness/mean": 0.0, "staleness/max": 0.0}


class FixedLogprobs:
    """A stand-in policy whose logprobs, before the update, are given."""

    def __init__(self, logprobs: torch.Tensor):
        self._logprobs = logprobs

    def logprobs(self, batch: Batch):
        return self._logprobs, None


def test_prepare_update_measures_weights_and_mismatch_per_staleness():
    stale = [
        (Source.PROMPT, [1], []),
        (Source.MODEL, [2], [-1.5], 1),
        (Source.TOOL, [3], []),
        (Source.MODEL, [4], [-0.5], 3),
    ]
    fresh = [(Source.PROMPT, [1], []), (Source.MODEL, [2, 3], [-1.0, -1.25], 3)]
    rollouts = rollout_batch(
        [trajectory("g", 1.0, stale), trajectory("g", 0.0, fresh)], 0, policy_version=3
    )
    # Trainer - engine on model tokens: 0.5 (staleness 2); -0.5, 0, 0.25 (staleness 0).
    old_logprobs = torch.tensor([[0.0, -1.0, 9.0, -1.0], [0.0, -1.0, -1.0, 0.0]])
    metrics = prepare_update(
        rollouts, FixedLogprobs(old_logprobs), None, None, AlgorithmConfig(importance_cap=1.5)
    )
    weights = [math.exp(0.5), math.exp(-0.5), 1.0, math.exp(0.25)]
    assert metrics["is/weight_mean"] == pytest.approx(sum(weights) / 4)
    assert metrics["is/weight_max"] == pytest.approx(math.exp(0.5))
    assert metrics["is/capped_fraction"] == 0.25
    assert metrics["mismatch/mean_abs_diff"] == pytest.approx(1.25 / 4)
    assert metrics["mismatch/staleness_2/mean_abs_diff"] == pytest.approx(0.5)
    assert metrics["mismatch/staleness_0/mean_abs_diff"] == pytest.approx(0.75 / 3)
    # k3 of rollout - trainer = d: e^-d + d - 1.
    k3 = [math.exp(-d) + d - 1 for d in (0.5, 0.0, -0.25)]
    assert metrics["mismatch/staleness_0/kl_k3"] == pytest.approx(sum(k3) / 3)
    assert not any("staleness_1" in name or "staleness_3" in name for name in metrics)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    short = [(Source.PROMPT, [1], []), (Source.MODEL, [2], [-1.0])]
    batch = [
        trajectory("same", 1.0, short),
        trajectory("mixed", 1.0, short),
        trajectory("same", 1.0, short),
        trajectory("mixed", 0.0, short),
    ]
    assert [t.group_id for t in keep_groups_with_signal(batch)] == ["mixed", "mixed"]
    assert keep_groups_with_signal([]) == []


def test_dynamic_sampling_with_turn_rewards_keeps_groups_whose_turns_earned_differently():
    """Both samples got the same outcome, but only one earned its first turn a tool reward:
    no signal for the outcome, signal for the turn-level estimators."""
    rewarded, plain = trajectory("g", 1.0, TWO_TURNS), trajectory("g", 1.0, TWO_TURNS)
    rewarded.turn_rewards = [TurnReward(0, 0.5, TurnRewardSource.TOOL, "calculator")]
    assert keep_groups_with_signal([rewarded, plain]) == []
    kept = keep_groups_with_signal([rewarded, plain], enable_turn_rewards=True)
    assert kept == [rewarded, plain]
    # The same reward moved to the other turn is a different signal, the same one is none.
    moved = trajectory("g", 1.0, TWO_TURNS)
    moved.turn_rewards = [TurnReward(1, 0.5, TurnRewardSource.TOOL, "calculator")]
    assert keep_groups_with_signal([rewarded, moved], enable_turn_rewards=True) != []
    assert keep_groups_with_signal([rewarded, rewarded], enable_turn_rewards=True) == []


def test_trainable_needs_model_tokens_and_a_normal_end():
    prompt_only = trajectory("g", 0.0, [(Source.PROMPT, [1, 2], [])])
    assert not trainable(prompt_only)
    aborted = trajectory("g", 0.0, TWO_TURNS)
    aborted.finish_reason = FinishReason.ABORTED
    assert not trainable(aborted) and trainable(trajectory("g", 0.0, TWO_TURNS))


def infra_failures() -> list[Trajectory]:
    """A failed scorer, and a tool call the tool service could not run."""
    reward_failed = trajectory("g", 0.0, TWO_TURNS)
    reward_failed.reward.error = True
    tool_down = trajectory("g", 0.0, TWO_TURNS)
    tool_down.metrics["tool_infra_errors"] = 1.0
    return [reward_failed, tool_down]


def test_infrastructure_failures_are_not_trainable():
    model_tool_error = trajectory("g", 0.0, TWO_TURNS)  # the model's own bad call
    model_tool_error.metrics.update({"tool_errors": 1.0, "tool_infra_errors": 0.0})
    assert not infra_failed(model_tool_error) and trainable(model_tool_error)
    for failed in infra_failures():
        assert infra_failed(failed) and not trainable(failed)


E = math.exp


@pytest.mark.parametrize(
    ("mode", "weights"),
    [
        ("none", [1.0, 1.0, 1.0, 1.0]),
        ("truncate", [1.5, E(-0.5), 1.0, E(0.25)]),
        ("mask", [0.0, E(-0.5), 1.0, E(0.25)]),
        ("reject", [0.0, 0.0, 1.0, E(0.25)]),  # row 0 has a weight over the cap
    ],
)
def test_loss_weights_each_token_per_the_importance_sampling_mode(mode, weights):
    # Weights trainer/engine: e^0.5, e^-0.5 (row 0); 1, e^0.25 (row 1); the cap is 1.5.
    batch = Batch.from_sequences(
        [[1, 2, 3], [1, 2, 3]],
        [[False, True, True], [False, True, True]],
        {
            "old_logprobs": [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]],
            "rollout_logprobs": [[0.0, -1.5, -0.5], [0.0, -1.0, -1.25]],
            "advantages": [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
        },
    )
    batch.global_token_count, batch.global_sequence_count = 4, 2
    algorithm = AlgorithmConfig(importance_sampling=mode, importance_cap=1.5)
    # Ratio 1 and advantage 1: each token's loss is -weight; token-mean over all 4 tokens.
    loss, _ = make_loss_fn(algorithm, normalizer=3)(batch, batch.extras["old_logprobs"], None)
    assert float(loss) == pytest.approx(-sum(weights) / 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_and_value_loss_shares_of_micro_batches_add_up_to_the_full_batch_loss(mode):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 7]
    token_ids = [list(range(1, n + 1)) for n in lengths]
    loss_masks = [[i > 0 and i % 3 != 1 for i in range(n)] for n in lengths]
    extras = {
        name: [torch.randn(n, generator=generator).tolist() for n in lengths]
        for name in ("old_logprobs", "advantages", "rollout_logprobs", "old_values", "returns")
    }
    batch = Batch.from_sequences(token_ids, loss_masks, extras)
    noise = 0.1 * torch.randn((2, *batch.input_ids.shape), generator=generator)
    logprobs = batch.extras["old_logprobs"] + noise[0]
    values = batch.extras["old_values"] + noise[1]
    algorithm = AlgorithmConfig(loss_aggregation=mode, clip_low=0.05, clip_high=0.05)
    loss_fn = make_loss_fn(algorithm, normalizer=12)
    value_loss_fn = make_value_loss_fn(algorithm, CriticConfig(value_clip_range=0.05), 12)
    batch.global_token_count = int(batch.loss_mask.sum())
    batch.global_sequence_count = len(lengths)
    expected, _ = policy_loss(
        logprobs,
        batch.extras["old_logprobs"],
        batch.extras["advantages"],
        batch.loss_mask,
        clip_low=0.05,
        clip_high=0.05,
        aggregation=mode,
        normalizer=12,
    )
    expected_value_loss, _ = value_loss(
        values,
        batch.extras["old_values"],
        batch.extras["returns"],
        batch.loss_mask,
        clip_range=0.05,
        aggregation=mode,
        normalizer=12,
    )
    total = value_total = 0.0
    value_clip_fractions = []
    for rows in ([0, 2], [1], [3]):
        micro = batch.select(rows, torch.device("cpu"))
        length = micro.input_ids.shape[1]
        loss, metrics = loss_fn(micro, logprobs[rows, :length], None)
        total += float(loss)
        assert "clip_fraction" in metrics
        loss, metrics = value_loss_fn(micro, values[rows, :length])
        value_total += float(loss)
        value_clip_fractions.append(metrics["clip_fraction"])
    assert total == pytest.approx(float(expected), abs=1e-6)
    assert value_total == pytest.approx(float(expected_value_loss), abs=1e-6)
    assert max(value_clip_fractions) > 0  # the clipped branch is part of what adds up


def test_rollout_metrics_and_accuracy():
    right = trajectory("a", 1.0, TWO_TURNS, acc=True)
    wrong_but_rewarded = trajectory("a", 0.1, TWO_TURNS, acc=False)  # a format bonus, say
    no_acc = trajectory("b", 0.0, TWO_TURNS)
    assert accurate(right) and not accurate(wrong_but_rewarded) and not accurate(no_acc)
    metrics = rollout_metrics([right, wrong_but_rewarded, no_acc])
    assert metrics["accuracy"] == pytest.approx(1 / 3)
    assert metrics["reward_mean"] == pytest.approx(1.1 / 3)
    assert metrics["response_length"] == 6.0  # model, tool and model tokens after the prompt
    assert metrics["tool_calls"] == 1.0
