"""Advantage estimators against values worked out by hand in each test."""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from trainer_svc.advantages import (
    ADVANTAGE_ESTIMATORS,
    apply_kl_penalty,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    sequence_rewards_to_tokens,
)

# Two multi-turn rows: model, model, tool, model, padding / model, model, model, padding x2.
MASK = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_grpo_uses_unbiased_group_std_and_zeroes_singleton_groups() -> None:
    # Group 0 holds rows 0, 2, 3 with rewards 1, 0, 0; group 7 holds row 1 alone.
    rewards = tensor([1.0, 5.0, 0.0, 0.0])
    mean = 1 / 3
    std = math.sqrt(((1 - mean) ** 2 + 2 * (0 - mean) ** 2) / (3 - 1))  # = sqrt(1/3)
    expected = [(1 - mean) / (std + 1e-6), 0.0, -mean / (std + 1e-6), -mean / (std + 1e-6)]
    advantages = grpo_advantages(rewards, torch.tensor([0, 7, 0, 0]))
    assert_close(advantages, tensor(expected))


def test_dr_grpo_only_subtracts_the_group_mean() -> None:
    advantages = grpo_advantages(
        tensor([1.0, 5.0, 0.0, 0.0]), torch.tensor([0, 7, 0, 0]), normalize_by_std=False
    )
    assert_close(advantages, tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))


def test_grpo_group_with_equal_rewards_gives_zero_not_nan() -> None:
    advantages = grpo_advantages(tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    # Group 1: rewards 0, 1 -> mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1).
    std = math.sqrt(0.5)
    assert_close(advantages, tensor([0.0, 0.0, -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]))


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    # Group 3: rewards 1, 0, 0.5 -> 1 - (0 + 0.5) / 2, 0 - (1 + 0.5) / 2, 0.5 - (1 + 0) / 2.
    advantages = rloo_advantages(tensor([1.0, 0.0, 9.0, 0.5]), torch.tensor([3, 3, 4, 3]))
    assert_close(advantages, tensor([0.75, -0.75, 0.0, 0.0]))


def test_sequence_rewards_land_on_the_last_model_token() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    token_rewards = sequence_rewards_to_tokens(tensor([2.0, 3.0, -1.0]), mask)
    expected = [[0, 0, 0, 2.0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, -1.0]]
    assert_close(token_rewards, tensor(expected))


def test_reinforce_plus_plus_discounts_over_model_tokens_then_whitens() -> None:
    # Row 0: reward 1 on its last model token; the 7 on the tool token must be ignored.
    token_rewards = tensor([[0, 0, 7.0, 1.0, 0], [0, 0, -1.0, 0, 0]])
    # gamma 0.5; the tool token is not a step, so position 1 is one step before position 3.
    returns = [0.25, 0.5, 1.0, -0.25, -0.5, -1.0]  # row 0 at 0, 1, 3; row 1 at 0, 1, 2
    mean = sum(returns) / 6  # 0
    variance = sum((g - mean) ** 2 for g in returns) / (6 - 1)  # 2.625 / 5
    scale = 1 / math.sqrt(variance + 1e-8)
    w = [(g - mean) * scale for g in returns]
    expected = tensor([[w[0], w[1], 0, w[2], 0], [w[3], w[4], w[5], 0, 0]])
    assert_close(reinforce_plus_plus_advantages(token_rewards, MASK, gamma=0.5), expected)


def test_gae_skips_tool_tokens_and_whitens_advantages_only() -> None:
    token_rewards = tensor([[0, 0, 0, 1.0, 0], [0, -1.0, 0, 0, 0]])
    # The 9s sit on tool/padding tokens and must never be read.
    values = tensor([[0.5, 0.6, 9.0, 0.8, 9.0], [0.2, 0.4, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    gamma, lam = 0.9, 0.8
    # Row 0, backwards over model positions 3, 1, 0.
    a3 = 1.0 + gamma * 0.0 - 0.8  # 0.2
    a1 = (0.0 + gamma * 0.8 - 0.6) + gamma * lam * a3  # next state of position 1 is position 3
    a0 = (0.0 + gamma * 0.6 - 0.5) + gamma * lam * a1
    # Row 1, positions 1, 0.
    b1 = -1.0 + gamma * 0.0 - 0.4
    b0 = (0.0 + gamma * 0.4 - 0.2) + gamma * lam * b1
    raw = [a0, a1, a3, b0, b1]
    mean, std = statistics.mean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    w = [(a - mean) / std for a in raw]

    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)

    assert_close(advantages, tensor([[w[0], w[1], 0, w[2], 0], [w[3], w[4], 0, 0, 0]]))
    expected_returns = [[a0 + 0.5, a1 + 0.6, 0, a3 + 0.8, 0], [b0 + 0.2, b1 + 0.4, 0, 0, 0]]
    assert_close(returns, tensor(expected_returns))


def test_gae_of_multi_turn_rows_with_the_outcome_reward_and_kl_in_the_reward() -> None:
    # Row 0: model, model, tool, model, padding (reward 1); row 1: three model tokens (reward 0).
    token_rewards = sequence_rewards_to_tokens(tensor([1.0, 0.0]), MASK)
    # k1 = log p - log q per model token; the 5.0 sits on the tool token and must be ignored.
    logprobs = tensor([[0.1, 0.2, 5.0, 0.3, 0.0], [0.2, -0.1, 0.4, 0.0, 0.0]])
    token_rewards = apply_kl_penalty(
        token_rewards, logprobs, torch.zeros(2, 5), MASK, coef=0.5, estimator="k1"
    )
    # Rewards on model tokens: row 0 -0.05, -0.1, 1 - 0.15; row 1 -0.1, 0.05, -0.2.
    values = tensor([[0.5, 0.4, 9.0, 0.6, 9.0], [0.1, 0.0, -0.3, 9.0, 9.0]])
    # gamma 0.5, lambda 1: the returns are the discounted rewards still to come, counting model
    # tokens only (position 1's next step is position 3), whatever the values are.
    row0 = [-0.05 + 0.5 * (-0.1 + 0.5 * 0.85), -0.1 + 0.5 * 0.85, 0.85]  # positions 0, 1, 3
    row1 = [-0.1 + 0.5 * (0.05 + 0.5 * -0.2), 0.05 + 0.5 * -0.2, -0.2]  # positions 0, 1, 2
    raw = [row0[0] - 0.5, row0[1] - 0.4, row0[2] - 0.6, row1[0] - 0.1, row1[1] - 0.0, row1[2] + 0.3]
    mean, std = statistics.mean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    w = [(a - mean) / std for a in raw]

    advantages, returns = compute_advantages(
        "gae",
        token_rewards=token_rewards,
        group_index=torch.tensor([0, 1]),
        loss_mask=MASK,
        values=values,
        gamma=0.5,
        lam=1.0,
    )

    assert_close(returns, tensor([[row0[0], row0[1], 0, row0[2], 0], [*row1, 0, 0]]))
    assert_close(advantages, tensor([[w[0], w[1], 0, w[2], 0], [w[3], w[4], w[5], 0, 0]]))


def test_apply_kl_penalty_subtracts_the_estimate_on_model_tokens_only() -> None:
    token_rewards = tensor([[0.0, 1.0, 0.0]])
    logprobs, ref_logprobs = tensor([[-1.0, -2.0, -0.5]]), tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # k1 = log p - log q = 0.5, -1.0; coef 0.1.
    k1 = apply_kl_penalty(token_rewards, logprobs, ref_logprobs, mask, coef=0.1, estimator="k1")
    assert_close(k1, tensor([[0.0 - 0.1 * 0.5, 1.0 + 0.1 * 1.0, 0.0]]))
    # k3 = exp(q - p) - (q - p) - 1 with q - p = -0.5, 1.0.
    k3 = apply_kl_penalty(token_rewards, logprobs, ref_logprobs, mask, coef=0.1, estimator="k3")
    expected = [[-0.1 * (math.exp(-0.5) + 0.5 - 1), 1.0 - 0.1 * (math.e - 1 - 1), 0.0]]
    assert_close(k3, tensor(expected))


def test_compute_advantages_broadcasts_sequence_advantages_to_model_tokens() -> None:
    token_rewards = sequence_rewards_to_tokens(tensor([1.0, 0.0]), MASK)
    advantages, returns = compute_advantages(
        "rloo", token_rewards=token_rewards, group_index=torch.tensor([0, 0]), loss_mask=MASK
    )
    # RLOO with two samples: 1 - 0 and 0 - 1, on model tokens only.
    assert_close(advantages, tensor([[1.0, 1.0, 0, 1.0, 0], [-1.0, -1.0, -1.0, 0, 0]]))
    assert returns is None


def test_grpo_and_dr_grpo_differ_through_the_dispatcher() -> None:
    token_rewards = sequence_rewards_to_tokens(tensor([1.0, 0.0]), MASK)
    kwargs = {
        "token_rewards": token_rewards,
        "group_index": torch.tensor([0, 0]),
        "loss_mask": MASK,
    }
    grpo, _ = compute_advantages("grpo", **kwargs)
    dr_grpo, _ = compute_advantages("dr_grpo", **kwargs)
    std = math.sqrt((0.5**2 + 0.5**2) / (2 - 1))
    assert_close(grpo[0, 0], torch.tensor(0.5 / (std + 1e-6)))
    assert_close(dr_grpo[0, 0], torch.tensor(0.5))


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_gives_zero_off_the_mask(estimator: str) -> None:
    token_rewards = sequence_rewards_to_tokens(tensor([1.0, 0.0]), MASK)
    advantages, returns = compute_advantages(
        estimator,
        token_rewards=token_rewards,
        group_index=torch.tensor([0, 0]),
        loss_mask=MASK,
        turn_index=torch.tensor([[0, 0, -1, 1, -1], [0, 0, 0, -1, -1]]),
        values=tensor([[0.3, 0.2, 5.0, 0.1, 5.0], [0.4, 0.5, 0.6, 5.0, 5.0]]),
    )
    assert advantages.shape == MASK.shape
    assert not advantages[~MASK].any()
    assert advantages[MASK].abs().sum() > 0
    assert returns is None or not returns[~MASK].any()


def test_unknown_estimator_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'ppo'.*'dr_grpo', 'gae', 'grpo'"):
        compute_advantages(
            "ppo", token_rewards=tensor([[1.0]]), group_index=torch.tensor([0]), loss_mask=MASK
        )


def test_gae_without_values_is_rejected() -> None:
    with pytest.raises(ValueError, match="values"):
        compute_advantages(
            "gae", token_rewards=torch.zeros(2, 5), group_index=torch.tensor([0, 0]), loss_mask=MASK
        )


def test_empty_mask_gives_zeros_not_nan() -> None:
    empty = torch.zeros(2, 3, dtype=torch.bool)
    token_rewards = tensor([[1.0, 0, 0], [0, 2.0, 0]])
    assert not reinforce_plus_plus_advantages(token_rewards, empty).any()
    advantages, returns = gae_advantages(token_rewards, torch.ones(2, 3), empty)
    assert not advantages.any() and not returns.any()
