"""From trajectories to an update: tensors aligned with the engine's tokens, the loss shares
that add up to the full-batch loss across micro-batches, dynamic sampling, metrics."""

import pytest
import torch

from trainer_svc.config import AlgorithmConfig, CriticConfig
from trainer_svc.fsdp import Batch
from trainer_svc.losses import policy_loss, value_loss
from trainer_svc.rl_step import (
    accurate,
    keep_groups_with_signal,
    make_loss_fn,
    make_value_loss_fn,
    rollout_batch,
    rollout_metrics,
    trainable,
)
from turnrl.trajectory import FinishReason, Segment, Trajectory
from turnrl.trajectory import SegmentSource as Source
from turnrl.v1 import common_pb2


def trajectory(group: str, reward: float, segments, acc: bool | None = None) -> Trajectory:
    """A trajectory of (source, token ids, logprobs) segments, as the rollout service sends."""
    result = Trajectory(
        trajectory_id=f"{group}/x",
        group_id=group,
        sample_index=0,
        segments=[Segment(source, ids, logprobs) for source, ids, logprobs in segments],
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


def test_trainable_needs_model_tokens_and_a_normal_end():
    prompt_only = trajectory("g", 0.0, [(Source.PROMPT, [1, 2], [])])
    assert not trainable(prompt_only)
    aborted = trajectory("g", 0.0, TWO_TURNS)
    aborted.finish_reason = FinishReason.ABORTED
    assert not trainable(aborted) and trainable(trajectory("g", 0.0, TWO_TURNS))


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
