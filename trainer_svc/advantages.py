"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE as functions on tensors.

Conventions: B sequences, T token positions, right-padded; float32 CPU tensors. `loss_mask`
(B, T) bool is True on model-sampled tokens only; tool/user tokens between model turns and
padding are False and get advantage 0. `group_index` (B,) long names the prompt group (the n
samples of one prompt) of each row. Sequence-level estimators return (B,); `compute_advantages`
broadcasts them to every model token of the row. Token-level estimators treat only model
tokens as actions: the step after a model token is the next model token, whatever lies between.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from trainer_svc.losses import kl_estimate

# Added to the variance in whitening, as verl's masked_whiten.
WHITEN_EPSILON = 1e-8


def _groups(group_index: Tensor) -> tuple[Tensor, Tensor]:
    """(dense group id per row (B,), group sizes (G,))."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, torch.bincount(inverse)


def _group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype).index_add_(0, inverse, values)


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, *, normalize_by_std: bool = True, epsilon: float = 1e-6
) -> Tensor:
    """GRPO: (r - group mean) / (group std + epsilon), (B,) -> (B,).

    The std is the unbiased one (torch.std, divisor n - 1), as verl. With
    `normalize_by_std=False` this is Dr.GRPO: r - group mean. A group of one row gets 0.
    """
    inverse, sizes = _groups(group_index)
    centered = rewards - (_group_sum(rewards, inverse, len(sizes)) / sizes)[inverse]
    if normalize_by_std:
        variance = _group_sum(centered.square(), inverse, len(sizes)) / (sizes - 1).clamp(min=1)
        centered = centered / (variance.sqrt()[inverse] + epsilon)
    return torch.where(sizes[inverse] > 1, centered, 0.0)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: r_i - mean of the other rewards of its group, (B,) -> (B,); a group of one gets 0."""
    inverse, sizes = _groups(group_index)
    others_sum = _group_sum(rewards, inverse, len(sizes))[inverse] - rewards
    row_sizes = sizes[inverse]
    return torch.where(row_sizes > 1, rewards - others_sum / (row_sizes - 1).clamp(min=1), 0.0)


def groups_with_signal(rewards: Tensor, group_index: Tensor) -> Tensor:
    """DAPO dynamic sampling: (B,) bool, True for rows whose group's rewards are not all equal.

    Groups whose rewards all agree give every row advantage 0 under GRPO and RLOO, so they
    carry no learning signal.
    """
    inverse, sizes = _groups(group_index)
    per_group = torch.zeros(len(sizes), dtype=rewards.dtype)
    highest = per_group.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    lowest = per_group.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return (highest != lowest)[inverse]


def _masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """(v - mean) / sqrt(var + 1e-8) over masked entries (unbiased var, as verl); 0 elsewhere.

    Fewer than two masked entries have no variance: the result is then all 0.
    """
    if mask.sum() < 2:
        return torch.zeros_like(values)
    selected = values[mask]
    whitened = (values - selected.mean()) * torch.rsqrt(selected.var() + WHITEN_EPSILON)
    return torch.where(mask, whitened, 0.0)


def discounted_returns(token_rewards: Tensor, loss_mask: Tensor, *, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over model tokens only, (B, T); 0 off the mask.

    Rewards on non-model tokens are ignored, and non-model tokens do not count as steps.
    """
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        is_model = loss_mask[:, t]
        running = torch.where(is_model, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(is_model, running, 0.0)
    return returns


def reinforce_plus_plus_advantages(
    token_rewards: Tensor, loss_mask: Tensor, *, gamma: float = 1.0
) -> Tensor:
    """REINFORCE++: discounted returns whitened over all masked tokens of the batch, (B, T)."""
    return _masked_whiten(discounted_returns(token_rewards, loss_mask, gamma=gamma), loss_mask)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """GAE over model tokens only; returns (advantages, returns), both (B, T), 0 off the mask.

    Multi-turn definition: every model token (loss_mask True) is one action, taken in the state
    "everything before it", whose value is `values[:, t]` (see `FsdpCritic.values`). The state
    after a turn's last token is the state before the next turn's first model token, whose
    prefix already holds the tool or user reply: a reply is part of the transition, not a step,
    so it is not discounted and its positions' rewards and values are never read. After the
    row's last model token the episode ends (V = 0). Then, over model tokens t and their next
    model token t':

        delta_t = r_t + gamma * V_t' - V_t,    A_t = delta_t + gamma * lam * A_t',
        returns_t = A_t + V_t.

    This is verl's `compute_gae_advantage_return` with the loss mask as its response mask.
    Advantages are whitened over the masked tokens of the batch; returns are not. `values`
    gets no gradient.
    """
    values = values.detach()
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros(token_rewards.shape[0])
    next_advantage = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        is_model = loss_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(is_model, delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(is_model, values[:, t], next_value)
        advantages[:, t] = next_advantage
    returns = torch.where(loss_mask, advantages + values, 0.0)
    return _masked_whiten(advantages, loss_mask), returns


def sequence_rewards_to_tokens(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """(B,) rewards -> (B, T), each placed on its row's last model token; a row with no model
    token keeps all zeros (its reward is dropped)."""
    positions = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    last_positions = torch.where(loss_mask, positions, -1).amax(dim=1)
    token_rewards = torch.zeros(loss_mask.shape, dtype=rewards.dtype)
    rows = torch.nonzero(last_positions >= 0).squeeze(1)
    token_rewards[rows, last_positions[rows]] = rewards[rows]
    return token_rewards


def apply_kl_penalty(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    coef: float,
    estimator: str,
) -> Tensor:
    """KL in the reward: token_rewards - coef * KL estimate on model tokens, (B, T).

    `estimator` is a `losses.KL_ESTIMATORS` name; raises ValueError for an unknown one.
    """
    kl = torch.where(loss_mask, kl_estimate(logprobs, ref_logprobs, estimator), 0.0)
    return token_rewards - coef * kl.detach()


def _row_rewards(token_rewards: Tensor, loss_mask: Tensor) -> Tensor:
    return torch.where(loss_mask, token_rewards, 0.0).sum(dim=-1)


def _on_model_tokens(sequence_advantages: Tensor, loss_mask: Tensor) -> Tensor:
    return torch.where(loss_mask, sequence_advantages.unsqueeze(-1), 0.0)


Estimator = Callable[
    [Tensor, Tensor, Tensor, Tensor | None, float, float], tuple[Tensor, Tensor | None]
]


def _per_sequence(row_advantages: Callable[[Tensor, Tensor], Tensor]) -> Estimator:
    """An estimator that scores each row by its summed model-token rewards, takes the row
    advantages from `row_advantages(rewards, group_index)`, and puts them on its model tokens."""

    def estimate(
        token_rewards: Tensor,
        group_index: Tensor,
        loss_mask: Tensor,
        values: Tensor | None,
        gamma: float,
        lam: float,
    ) -> tuple[Tensor, None]:
        advantages = row_advantages(_row_rewards(token_rewards, loss_mask), group_index)
        return _on_model_tokens(advantages, loss_mask), None

    return estimate


def _reinforce_plus_plus(
    token_rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    values: Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[Tensor, None]:
    return reinforce_plus_plus_advantages(token_rewards, loss_mask, gamma=gamma), None


def _gae(
    token_rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    values: Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values from a critic; got None")
    return gae_advantages(token_rewards, values, loss_mask, gamma=gamma, lam=lam)


# Each takes (token_rewards, group_index, loss_mask, values, gamma, lam) and returns
# (advantages (B, T), returns (B, T) or None); see `compute_advantages`.
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _per_sequence(grpo_advantages),
    "dr_grpo": _per_sequence(partial(grpo_advantages, normalize_by_std=False)),
    "rloo": _per_sequence(rloo_advantages),
    "reinforce_plus_plus": _reinforce_plus_plus,
    "gae": _gae,
}


def compute_advantages(
    estimator: str,
    *,
    token_rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Advantages (B, T), 0 off the mask, and returns (B, T) for "gae" (None otherwise).

    `token_rewards` (B, T) holds the outcome reward on the last model token (see
    `sequence_rewards_to_tokens`) plus any per-token terms such as `apply_kl_penalty`'s.
    "grpo", "dr_grpo" and "rloo" score each row by the sum of its model-token rewards and
    broadcast the row's advantage to its model tokens; "reinforce_plus_plus" and "gae" are
    per token, and "gae" needs `values` (B, T). `group_index` is used by the group
    estimators only; `gamma` and `lam` by the token-level ones. Raises ValueError for an
    unknown estimator (listing the known ones) or "gae" without values.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    return estimate(token_rewards, group_index, loss_mask, values, gamma, lam)
