"""Turn-level estimators against values worked out by hand: turn returns, GRPO per turn index,
GAE over turns, and the placement of per-turn rewards on their turn's last token."""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from trainer_svc.advantages import compute_advantages, turn_rewards_to_tokens

TURN_ESTIMATORS = ["turn_reinforce_plus_plus", "turn_grpo", "turn_dr_grpo", "turn_gae"]


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def turns(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def whitened(raw: list[float]) -> list[float]:
    mean, std = statistics.mean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    return [(a - mean) / std for a in raw]


def test_turn_rewards_land_on_the_last_token_of_their_turn_in_the_row_that_holds_it() -> None:
    # Row 0: turns 0 and 1 with a tool token between; row 1: turn 1 of a trajectory in parts
    # (its turn 0 is in another row), so turn 0's reward stays off it.
    turn_index = turns([[0, 0, -1, 1, -1], [-1, 1, 1, 1, -1]])
    token_rewards = turn_rewards_to_tokens(tensor([[0.5, -2.0], [3.0, 0.25]]), turn_index)
    assert_close(token_rewards, tensor([[0, 0.5, 0, -2.0, 0], [0, 0, 0, 0.25, 0]]))


def test_turn_reinforce_plus_plus_discounts_over_turns_then_whitens() -> None:
    # Row 0: model, model, tool, model (turns 0, 0, -, 1); row 1: one turn of three tokens.
    turn_index = turns([[0, 0, -1, 1, -1], [0, 0, 0, -1, -1]])
    mask = turn_index >= 0
    # Turn rewards 0.25 (turn 0, with -0.05 KL on its first token) and 1 (turn 1); the 7 on the
    # tool token and the 9 on padding are no turn's and must be ignored.
    token_rewards = tensor([[-0.05, 0.3, 7.0, 1.0, 9.0], [0, 0, -1.0, 0, 0]])
    # turn_gamma 0.5: row 0 G_1 = 1, G_0 = 0.25 + 0.5 * 1 = 0.75; row 1 G_0 = -1.
    w = whitened([0.75, 0.75, 1.0, -1.0, -1.0, -1.0])
    advantages, returns = compute_advantages(
        "turn_reinforce_plus_plus",
        token_rewards=token_rewards,
        group_index=turns([0, 0]),
        loss_mask=mask,
        turn_index=turn_index,
        turn_gamma=0.5,
    )
    assert_close(advantages, tensor([[w[0], w[1], 0, w[2], 0], [w[3], w[4], w[5], 0, 0]]))
    assert returns is None


# Group 0: rows 0-2, group 1: row 3 alone. Rewards on each turn's last token.
GROUPED_TURNS = turns([[0, -1, 1, -1], [0, -1, 1, 1], [0, 0, -1, -1], [0, -1, 1, -1]])
GROUPED_REWARDS = tensor([[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]])


def test_turn_grpo_compares_each_turn_with_the_same_turn_of_its_group() -> None:
    advantages, _ = compute_advantages(
        "turn_grpo",
        token_rewards=GROUPED_REWARDS,
        group_index=turns([0, 0, 0, 5]),
        loss_mask=GROUPED_TURNS >= 0,
        turn_index=GROUPED_TURNS,
        turn_gamma=0.5,
    )
    # Turn 0 of group 0: G = 0 + 0.5 * 1, 0, 1 -> mean 0.5, unbiased std 0.5.
    # Turn 1 of group 0: rows 0 and 1 only (row 2 has no turn 1): G = 1, 0 -> std sqrt(0.5).
    # Row 3 is alone in its group: 0 on every turn.
    t0 = 0.5 / (0.5 + 1e-6)
    t1 = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [[0.0, 0, t1, 0], [-t0, 0, -t1, -t1], [t0, t0, 0, 0], [0, 0, 0, 0]]
    assert_close(advantages, tensor(expected))


def test_turn_dr_grpo_only_subtracts_the_turns_group_mean() -> None:
    advantages, _ = compute_advantages(
        "turn_dr_grpo",
        token_rewards=GROUPED_REWARDS,
        group_index=turns([0, 0, 0, 5]),
        loss_mask=GROUPED_TURNS >= 0,
        turn_index=GROUPED_TURNS,
        turn_gamma=0.5,
    )
    expected = [[0.0, 0, 0.5, 0], [-0.5, 0, -0.5, -0.5], [0.5, 0.5, 0, 0], [0, 0, 0, 0]]
    assert_close(advantages, tensor(expected))


def test_turn_gae_values_each_turn_at_its_first_token_and_returns_turn_targets() -> None:
    # Row 0: prompt, turn 0 (2 tokens), tool, turn 1 (2 tokens); row 1: prompt, one turn of 3.
    turn_index = turns([[-1, 0, 0, -1, 1, 1], [-1, 0, 0, 0, -1, -1]])
    mask = turn_index >= 0
    token_rewards = tensor([[0, -0.05, 0.1, 0, 0, 1.0], [0, 0, 0, -1.0, 0, 0]])
    # Only the values at each turn's first token are read (V_0 = 0.5, V_1 = 0.8; row 1: 0.3).
    values = tensor([[9.0, 0.5, 9.0, 9.0, 0.8, 9.0], [9.0, 0.3, 9.0, 9.0, 9.0, 9.0]])
    gamma, lam = 0.9, 0.8
    a1 = 1.0 + gamma * 0.0 - 0.8  # the last turn: V after it is 0
    a0 = (0.05 + gamma * 0.8 - 0.5) + gamma * lam * a1
    b0 = -1.0 - 0.3
    w = whitened([a0, a0, a1, a1, b0, b0, b0])

    advantages, returns = compute_advantages(
        "turn_gae",
        token_rewards=token_rewards,
        group_index=turns([0, 1]),
        loss_mask=mask,
        turn_index=turn_index,
        values=values,
        lam=lam,
        turn_gamma=gamma,
    )

    assert_close(advantages, tensor([[0, w[0], w[1], 0, w[2], w[3]], [0, w[4], w[5], w[6], 0, 0]]))
    r0, r1, rb = a0 + 0.5, a1 + 0.8, b0 + 0.3
    assert_close(returns, tensor([[0, r0, r0, 0, r1, r1], [0, rb, rb, rb, 0, 0]]))


def test_turn_gae_with_lambda_one_returns_the_discounted_turn_returns() -> None:
    turn_index = turns([[0, -1, 1, 2]])
    token_rewards = tensor([[0.5, 0, 0, 2.0]])
    values = tensor([[0.3, 9.0, -0.7, 0.1]])
    _, returns = compute_advantages(
        "turn_gae",
        token_rewards=token_rewards,
        group_index=turns([0]),
        loss_mask=turn_index >= 0,
        turn_index=turn_index,
        values=values,
        turn_gamma=0.5,
    )
    # G_2 = 2, G_1 = 0 + 0.5 * 2, G_0 = 0.5 + 0.5 * 1: whatever the values.
    assert_close(returns, tensor([[1.0, 0, 1.0, 2.0]]))


@pytest.mark.parametrize("estimator", TURN_ESTIMATORS)
def test_turn_estimators_refuse_a_trajectory_in_parts(estimator: str) -> None:
    turn_index = turns([[0, 0], [1, 1]])
    with pytest.raises(ValueError, match=f"'{estimator}' scores the turns of whole trajectories"):
        compute_advantages(
            estimator,
            token_rewards=tensor([[0, 1.0], [0, 1.0]]),
            group_index=turns([0, 0]),
            sequence_index=turns([0, 0]),
            loss_mask=turn_index >= 0,
            turn_index=turn_index,
            values=torch.zeros(2, 2),
        )


@pytest.mark.parametrize("estimator", TURN_ESTIMATORS)
def test_turn_estimators_need_a_turn_index(estimator: str) -> None:
    with pytest.raises(ValueError, match=f"'{estimator}' needs a turn_index"):
        compute_advantages(
            estimator,
            token_rewards=tensor([[1.0]]),
            group_index=turns([0]),
            loss_mask=torch.ones(1, 1, dtype=torch.bool),
            values=torch.zeros(1, 1),
        )


def test_turn_gae_without_values_is_rejected() -> None:
    with pytest.raises(ValueError, match="'turn_gae' needs values from a critic"):
        compute_advantages(
            "turn_gae",
            token_rewards=tensor([[1.0]]),
            group_index=turns([0]),
            loss_mask=torch.ones(1, 1, dtype=torch.bool),
            turn_index=turns([[0]]),
        )
