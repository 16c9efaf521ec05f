"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE, and their turn-level
forms, as functions on tensors.

Conventions: B sequences, T token positions, right-padded; float32 CPU tensors. `loss_mask`
(B, T) bool is True on model-sampled tokens only; tool/user tokens between model turns and
padding are False and get advantage 0. `group_index` (B,) long names the prompt group (the n
samples of one prompt) of each row. Sequence-level estimators return (B,); `compute_advantages`
broadcasts them to every model token of the row. A trajectory in parts (`Trajectory.parts`) is
a row per part, each ending in the trajectory's reward; `sequence_index` (B,) names each row's
trajectory so that the group estimators score a trajectory once, not once per part. Token-level
estimators treat only model tokens as actions: the step after a model token is the next model
token, whatever lies between.

Turn-level estimators take a model turn (`Trajectory.model_turn_spans`: the tokens of one
assistant message) as the step. `turn_index` (B, T) long holds each model token's turn, -1 on
the other tokens. A turn's reward R_k is the sum of its tokens' rewards: the outcome on the
last model token, per-turn rewards on the last token of their turn (`turn_rewards_to_tokens`),
the KL penalty of `apply_kl_penalty` on every token. Its return is G_k = R_k + turn_gamma *
G_{k+1}, G after the last turn 0, and every token of turn k gets turn k's advantage. The
discount is per turn, apart from the per-token `gamma`: the credit of an action taken in a turn
should not shrink with the length of the turns after it.

- turn_reinforce_plus_plus: G_k, whitened over the batch's model tokens like REINFORCE++.
- turn_grpo: GRPO per turn index: (G_k - mean) / (std + epsilon) over the samples of the prompt
  group that have a turn k (unbiased std); a turn k that only one sample has gets 0.
  turn_dr_grpo: G_k - mean, Dr.GRPO's form.
- turn_gae: GAE with turns as steps; see `turn_gae_advantages`.

Turn-level estimators refuse a trajectory in parts (rows sharing a `sequence_index`): each part
ends in the outcome, which would count once per part in the turn returns.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
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


def _turn_slots(turn_index: Tensor, num_turns: int) -> Tensor:
    """Each token's column in a (B, num_turns + 1) per-turn table: its turn, or the spare last
    column for the tokens of no turn."""
    return torch.where(turn_index >= 0, turn_index, num_turns)


def _per_turn_sums(token_values: Tensor, turn_index: Tensor, num_turns: int) -> Tensor:
    """(B, T) -> (B, num_turns): the sum of each turn's tokens' values."""
    slots = _turn_slots(turn_index, num_turns)
    sums = torch.zeros(len(token_values), num_turns + 1, dtype=token_values.dtype)
    return sums.scatter_add_(1, slots, token_values)[:, :num_turns]


def _on_turn_tokens(turn_values: Tensor, turn_index: Tensor) -> Tensor:
    """(B, K) -> (B, T): each token of turn k gets its row's value k; other tokens 0."""
    spare = torch.zeros(len(turn_values), 1, dtype=turn_values.dtype)
    table = torch.cat([turn_values, spare], dim=1)
    return table.gather(1, _turn_slots(turn_index, turn_values.shape[1]))


def per_turn_rewards(token_rewards: Tensor, turn_index: Tensor) -> tuple[Tensor, Tensor]:
    """(R, has_turn), both (B, K) with K the most turns of a row: R_k the sum of turn k's token
    rewards (tokens of no turn are ignored), and whether the row has a turn k. A row's turns
    are 0, 1, ...: the turns it lacks come after its last."""
    num_turns = int(turn_index.max()) + 1 if turn_index.numel() else 0
    rewards = _per_turn_sums(token_rewards, turn_index, num_turns)
    has_turn = _per_turn_sums(torch.ones_like(token_rewards), turn_index, num_turns) > 0
    return rewards, has_turn


def discounted_turn_returns(turn_rewards: Tensor, *, turn_gamma: float) -> Tensor:
    """G_k = R_k + turn_gamma * G_{k+1}, (B, K) -> (B, K); a turn after the row's last has
    R = 0, so the row's last turn has G = R."""
    returns = torch.zeros_like(turn_rewards)
    running = torch.zeros(len(turn_rewards))
    for k in reversed(range(turn_rewards.shape[1])):
        running = returns[:, k] = turn_rewards[:, k] + turn_gamma * running
    return returns


def turn_grpo_advantages(
    turn_returns: Tensor,
    has_turn: Tensor,
    group_index: Tensor,
    *,
    normalize_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Tensor:
    """GRPO per (prompt group, turn index) over the rows that have that turn, (B, K) -> (B, K);
    0 where a row has no turn k, and for a (group, k) that one row alone has."""
    inverse, _ = _groups(group_index)
    num_turns = turn_returns.shape[1]
    cells = inverse[:, None] * num_turns + torch.arange(num_turns)
    advantages = torch.zeros_like(turn_returns)
    advantages[has_turn] = grpo_advantages(
        turn_returns[has_turn],
        cells[has_turn],
        normalize_by_std=normalize_by_std,
        epsilon=epsilon,
    )
    return advantages


def turn_gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    turn_index: Tensor,
    loss_mask: Tensor,
    *,
    turn_gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """GAE with model turns as steps; returns (advantages, returns), both (B, T), 0 off the mask.

    Turn k is one action taken in the state before its first token, whose value V_k is
    `values` at that token (the prefix up to and with the tool or user reply before it). After
    the row's last turn the episode ends (V = 0). With R_k the sum of turn k's token rewards:

        delta_k = R_k + turn_gamma * V_{k+1} - V_k,    A_k = delta_k + turn_gamma * lam * A_{k+1},
        returns_k = A_k + V_k.

    Every token of turn k gets A_k (whitened over the batch's model tokens) and returns_k: the
    critic's loss, which reads `returns` per token, regresses every value of the turn to the
    turn's return, so V_k, the one read here, learns it, and the values inside a turn, which
    turn_gae never reads, estimate the same return. `values` gets no gradient.
    """
    values = values.detach()
    rewards, _ = per_turn_rewards(token_rewards, turn_index)
    num_turns = rewards.shape[1]
    previous = F.pad(turn_index, (1, 0), value=-1)[:, :-1]
    first_tokens = (turn_index >= 0) & (turn_index != previous)
    start_values = _per_turn_sums(torch.where(first_tokens, values, 0.0), turn_index, num_turns)
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros(len(rewards))
    for k in reversed(range(num_turns)):
        delta = rewards[:, k] + turn_gamma * next_value - start_values[:, k]
        next_advantage = advantages[:, k] = delta + turn_gamma * lam * next_advantage
        next_value = start_values[:, k]
    token_advantages = _on_turn_tokens(advantages, turn_index)
    returns = torch.where(loss_mask, _on_turn_tokens(advantages + start_values, turn_index), 0.0)
    return _masked_whiten(token_advantages, loss_mask), returns


def sequence_rewards_to_tokens(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """(B,) rewards -> (B, T), each placed on its row's last model token; a row with no model
    token keeps all zeros (its reward is dropped)."""
    positions = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    last_positions = torch.where(loss_mask, positions, -1).amax(dim=1)
    token_rewards = torch.zeros(loss_mask.shape, dtype=rewards.dtype)
    rows = torch.nonzero(last_positions >= 0).squeeze(1)
    token_rewards[rows, last_positions[rows]] = rewards[rows]
    return token_rewards


def turn_rewards_to_tokens(turn_rewards: Tensor, turn_index: Tensor) -> Tensor:
    """(B, K) per-turn rewards -> (B, T), each on the last token of its turn in its row; a turn
    a row does not hold (another part's) leaves its reward off that row."""
    positions = torch.arange(turn_index.shape[1]).expand_as(turn_index)
    num_turns = turn_rewards.shape[1]
    slots = _turn_slots(turn_index, num_turns)
    last = torch.full((len(turn_index), num_turns + 1), -1).scatter_reduce_(
        1, slots, positions, "amax"
    )
    rows, turns = torch.nonzero(last[:, :num_turns] >= 0, as_tuple=True)
    token_rewards = torch.zeros(turn_index.shape, dtype=turn_rewards.dtype)
    token_rewards[rows, last[rows, turns]] = turn_rewards[rows, turns]
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


@dataclass(frozen=True)
class AdvantageInputs:
    """What every estimator is given: B rows of T tokens (see the module docstring)."""

    token_rewards: Tensor  # (B, T) float
    loss_mask: Tensor  # (B, T) bool
    group_index: Tensor  # (B,) long
    sequence_index: Tensor  # (B,) long
    turn_index: Tensor | None  # (B, T) long, -1 off model tokens; turn-level estimators only
    values: Tensor | None  # (B, T) the critic's; gae and turn_gae only
    gamma: float  # per model token
    lam: float  # GAE's lambda
    turn_gamma: float  # per model turn


Estimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]


def _per_sequence(row_advantages: Callable[[Tensor, Tensor], Tensor]) -> Estimator:
    """An estimator that scores each sequence (the rows of one `sequence_index`) by its rows'
    mean summed model-token rewards, takes the sequence advantages from
    `row_advantages(rewards, group_index)`, and puts them on its rows' model tokens."""

    def estimate(inputs: AdvantageInputs) -> tuple[Tensor, None]:
        sequence, rows = _groups(inputs.sequence_index)
        row_rewards = _row_rewards(inputs.token_rewards, inputs.loss_mask)
        rewards = _group_sum(row_rewards, sequence, len(rows)) / rows
        groups = torch.zeros(len(rows), dtype=inputs.group_index.dtype)
        groups.scatter_(0, sequence, inputs.group_index)
        advantages = row_advantages(rewards, groups)[sequence]
        return _on_model_tokens(advantages, inputs.loss_mask), None

    return estimate


def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    advantages = reinforce_plus_plus_advantages(
        inputs.token_rewards, inputs.loss_mask, gamma=inputs.gamma
    )
    return advantages, None


def _critic_values(inputs: AdvantageInputs, estimator: str) -> Tensor:
    if inputs.values is None:
        raise ValueError(f"advantage estimator {estimator!r} needs values from a critic; got None")
    return inputs.values


def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    values = _critic_values(inputs, "gae")
    return gae_advantages(
        inputs.token_rewards, values, inputs.loss_mask, gamma=inputs.gamma, lam=inputs.lam
    )


def _whole_trajectory_turns(inputs: AdvantageInputs, estimator: str) -> Tensor:
    """The turn index of a batch whose rows are whole trajectories; raises ValueError for one
    without a turn index or with a trajectory in parts."""
    if inputs.turn_index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs a turn_index; got None")
    if len(torch.unique(inputs.sequence_index)) < len(inputs.sequence_index):
        raise ValueError(
            f"advantage estimator {estimator!r} scores the turns of whole trajectories, and a "
            "trajectory of this batch is in parts (rows sharing a sequence_index: an agent "
            "that rewrote its history); use an estimator that is not turn-level"
        )
    return inputs.turn_index


def _turn_reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    turn_index = _whole_trajectory_turns(inputs, "turn_reinforce_plus_plus")
    rewards, _ = per_turn_rewards(inputs.token_rewards, turn_index)
    returns = discounted_turn_returns(rewards, turn_gamma=inputs.turn_gamma)
    return _masked_whiten(_on_turn_tokens(returns, turn_index), inputs.loss_mask), None


def _turn_grpo(estimator: str, *, normalize_by_std: bool) -> Estimator:
    def estimate(inputs: AdvantageInputs) -> tuple[Tensor, None]:
        turn_index = _whole_trajectory_turns(inputs, estimator)
        rewards, has_turn = per_turn_rewards(inputs.token_rewards, turn_index)
        returns = discounted_turn_returns(rewards, turn_gamma=inputs.turn_gamma)
        advantages = turn_grpo_advantages(
            returns, has_turn, inputs.group_index, normalize_by_std=normalize_by_std
        )
        return _on_turn_tokens(advantages, turn_index), None

    return estimate


def _turn_gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    turn_index = _whole_trajectory_turns(inputs, "turn_gae")
    return turn_gae_advantages(
        inputs.token_rewards,
        _critic_values(inputs, "turn_gae"),
        turn_index,
        inputs.loss_mask,
        turn_gamma=inputs.turn_gamma,
        lam=inputs.lam,
    )


# Each takes the batch's `AdvantageInputs` and returns (advantages (B, T), returns (B, T) or
# None); see `compute_advantages`.
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _per_sequence(grpo_advantages),
    "dr_grpo": _per_sequence(partial(grpo_advantages, normalize_by_std=False)),
    "rloo": _per_sequence(rloo_advantages),
    "reinforce_plus_plus": _reinforce_plus_plus,
    "gae": _gae,
    "turn_reinforce_plus_plus": _turn_reinforce_plus_plus,
    "turn_grpo": _turn_grpo("turn_grpo", normalize_by_std=True),
    "turn_dr_grpo": _turn_grpo("turn_dr_grpo", normalize_by_std=False),
    "turn_gae": _turn_gae,
}


def compute_advantages(
    estimator: str,
    *,
    token_rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    sequence_index: Tensor | None = None,
    turn_index: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_gamma: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Advantages (B, T), 0 off the mask, and returns (B, T) for "gae" and "turn_gae" (None
    otherwise).

    `token_rewards` (B, T) holds the outcome reward on the last model token (see
    `sequence_rewards_to_tokens`) plus any per-token terms such as `apply_kl_penalty`'s and
    per-turn rewards (`turn_rewards_to_tokens`).
    "grpo", "dr_grpo" and "rloo" score each row by the sum of its model-token rewards and
    broadcast the row's advantage to its model tokens; "reinforce_plus_plus" and "gae" are
    per token, and "gae" needs `values` (B, T); the turn-level ones (module docstring) need
    `turn_index` (B, T), "turn_gae" `values` too. `group_index` and `sequence_index` (None:
    each row its own sequence) are used by the group estimators only; `gamma` by the
    token-level ones, `turn_gamma` by the turn-level ones, `lam` by both GAEs. Raises
    ValueError for an unknown estimator (listing the known ones), a missing input or a
    turn-level estimator on a trajectory in parts.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    if sequence_index is None:
        sequence_index = torch.arange(len(group_index))
    inputs = AdvantageInputs(
        token_rewards=token_rewards,
        loss_mask=loss_mask,
        group_index=group_index,
        sequence_index=sequence_index,
        turn_index=turn_index,
        values=values,
        gamma=gamma,
        lam=lam,
        turn_gamma=turn_gamma,
    )
    return ADVANTAGE_ESTIMATORS[estimator](inputs)
