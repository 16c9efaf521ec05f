"""One RL update from scored trajectories: tensors from the rollout service's tokens, advantages,
the policy loss for `FsdpPolicy.train_step`, the value loss for `FsdpCritic.train_step`, and
the step's metrics.

Token ids, loss masks and rollout logprobs come from the trajectories as the engine produced
them; nothing is re-tokenized. `logprobs[:, t]` is the logprob of token t, the convention of
both the engine's segments and `FsdpPolicy.logprobs`; `values[:, t]` is the value of the state
token t was chosen in (`FsdpCritic.values`).
"""

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer_svc.advantages import (
    apply_kl_penalty,
    compute_advantages,
    sequence_rewards_to_tokens,
    turn_rewards_to_tokens,
)
from trainer_svc.batch import Batch, pad_rows, processed_images
from trainer_svc.config import AlgorithmConfig, CriticConfig, TrainerConfig
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.losses import (
    aggregate,
    behaviour_importance_weights,
    explained_variance,
    importance_weight_metrics,
    kl_estimate,
    logprob_mismatch,
    policy_loss,
    value_loss,
)
from trainer_svc.ranks import Models, share_of
from turnrl.trajectory import FinishReason, SegmentSource, Trajectory
from turnrl.vision import VisionProcessor


@dataclass
class RolloutBatch:
    """Trajectories of one step as padded tensors, a row per part (`Trajectory.parts`: one
    for most), with their rewards, groups and trajectories."""

    batch: Batch  # extras: rollout_logprobs, and policy_staleness given a policy_version
    rewards: Tensor  # (B,) each row its trajectory's
    group_index: Tensor  # (B,) long
    trajectories: list[Trajectory]
    # (B,) long: each row's trajectory, the sequence the group estimators score once.
    sequence_index: Tensor | None = None
    # (B, T) long: each model token's turn in its trajectory (`Trajectory.model_turn_spans`;
    # parts continue their trajectory's count), -1 on the other tokens.
    turn_index: Tensor | None = None
    # (B, K) each row its trajectory's summed `turn_rewards` per turn, K the batch's most turns.
    turn_rewards: Tensor | None = None


def rollout_batch(
    trajectories: list[Trajectory],
    pad_token_id: int,
    policy_version: int | None = None,
    vision: VisionProcessor | None = None,
) -> RolloutBatch:
    """Tensors of `trajectories`, a row per part; each needs at least one model token
    (`trainable`). Given the `policy_version` of the trainer's weights, the extra
    "policy_staleness" holds each model token's versions behind it (0 on the other tokens);
    a VLM policy's `vision` processes each row's images (`processed_images`). Raises
    ValueError for a model token newer than `policy_version`."""
    rows = [(i, part) for i, t in enumerate(trajectories) for part in t.parts]

    def per_row(values_of: Callable[[Trajectory], list]) -> list[list]:
        values = [values_of(t) for t in trajectories]
        return [values[i][start:end] for i, (start, end) in rows]

    extras = {"rollout_logprobs": per_row(lambda t: t.rollout_logprobs)}
    if policy_version is not None:
        extras["policy_staleness"] = per_row(lambda t: _token_staleness(t, policy_version))
    sequence_index = torch.tensor([i for i, _ in rows])
    group_index = _group_index(trajectories)[sequence_index]
    batch = Batch.from_sequences(
        per_row(lambda t: t.token_ids),
        per_row(lambda t: t.loss_mask),
        extras,
        pad_token_id,
        groups=group_index.tolist(),
        images=[processed_images(trajectories[i], vision) for i, _ in rows],
    )
    width = batch.input_ids.shape[1]
    return RolloutBatch(
        batch=batch,
        rewards=_rewards(trajectories)[sequence_index],
        group_index=group_index,
        trajectories=trajectories,
        sequence_index=sequence_index,
        turn_index=pad_rows(per_row(_token_turns), width, -1, torch.long),
        turn_rewards=_turn_rewards(trajectories)[sequence_index],
    )


def _token_turns(trajectory: Trajectory) -> list[int]:
    """Each token's model turn (`Trajectory.model_turn_spans`), -1 off model tokens."""
    turns = [-1] * len(trajectory.token_ids)
    for turn, (start, end) in enumerate(trajectory.model_turn_spans()):
        turns[start:end] = [turn] * (end - start)
    return turns


def _turn_rewards(trajectories: list[Trajectory]) -> Tensor:
    """(trajectories, the most model turns of one): the sum of each turn's `turn_rewards`."""
    summed = [_summed_turn_rewards(t) for t in trajectories]
    rewards = torch.zeros(len(trajectories), max(map(len, summed), default=0))
    for row, turns in enumerate(summed):
        rewards[row, : len(turns)] = torch.tensor(turns)
    return rewards


def _summed_turn_rewards(trajectory: Trajectory) -> list[float]:
    """Each model turn's turn rewards summed, in turn order. Raises ValueError for a turn
    reward of a turn the trajectory does not have (as `Trajectory.from_proto` does)."""
    summed = [0.0] * len(trajectory.model_turn_spans())
    for reward in trajectory.turn_rewards:
        if not 0 <= reward.turn < len(summed):
            raise ValueError(
                f"trajectory {trajectory.trajectory_id!r}: a {reward.source.name.lower()} "
                f"reward from {reward.name!r} is for turn {reward.turn}, but the trajectory "
                f"has {len(summed)} model turns"
            )
        summed[reward.turn] += reward.value
    return summed


def _token_staleness(trajectory: Trajectory, policy_version: int) -> list[float]:
    """policy_version - the token's policy version on model tokens, 0 on the others."""
    newest = max(trajectory.policy_versions, default=policy_version)
    if newest > policy_version:
        raise ValueError(
            f"trajectory {trajectory.trajectory_id!r} has model tokens of policy_version "
            f"{newest}, newer than the trainer's {policy_version}"
        )
    return [
        float(policy_version - segment.policy_version)
        if segment.source is SegmentSource.MODEL
        else 0.0
        for segment in trajectory.segments
        for _ in segment.token_ids
    ]


def staleness_metrics(trajectories: list[Trajectory], policy_version: int) -> dict[str, float]:
    """How far behind `policy_version` the trajectories were generated: a trajectory's
    staleness is policy_version - the oldest policy version among its model tokens (a partial
    rollout spans several). Returns "staleness/mean", "staleness/max" and, for each staleness s
    present, "staleness/{s}": the share of trajectories with staleness s. Trajectories without
    model tokens are left out; none left gives mean and max 0."""
    staleness = [
        policy_version - min(versions)
        for versions in (t.policy_versions for t in trajectories)
        if versions
    ]
    count = max(len(staleness), 1)
    metrics = {
        "staleness/mean": sum(staleness) / count,
        "staleness/max": float(max(staleness, default=0)),
    }
    for value in sorted(set(staleness)):
        metrics[f"staleness/{value}"] = staleness.count(value) / count
    return metrics


def _rewards(trajectories: list[Trajectory]) -> Tensor:
    return torch.tensor([t.reward.score for t in trajectories], dtype=torch.float32)


def _group_index(trajectories: list[Trajectory]) -> Tensor:
    """Each trajectory's group as 0, 1, ... in order of first appearance."""
    groups = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajectories))}
    return torch.tensor([groups[t.group_id] for t in trajectories])


def trainable(trajectory: Trajectory) -> bool:
    """A trajectory the loss can use: it holds model tokens, was not aborted or failed, and no
    infrastructure failure (`infra_failed`) set its reward."""
    return (
        any(trajectory.loss_mask)
        and trajectory.finish_reason not in (FinishReason.ABORTED, FinishReason.ERROR)
        and not infra_failed(trajectory)
    )


def infra_failed(trajectory: Trajectory) -> bool:
    """Whether a service, not the model, decided the outcome: the scorer failed (the reward is
    its configured default), a tool call could not be run by the tool service (the
    "tool_infra_errors" metric), or the user's agent failed its episode (the "agent_failed"
    metric: rollout_svc/agent_episodes.py; it has no reward). Such an outcome says nothing about
    the policy; it stays out of the loss and of its group's statistics."""
    reward_failed = trajectory.reward is not None and trajectory.reward.error
    metrics = trajectory.metrics
    return (
        reward_failed
        or metrics.get("tool_infra_errors", 0) > 0
        or metrics.get("agent_failed", 0) > 0
    )


def keep_groups_with_signal(
    trajectories: list[Trajectory], *, enable_turn_rewards: bool = False
) -> list[Trajectory]:
    """DAPO's dynamic sampling: the trajectories of groups whose rewards are not all equal.
    With `enable_turn_rewards`, a trajectory's rewards are its outcome and each turn's summed
    turn rewards, so a group whose outcomes agree but whose turns earned differently is kept:
    the turn-level estimators find signal there."""
    rewards_by_group: dict[str, set[tuple[float, ...]]] = collections.defaultdict(set)
    for trajectory in trajectories:
        rewards = (trajectory.reward.score,)
        if enable_turn_rewards:
            rewards += tuple(_summed_turn_rewards(trajectory))
        rewards_by_group[trajectory.group_id].add(rewards)
    return [t for t in trajectories if len(rewards_by_group[t.group_id]) > 1]


def prepare_update(
    rollouts: RolloutBatch,
    policy: FsdpPolicy,
    reference_logprobs: Callable[[Batch], Tensor] | None,
    critic: FsdpCritic | None,
    algorithm: AlgorithmConfig,
) -> dict[str, float]:
    """Adds old_logprobs, ref_logprobs, advantages and, with a critic, old_values and returns
    to the batch's extras; returns the train/inference mismatch metrics of the engine's
    logprobs against the trainer's (split by staleness when the batch has "policy_staleness"),
    the behaviour importance weights' statistics, the KL to the reference and the critic's
    fit.

    old_logprobs are the proximal policy of decoupled PPO, the engine's rollout_logprobs its
    behaviour policy (`behaviour_importance_weights`); `reference_logprobs` gives the KL
    term's reference logprobs of a batch (`kl_reference`)."""
    batch = rollouts.batch
    old_logprobs, _ = policy.logprobs(batch)
    batch.extras["old_logprobs"] = old_logprobs
    token_rewards = sequence_rewards_to_tokens(rollouts.rewards, batch.loss_mask)
    if algorithm.enable_turn_rewards:
        token_rewards = token_rewards + _turn_token_rewards(rollouts)
    metrics = _behaviour_metrics(batch, algorithm.importance_cap)
    if reference_logprobs is not None:
        ref_logprobs = reference_logprobs(batch)
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
        sequence_index=rollouts.sequence_index,
        turn_index=rollouts.turn_index,
        loss_mask=batch.loss_mask,
        values=old_values,
        gamma=algorithm.gamma,
        lam=algorithm.gae_lambda,
        turn_gamma=algorithm.turn_gamma,
    )
    batch.extras["advantages"] = advantages
    if returns is not None:  # gae or turn_gae, whose values came from the critic
        batch.extras["returns"] = returns
        metrics.update(_critic_fit_metrics(old_values, returns, batch.loss_mask))
    return metrics


def _turn_token_rewards(rollouts: RolloutBatch) -> Tensor:
    """The batch's per-turn rewards on the last token of their turns (`turn_rewards_to_tokens`).
    Raises ValueError for a trajectory in parts with turn rewards: the group estimators score a
    trajectory by its rows' mean reward, which would divide its turn rewards by its parts."""
    for trajectory in rollouts.trajectories:
        if len(trajectory.parts) > 1 and trajectory.turn_rewards:
            raise ValueError(
                f"trajectory {trajectory.trajectory_id!r} is in {len(trajectory.parts)} parts "
                "and has turn rewards; algorithm.enable_turn_rewards takes trajectories of one "
                "part (an agent that keeps its history)"
            )
    return turn_rewards_to_tokens(rollouts.turn_rewards, rollouts.turn_index)


def _behaviour_metrics(batch: Batch, cap: float) -> dict[str, float]:
    """The engine's logprobs against the trainer's old_logprobs over the batch's model tokens:
    "mismatch/*" (`logprob_mismatch`), the same per staleness s as "mismatch/staleness_{s}/
    mean_abs_diff" and ".../kl_k3" when the batch has "policy_staleness", and "is/*"
    (`importance_weight_metrics`, whatever the importance_sampling mode)."""
    rollout, old = batch.extras["rollout_logprobs"], batch.extras["old_logprobs"]
    mask = batch.loss_mask
    metrics = {f"mismatch/{k}": v for k, v in logprob_mismatch(rollout, old, mask).items()}
    staleness = batch.extras.get("policy_staleness")
    if staleness is not None:
        for value in sorted(set(staleness[mask].long().tolist())):
            stats = logprob_mismatch(rollout, old, mask & (staleness == value))
            for name in ("mean_abs_diff", "kl_k3"):
                metrics[f"mismatch/staleness_{value}/{name}"] = stats[name]
    weights = importance_weight_metrics(old, rollout, mask, cap=cap)
    metrics.update({f"is/{name}": value for name, value in weights.items()})
    return metrics


def rl_models(config: TrainerConfig, model_path: str) -> Models:
    """The policy of an RL run (with `trainer.lora`, adapters on a frozen base), its frozen
    reference when the loss has a KL term (with LoRA none: the base is the reference,
    `kl_reference`), and its critic with gae or turn_gae, always fully trained; their LR
    schedules span the run's updates."""
    algorithm = config.algorithm
    updates_per_step = algorithm.ppo_epochs * algorithm.mini_batches
    # critic_only_steps is 0 without a critic (the config refuses a critic section then).
    policy_steps = config.steps - config.critic.critic_only_steps
    optim = config.optim.for_run(policy_steps * updates_per_step)
    models = Models(policy=FsdpPolicy(model_path, optim, config.lora))
    if algorithm.kl_coef > 0 and config.lora is None:
        models.reference = FsdpPolicy(model_path, optim)
    if algorithm.trains_critic:
        critic_optim = config.critic.optim.for_run(config.steps * updates_per_step)
        models.critic = FsdpCritic(config.critic.model_path or model_path, critic_optim)
    if config.judge_model_path is not None:
        # Every weight trained, with or without trainer.lora (which is the policy's).
        models.judge = FsdpPolicy(config.judge_model_path, optim)
    return models


def kl_reference(models: Models, algorithm: AlgorithmConfig) -> Callable[[Batch], Tensor] | None:
    """The logprobs of a batch under the KL term's reference policy: the frozen reference
    model's, or a LoRA policy's with its adapters off; None without a KL term."""
    if algorithm.kl_coef == 0:
        return None
    if models.reference is None:
        return models.policy.reference_logprobs
    return lambda batch: models.reference.logprobs(batch)[0]


def rl_update(
    models: Models,
    rollouts: RolloutBatch,
    config: TrainerConfig,
    step: int,
    mini_batch_rows: list[list[int]],
) -> dict[str, float]:
    """One step's update (on every rank): recomputes logprobs (and values) of the whole batch,
    each rank its share of the rows, gathered on every rank (`FsdpModel._per_token`), computes
    advantages, then trains on each of `mini_batch_rows` in turn (the PPO epochs'
    mini-batches), a critic step (with gae or turn_gae) then a policy step, each rank on its
    share of the rows. Returns the step's metrics, equal on every rank."""
    algorithm = config.algorithm
    policy, critic = models.policy, models.critic
    reference_logprobs = kl_reference(models, algorithm)
    metrics = prepare_update(rollouts, policy, reference_logprobs, critic, algorithm)
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
    """The loss for `FsdpPolicy.train_step`: PPO-family policy loss (decoupled: the ratio against
    old_logprobs, each token weighted per `algorithm.importance_sampling`), KL loss, entropy
    bonus, each aggregated per `algorithm.loss_aggregation` and rescaled from the micro-batch's
    own counts to the step's global ones (the train_step contract)."""
    mode = algorithm.loss_aggregation

    def loss_fn(micro: Batch, logprobs: Tensor, entropy: Tensor | None):
        mask = micro.loss_mask
        weights = behaviour_importance_weights(
            micro.extras["old_logprobs"],
            micro.extras["rollout_logprobs"],
            mask,
            mode=algorithm.importance_sampling,
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


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, accuracy, lengths, turns and tool use of a set of trajectories (the loops count
    the ones `infra_failed` apart: those are left out of these figures). "turn_reward_mean" is
    the mean per trajectory of its summed `turn_rewards`, trained on or not."""
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
        "tool_call_share": sum(t.metrics["tool_calls"] > 0 for t in trajectories) / count,
        "tool_errors": sum(t.metrics["tool_errors"] for t in trajectories) / count,
        "turn_reward_mean": sum(r.value for t in trajectories for r in t.turn_rewards) / count,
    }


def accurate(trajectory: Trajectory) -> bool:
    """The scorer's `acc` when it reports one (GSM8K, math), else a positive reward."""
    extras = trajectory.reward.extras.fields
    if "acc" in extras:
        return extras["acc"].bool_value
    return trajectory.reward.score > 0
