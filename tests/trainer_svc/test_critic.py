"""FsdpCritic on a tiny random Qwen3: values aligned with the policy's logprobs, a head that
starts at zero, the value loss falling on a fixed multi-turn batch through the trainer's own
pieces (rollout_batch, prepare_update, make_value_loss_fn), and a checkpoint round trip."""

import pytest
import torch
from torch import nn
from transformers import Qwen3ForTokenClassification

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, write_checkpoint
from trainer_svc.config import AlgorithmConfig, CriticConfig
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, restore
from trainer_svc.rl_step import make_value_loss_fn, prepare_update, rollout_batch
from turnrl.trajectory import (
    FinishReason,
    Segment,
    SegmentSource,
    Trajectory,
    TurnReward,
    TurnRewardSource,
)
from turnrl.v1 import common_pb2

GAE = AlgorithmConfig(advantage_estimator="gae", gamma=1.0, gae_lambda=1.0)


def test_values_are_the_head_on_the_prefix_before_each_token(model_dir, tmp_path):
    # A critic folder with a trained (here: random) head, which the critic must keep.
    torch.manual_seed(1)
    saved = Qwen3ForTokenClassification.from_pretrained(model_dir, num_labels=1).eval()
    saved.save_pretrained(tmp_path / "critic")
    batch = fixed_batch()
    lengths = batch.attention_mask.sum(1).tolist()
    expected = torch.zeros(batch.input_ids.shape)
    with torch.no_grad():
        for row, length in enumerate(lengths):
            head = saved(batch.input_ids[row : row + 1, :length]).logits[0, :, 0]
            expected[row, 1:length] = head[:-1]  # token t's state is the prefix up to t - 1

    for micro_batch_tokens in (4096, 1):
        critic = FsdpCritic(
            tmp_path / "critic",
            SETTINGS.model_copy(update={"micro_batch_tokens": micro_batch_tokens}),
        )
        torch.testing.assert_close(critic.values(batch), expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 1e-2


def test_a_head_the_folder_lacks_starts_at_zero_and_nothing_drops_out(model_dir):
    critic = FsdpCritic(model_dir, SETTINGS)
    assert not critic.values(fixed_batch()).any()
    dropouts = [m.p for m in critic.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and not any(dropouts)


def multi_turn_trajectory(index: int, reward: float) -> Trajectory:
    """prompt, model turn, tool reply, model turn: random tokens of its own per trajectory."""
    generator = torch.Generator().manual_seed(index)
    segments = []
    for source, length in [
        (SegmentSource.PROMPT, 4),
        (SegmentSource.MODEL, 3),
        (SegmentSource.TOOL, 2),
        (SegmentSource.MODEL, 2),
    ]:
        ids = torch.randint(1, 256, (length,), generator=generator).tolist()
        logprobs = [-1.0] * length if source is SegmentSource.MODEL else []
        segments.append(Segment(source, ids, logprobs))
    return Trajectory(
        trajectory_id=f"t{index}",
        group_id=f"g{index // 2}",
        sample_index=0,
        segments=segments,
        finish_reason=FinishReason.STOP,
        reward=common_pb2.Reward(score=reward),
    )


def test_the_critic_learns_the_returns_of_a_fixed_multi_turn_batch(model_dir):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    rollouts = rollout_batch(
        [multi_turn_trajectory(i, reward) for i, reward in enumerate(rewards)], pad_token_id=0
    )
    policy = FsdpPolicy(model_dir, SETTINGS)
    critic = FsdpCritic(model_dir, SETTINGS.model_copy(update={"learning_rate": 3e-3}))
    loss_fn = make_value_loss_fn(GAE, CriticConfig(value_clip_range=0.5), normalizer=16)
    losses, fits = [], []
    for _ in range(15):
        fits.append(prepare_update(rollouts, policy, None, critic, GAE))
        losses.append(critic.train_step(rollouts.batch, loss_fn)["loss"])

    mask = rollouts.batch.loss_mask
    returns = rollouts.batch.extras["returns"]
    # gamma = lambda = 1: every model token's return is its row's reward, tool tokens get 0.
    torch.testing.assert_close(returns, torch.tensor(rewards)[:, None] * mask)
    # The zero head's first values give the plain loss 0.5 * mean(reward^2) over model tokens.
    assert losses[0] == pytest.approx(0.5 * sum(rewards) / len(rewards))
    assert fits[0]["critic/value_mean"] == 0.0 and fits[0]["critic/explained_variance"] == 0.0
    assert fits[0]["critic/return_mean"] == pytest.approx(0.5)
    assert losses[-1] < 0.1 * losses[0], losses
    assert fits[-1]["critic/explained_variance"] > 0.8, fits[-1]


def test_the_critic_learns_turn_returns_under_turn_gae(model_dir):
    # Turn 0 (positions 4-6) of every other trajectory earned 0.5; the outcome is on turn 1
    # (positions 9-10).
    trajectories = [multi_turn_trajectory(i, float(i % 3 == 0)) for i in range(6)]
    for trajectory in trajectories[::2]:
        trajectory.turn_rewards = [TurnReward(0, 0.5, TurnRewardSource.TOOL, "calculator")]
    rollouts = rollout_batch(trajectories, pad_token_id=0)
    algorithm = AlgorithmConfig(advantage_estimator="turn_gae", enable_turn_rewards=True)
    policy = FsdpPolicy(model_dir, SETTINGS)
    critic = FsdpCritic(model_dir, SETTINGS.model_copy(update={"learning_rate": 3e-3}))
    loss_fn = make_value_loss_fn(algorithm, CriticConfig(value_clip_range=0.5), normalizer=16)
    losses = []
    for _ in range(4):
        prepare_update(rollouts, policy, None, critic, algorithm)
        losses.append(critic.train_step(rollouts.batch, loss_fn)["loss"])

    # turn_gamma = lambda = 1: turn 0's tokens return the turn reward plus the outcome, turn
    # 1's the outcome; the tool tokens between them and the prompt get nothing.
    returns = rollouts.batch.extras["returns"]
    for row, trajectory in enumerate(trajectories):
        outcome, earned = trajectory.reward.score, 0.5 * (row % 2 == 0)
        expected = [0.0] * 4 + [outcome + earned] * 3 + [0.0] * 2 + [outcome] * 2
        assert returns[row].tolist() == pytest.approx(expected, abs=1e-5)
    assert losses[-1] < losses[0], losses


def test_checkpoint_round_trip_restores_the_critic(model_dir, tmp_path):
    settings = SETTINGS.model_copy(
        update={"warmup_steps": 1, "lr_schedule": "cosine", "total_steps": 4}
    )
    batch = fixed_batch()
    batch.extras["old_values"] = torch.zeros(batch.input_ids.shape)
    batch.extras["returns"] = batch.extras["advantages"]
    loss_fn = make_value_loss_fn(GAE, CriticConfig(), normalizer=16)
    trained = FsdpCritic(model_dir, settings)
    trained.train_step(batch, loss_fn)
    policy = FsdpPolicy(model_dir, settings)
    checkpoint = write_checkpoint(Models(policy, critic=trained), tmp_path, 1)
    expected_metrics = trained.train_step(batch, loss_fn)

    resumed = FsdpCritic(model_dir, settings)
    restore(Models(FsdpPolicy(model_dir, settings), critic=resumed), checkpoint)
    assert resumed.train_step(batch, loss_fn) == pytest.approx(expected_metrics, abs=0)
    assert expected_metrics.keys() == {"loss", "grad_norm", "lr", "clip_fraction"}
    torch.testing.assert_close(resumed.values(batch), trained.values(batch), atol=0, rtol=0)
    assert trained.values(batch).abs().max() > 1e-3  # the head moved off zero
