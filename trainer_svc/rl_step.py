"""One RL update from scored trajectories: tensors from the rollout service's tokens, advantages,
the policy loss for `FsdpPolicy.train_step`, the value loss for `FsdpCritic.train_step`, and
the step's metrics.

Token ids, loss masks and rollout logprobs come from the trajectories as the engine produced
them; nothing is re-tokenized. `logprobs[:, t]` is the logprob of token t, the convention of
both the engine's segments and `FsdpPolicy.logprobs`; `values[:, t]` is the value of the state
token t was chosen in (`FsdpCritic.values`).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer_svc.advantages import (
    apply_kl_penalty,
    compute_advantages,
    groups_with_signal,
    sequence_rewards_to_tokens,
)
from trainer_svc.config import AlgorithmConfig, CriticConfig, TrainerConfig
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import Batch, FsdpPolicy
from trainer_svc.losses import (
    aggregate,
    explained_variance,
    kl_estimate,
    logprob_mismatch,
    policy_loss,
    truncated_importance_weights,
    value_loss,
)
from trainer_svc.ranks import Models, share_of
from turnrl.trajectory import FinishReason, Trajectory


@dataclass
class RolloutBatch:
    """Trajectories of one step as padded tensors, with their rewards and groups."""

    batch: Batch  # extras: rollout_logprobs
    rewards: Tensor  # (B,)
    group_index: Tensor  # (B,) long
    trajectories: list[Trajectory]


def rollout_batch(trajectories: list[Trajectory], pad_token_id: int) -> RolloutBatch:
    """Tensors of `trajectories`; each needs at least one model token (`trainable`)."""
    batch = Batch.from_sequences(
        [t.token_ids for t in trajectories],
        [t.loss_mask for t in trajectories],
        {"rollout_logprobs": [t.rollout_logprobs for t in trajectories]},
        pad_token_id,
    )
    return RolloutBatch(
        batch=batch,
        rewards=_rewards(trajectories),
        group_index=_group_index(trajectories),
        trajectories=trajectories,
    )


def _rewards(trajectories: list[Trajectory]) -> Tensor:
    return torch.tensor([t.reward.score for t in trajectories], dtype=torch.float32)


def _group_index(trajectories: list[Trajectory]) -> Tensor:
    """Each trajectory's group as 0, 1, ... in order of first appearance."""
    groups = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajectories))}
    return torch.tensor([groups[t.group_id] for t in trajectories])


def trainable(trajectory: Trajectory) -> bool:
    """A trajectory the loss can use: it holds model tokens and was not aborted or failed."""
    return any(trajectory.loss_mask) and trajectory.finish_reason not in (
        FinishReason.ABORTED,
        FinishReason.ERROR,
    )


def keep_groups_with_signal(trajectories: list[Trajectory]) -> list:
    """DAPO's dynamic sampling: the trajectories of groups whose rewards are not all equal."""
    if not trajectories:
        return []
    keep = groups_with_signal(_rewards(trajectories), _group_index(trajectories))
    return [t for t, kept in zip(trajectories, keep.tolist(), strict=True) if kept]


def prepare_update(
    rollouts: RolloutBatch,
    policy: FsdpPolicy,
    reference: FsdpPolicy | None,
    critic: FsdpCritic | None,
    algorithm: AlgorithmConfig,
) -> dict[str, float]:
    """Adds old_logprobs, ref_logprobs, advantages and, with a critic, old_values and returns
    to the batch's extras; returns the train/inference mismatch metrics of the engine's
    logprobs against the trainer's, the KL to the reference and the critic's fit."""
    batch = rollouts.batch
    old_logprobs, _ = policy.logprobs(batch)
    batch.extras["old_logprobs"] = old_logprobs
    token_rewards = sequence_rewards_to_tokens(rollouts.rewards, batch.loss_mask)
    metrics = {
        f"mismatch/{name}": value
        for name, value in logprob_mismatch(
            batch.extras["rollout_logprobs"], old_logprobs, batch.loss_mask
        ).items()
    }
    if reference is not None:
        ref_logprobs, _ = reference.logprobs(batch)
        batch.extras["ref_logprobs"] = ref_logprobs
        kl = kl_estimate(old_logprobs, ref_logprobs, algorithm.kl_estimator)
        metrics["kl_to_reference"] = float(aggregate(kl, batch.loss_mask, "token-mean"))
        if algorithm.kl_in_reward:
            token_rewards = apply_kl_penalty(
                token_rewards,
                old_logprobs,
                ref_logprobs,
                batch.loss_mask,
                coef=algorithm.kl_coef,
                estimator=algorithm.kl_estimator,
            )
    old_values = None
    if critic is not None:
        old_values = batch.extras["old_values"] = critic.values(batch)
    advantages, returns = compute_advantages(
        algorithm.advantage_estimator,
        token_rewards=token_rewards,
        group_index=rollouts.group_index,
        loss_mask=batch.loss_mask,
        values=old_values,
        gamma=algorithm.gamma,
        lam=algorithm.gae_lambda,
    )
    batch.extras["advantages"] = advantages
    if returns is not None:  # gae, whose values came from the critic
        batch.extras["returns"] = returns
        metrics.update(_critic_fit_metrics(old_values, returns, batch.loss_mask))
    return metrics


def rl_models(config: TrainerConfig, model_path: str) -> Models:
    """The policy of an RL run, its frozen reference when the loss has a KL term, and its critic
    with gae; their LR schedules span the run's updates."""
    algorithm = config.algorithm
    updates_per_step = algorithm.ppo_epochs * algorithm.mini_batches
    # critic_only_steps is 0 unless gae (the config refuses a critic section otherwise).
    policy_steps = config.steps - config.critic.critic_only_steps
    optim = config.optim.for_run(policy_steps * updates_per_step)
    models = Models(policy=FsdpPolicy(model_path, optim))
    if algorithm.kl_coef > 0:
        models.reference = FsdpPolicy(model_path, optim)
    if algorithm.advantage_estimator == "gae":
        critic_optim = config.critic.optim.for_run(config.steps * updates_per_step)
        models.critic = FsdpCritic(config.critic.model_path or model_path, critic_optim)
    return models


def rl_update(
    models: Models,
    rollouts: RolloutBatch,
    config: TrainerConfig,
    step: int,
    mini_batch_rows: list[list[int]],
) -> dict[str, float]:
    """One step's update (on every rank): recomputes logprobs (and values) of the whole batch,
    computes advantages, then trains on each of `mini_batch_rows` in turn (the PPO epochs'
    mini-batches), a critic step (with gae) then a policy step, each rank on its share of the
    rows. Returns the step's metrics, equal on every rank."""
    algorithm = config.algorithm
    policy, critic = models.policy, models.critic
    metrics = prepare_update(rollouts, policy, models.reference, critic, algorithm)
    normalizer = config.rollout.max_response_length or rollouts.batch.input_ids.shape[1]
    loss_fn = make_loss_fn(algorithm, normalizer)
    value_loss_fn = make_value_loss_fn(algorithm, config.critic, normalizer)
    update_policy = step > config.critic.critic_only_steps
    sums: dict[str, float] = {}
    for rows in mini_batch_rows:
        mini = share_of(models, rollouts.batch, rows)
        results = {}
        if critic is not None:
            result = critic.train_step(mini, value_loss_fn)
            results.update({f"critic/{name}": value for name, value in result.items()})
        if update_policy:
            result = policy.train_step(mini, loss_fn, with_entropy=True)
            results.update({f"train/{name}": value for name, value in result.items()})
        for name, value in results.items():
            sums[name] = sums.get(name, 0.0) + value
    metrics.update({name: value / len(mini_batch_rows) for name, value in sums.items()})
    return metrics


def _critic_fit_metrics(values: Tensor, returns: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """How well the critic's values, before this step's update, predict this step's returns:
    their means over model tokens and the explained variance (left out when the returns do not
    vary, where it is undefined)."""
    metrics = {
        "critic/value_mean": float(aggregate(values, loss_mask, "token-mean")),
        "critic/return_mean": float(aggregate(returns, loss_mask, "token-mean")),
    }
    explained = explained_variance(values, returns, loss_mask)
    if explained is not None:
        metrics["critic/explained_variance"] = explained
    return metrics


def make_loss_fn(algorithm: AlgorithmConfig, normalizer: int):
    """The loss for `FsdpPolicy.train_step`: PPO-family policy loss, KL loss, entropy bonus,
    each aggregated per `algorithm.loss_aggregation` and rescaled from the micro-batch's own
    counts to the step's global ones (the train_step contract)."""
    mode = algorithm.loss_aggregation

    def loss_fn(micro: Batch, logprobs: Tensor, entropy: Tensor | None):
        mask = micro.loss_mask
        weights = None
        if algorithm.importance_cap is not None:
            weights = truncated_importance_weights(
                micro.extras["old_logprobs"],
                micro.extras["rollout_logprobs"],
                mask,
                cap=algorithm.importance_cap,
            )
        loss, metrics = policy_loss(
            logprobs,
            micro.extras["old_logprobs"],
            micro.extras["advantages"],
            mask,
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            dual_clip=algorithm.dual_clip,
            ratio_level=algorithm.ratio_level,
            aggregation=mode,
            normalizer=normalizer,
            importance_weights=weights,
        )
        reported = {name: float(value.detach()) for name, value in metrics.items()}
        if algorithm.kl_coef > 0 and not algorithm.kl_in_reward:
            kl = kl_estimate(logprobs, micro.extras["ref_logprobs"], algorithm.kl_estimator)
            kl_loss = aggregate(kl, mask, mode, normalizer=normalizer)
            loss = loss + algorithm.kl_coef * kl_loss
            reported["kl_loss"] = float(kl_loss.detach())
        if entropy is not None:
            entropy_mean = aggregate(entropy, mask, mode, normalizer=normalizer)
            loss = loss - algorithm.entropy_coef * entropy_mean
            reported["entropy"] = float(entropy_mean.detach())
        return loss * _global_share(micro, mode), reported

    return loss_fn


def make_value_loss_fn(algorithm: AlgorithmConfig, critic: CriticConfig, normalizer: int):
    """The loss for `FsdpCritic.train_step`: PPO's clipped value loss against the returns,
    aggregated per `algorithm.loss_aggregation` like the policy loss and rescaled to the step's
    global counts (the train_step contract)."""
    mode = algorithm.loss_aggregation

    def loss_fn(micro: Batch, values: Tensor):
        loss, metrics = value_loss(
            values,
            micro.extras["old_values"],
            micro.extras["returns"],
            micro.loss_mask,
            clip_range=critic.value_clip_range,
            aggregation=mode,
            normalizer=normalizer,
        )
        reported = {name: float(value) for name, value in metrics.items()}
        return loss * _global_share(micro, mode), reported

    return loss_fn


def _global_share(micro: Batch, mode: str) -> float:
    """The micro-batch's share of the step: its loss, a mean over its own tokens or rows, times
    this is its part of the mean over all ranks' batch."""
    if mode == "token-mean":
        return float(micro.loss_mask.sum()) / micro.global_token_count
    # The seq-mean modes count rows with loss tokens: all but a rank's filler (`trainable`).
    return float(micro.loss_mask.any(1).sum()) / micro.global_sequence_count


def mini_batches(size: int, count: int, generator: torch.Generator) -> list[list[int]]:
    """`count` shuffled, near-equal slices of the row indices 0..size-1."""
    order = torch.randperm(size, generator=generator).tolist()
    return [order[i::count] for i in range(count) if order[i::count]]


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, accuracy, lengths, turns and tool use of a set of trajectories."""
    count = max(len(trajectories), 1)
    rewards = torch.tensor([t.reward.score for t in trajectories] or [0.0])
    response_lengths = [t.response_length for t in trajectories]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(trajectories) > 1 else 0.0,
        "accuracy": sum(map(accurate, trajectories)) / count,
        "response_length": sum(response_lengths) / count,
        "turns": sum(len(t.turns) for t in trajectories) / count,
        "tool_calls": sum(t.metrics["tool_calls"] for t in trajectories) / count,
        "tool_errors": sum(t.metrics["tool_errors"] for t in trajectories) / count,
        "reward_errors": sum(t.reward.error for t in trajectories) / count,
    }


def accurate(trajectory: Trajectory) -> bool:
    """The scorer's `acc` when it reports one (GSM8K, math), else a positive reward."""
    extras = trajectory.reward.extras.fields
    if "acc" in extras:
        return extras["acc"].bool_value
    return trajectory.reward.score > 0
