"""Policy and value losses, KL estimators, train/inference mismatch and critic metrics.

Conventions: B sequences, T token positions, right-padded; float32 tensors. `loss_mask`
(B, T) bool is True on model-sampled tokens only; tool/user tokens between model turns and
padding are False and never contribute to a loss or a metric. Logprobs are natural logs of the
sampled token's probability. Every loss returns a scalar that stays connected to the graph even
when the mask is empty (it is then 0), so `backward()` never fails and never produces NaN.
"""

from collections.abc import Callable

import torch
from torch import Tensor

# Clamp on log ratios before exp(): a ratio of e^20 is already meaningless and e^89 is inf.
MAX_ABS_LOG_RATIO = 20.0

# Each maps log_ratio = log p - log q (samples drawn from p) to a per-token estimate of KL(p || q).
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio.square(),
    "k3": lambda log_ratio: torch.exp(-log_ratio) + log_ratio - 1.0,
}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy.

    "k1" is log p - log q (unbiased, high variance, can be negative); "k2" is
    0.5 * (log p - log q)^2 (biased, low variance); "k3" is Schulman's
    exp(log q - log p) - (log q - log p) - 1 (unbiased, low variance, never negative).
    Same shape as the inputs. Raises ValueError for an unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs - ref_logprobs)


def _token_mean(values: Tensor, mask: Tensor, normalizer: int | None) -> Tensor:
    return values.sum() / mask.sum().clamp(min=1)


def _seq_mean_token_sum(values: Tensor, mask: Tensor, normalizer: int | None) -> Tensor:
    return values.sum() / (mask.sum(dim=-1) > 0).sum().clamp(min=1)


def _seq_mean_token_mean(values: Tensor, mask: Tensor, normalizer: int | None) -> Tensor:
    row_counts = mask.sum(dim=-1)
    row_means = values.sum(dim=-1) / row_counts.clamp(min=1)
    return row_means.sum() / (row_counts > 0).sum().clamp(min=1)


def _seq_mean_token_sum_norm(values: Tensor, mask: Tensor, normalizer: int | None) -> Tensor:
    if normalizer is None or normalizer <= 0:
        raise ValueError(
            f"aggregation 'seq-mean-token-sum-norm' needs a positive normalizer "
            f"(e.g. max_response_length); got {normalizer!r}"
        )
    return values.sum() / (mask.shape[0] * normalizer)


# Rows with an empty mask count in no denominator, except in the "-norm" mode, whose
# denominator is the constant B * normalizer by design (Dr.GRPO: no length-dependent scale).
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str, *, normalizer: int | None = None
) -> Tensor:
    """Reduces a (B, T) per-token loss to a scalar over the tokens where `mask` is True.

    "token-mean": mean over all masked tokens of the batch. "seq-mean-token-sum": per-row
    sum, mean over non-empty rows. "seq-mean-token-mean": per-row mean, mean over non-empty
    rows. "seq-mean-token-sum-norm": sum of everything / (B * normalizer), normalizer a
    constant such as max_response_length (Dr.GRPO); required for that mode, ignored by the
    others. An all-empty mask gives 0. Raises ValueError for an unknown mode or a missing
    normalizer.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {sorted(AGGREGATIONS)}")
    # where(), not multiplication: padding may hold inf/NaN that 0 * x would keep.
    masked = torch.where(mask, per_token, 0.0)
    return AGGREGATIONS[mode](masked, mask, normalizer)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is True; 0 for an empty mask."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, ratio_level: str) -> Tensor:
    """Per-token log importance ratio, (B, T): token-level (PPO) or sequence-level (GSPO).

    GSPO's sequence log ratio is the mean over the row's model tokens of log p - log p_old; it
    is given to every token in the straight-through form lp - lp.detach() + seq.detach(),
    whose value is the sequence ratio and whose gradient is seq_ratio * d lp per token.
    """
    token_log_ratio = (logprobs - old_logprobs).clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    if ratio_level == "token":
        return token_log_ratio
    if ratio_level != "sequence":
        raise ValueError(f"unknown ratio_level {ratio_level!r}; known: ['sequence', 'token']")
    row_counts = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = torch.where(mask, token_log_ratio, 0.0).sum(dim=-1) / row_counts
    return logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)


def _check_clip_bounds(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1); got {clip_low!r}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0; got {clip_high!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1; got {dual_clip!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "token-mean",
    normalizer: int | None = None,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy-gradient loss; all inputs (B, T), only `logprobs` carries gradient.

    The ratio is clipped to [1 - clip_low, 1 + clip_high] (unequal bounds are DAPO's
    clip-higher). With `dual_clip` c > 1, a token with a negative advantage A has its loss
    capped at -c * A (dual-clip PPO). `ratio_level="sequence"` is GSPO: one ratio per row (see
    `_log_ratio`); the GSPO paper aggregates with "seq-mean-token-mean". `importance_weights`
    (e.g. from `behaviour_importance_weights`) multiply the per-token loss before aggregation.

    Returns (loss, metrics), metrics detached scalars over masked tokens: "clip_fraction"
    (share of tokens where the clipped term won), "dual_clip_fraction" (share capped by dual
    clip) and "approx_kl" (mean k2 estimate 0.5 * (lp - old_lp)^2). Raises ValueError for bad
    clip bounds, an unknown ratio_level or an unknown aggregation.
    """
    _check_clip_bounds(clip_low, clip_high, dual_clip)
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, loss_mask, ratio_level))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual_clipped = torch.zeros_like(loss_mask)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        is_dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(is_dual_clipped, cap, per_token)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    loss = aggregate(per_token, loss_mask, aggregation, normalizer=normalizer)
    token_log_ratio = (logprobs - old_logprobs).detach()
    metrics = {
        "clip_fraction": _masked_mean(is_clipped.float(), loss_mask),
        "dual_clip_fraction": _masked_mean(is_dual_clipped.float(), loss_mask),
        "approx_kl": _masked_mean(KL_ESTIMATORS["k2"](token_log_ratio), loss_mask),
    }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip_range: float | None,
    aggregation: str,
    normalizer: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value loss 0.5 * max((V - R)^2, (V_clipped - R)^2), aggregated over masked tokens.

    V_clipped = old_values + clamp(values - old_values, -clip_range, clip_range); with
    `clip_range=None` the loss is the plain 0.5 * (V - R)^2. Inputs (B, T); only `values`
    carries gradient. Returns (loss, metrics): "clip_fraction", the share of masked tokens
    where the clipped term won, a detached scalar.
    """
    per_token = (values - returns).square()
    is_clipped = torch.zeros_like(loss_mask)
    if clip_range is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        is_clipped = clipped > per_token
        per_token = torch.maximum(per_token, clipped)
    loss = 0.5 * aggregate(per_token, loss_mask, aggregation, normalizer=normalizer)
    return loss, {"clip_fraction": _masked_mean(is_clipped.float(), loss_mask)}


def explained_variance(values: Tensor, returns: Tensor, loss_mask: Tensor) -> float | None:
    """1 - Var(returns - values) / Var(returns) over masked tokens: 1 for a critic that predicts
    the returns, 0 for one that predicts only their mean, below 0 for worse. None when the
    returns do not vary (e.g. every reward of the batch equal), where it is undefined."""
    returns_there = returns[loss_mask]
    if returns_there.numel() == 0 or returns_there.var(correction=0) == 0:
        return None
    errors = returns_there - values[loss_mask]
    return float(1.0 - errors.var(correction=0) / returns_there.var(correction=0))


def logprob_mismatch(
    rollout_logprobs: Tensor, trainer_logprobs: Tensor, loss_mask: Tensor
) -> dict[str, float]:
    """How far the trainer's logprobs are from the engine's on the same sampled tokens.

    Over masked tokens: "mean_abs_diff" and "max_abs_diff" of the logprobs, and KL(rollout ||
    trainer) estimated on the rollout's samples as "kl_k1" (mean rollout_lp - trainer_lp) and
    "kl_k3" (mean k3). All 0.0 for an empty mask. Costs one device-to-host sync.
    """
    rollout, trainer = rollout_logprobs.detach(), trainer_logprobs.detach()
    abs_diff = torch.where(loss_mask, (rollout - trainer).abs(), 0.0)
    stats = torch.stack(
        [
            _masked_mean(abs_diff, loss_mask),
            abs_diff.max(),
            _masked_mean(kl_estimate(rollout, trainer, "k1"), loss_mask),
            _masked_mean(kl_estimate(rollout, trainer, "k3"), loss_mask),
        ]
    ).tolist()
    return dict(zip(["mean_abs_diff", "max_abs_diff", "kl_k1", "kl_k3"], stats, strict=True))


def _behaviour_weights(old_logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    """exp(old_lp - rollout_lp) per token, (B, T), the log ratio clamped to +-MAX_ABS_LOG_RATIO;
    no gradient."""
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    return torch.exp(log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))


def _truncate(weights: Tensor, loss_mask: Tensor, cap: float) -> Tensor:
    return weights.clamp(max=cap)


def _mask(weights: Tensor, loss_mask: Tensor, cap: float) -> Tensor:
    return torch.where(weights <= cap, weights, 0.0)


def _reject(weights: Tensor, loss_mask: Tensor, cap: float) -> Tensor:
    rejected = ((weights > cap) & loss_mask).any(dim=-1, keepdim=True)
    return torch.where(rejected, 0.0, weights)


# Each maps raw weights w (B, T), the loss mask and the cap C to the weights the loss uses.
IMPORTANCE_SAMPLING: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "truncate": _truncate,
    "mask": _mask,
    "reject": _reject,
}


def behaviour_importance_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *, mode: str, cap: float
) -> Tensor | None:
    """Importance weights from the behaviour policy (the engine) to the proximal policy, (B, T).

    Decoupled PPO (AReaL): the PPO ratio is taken against the proximal policy, the trainer's
    `old_logprobs` before the update, and the tokens, sampled by the engine's `rollout_logprobs`
    (possibly an older policy version, and always another numerical implementation), are
    reweighted by w = exp(old_lp - rollout_lp) = proximal / behaviour. With C = `cap`:

    - "truncate": min(w, C), token-level truncated IS (TIS).
    - "mask": w where w <= C, else 0, token-level masked IS (AReaL's behaviour-weight cap): the
      token leaves the loss's numerator but stays in its denominator (the aggregation's counts,
      which the micro-batch shares rely on, are the loss mask's).
    - "reject": sequence-level rejection: a row any of whose model tokens has w > C gets weight
      0 on every token; the other rows keep their w (all <= C, so bounded like "mask"). In a
      multi-turn trajectory the turns after a token the engine sampled far off the trainer's
      distribution were conditioned on it, so the whole trajectory, not only that token, is
      suspect; "mask" would keep training on its continuation.
    - "none": no behaviour correction (the ablation); returns None, which `policy_loss` reads
      as no weights.

    Weights are 1 where `loss_mask` is False and carry no gradient. Raises ValueError for an
    unknown mode or cap <= 0.
    """
    if mode == "none":
        return None
    if mode not in IMPORTANCE_SAMPLING:
        known = sorted(["none", *IMPORTANCE_SAMPLING])
        raise ValueError(f"unknown importance_sampling mode {mode!r}; known: {known}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0; got {cap!r}")
    weights = IMPORTANCE_SAMPLING[mode](
        _behaviour_weights(old_logprobs, rollout_logprobs), loss_mask, cap
    )
    return torch.where(loss_mask, weights, 1.0)


def importance_weight_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *, cap: float
) -> dict[str, float]:
    """Statistics of the raw behaviour weights w = exp(old_lp - rollout_lp) over masked tokens,
    before any mode's cap: "weight_mean", "weight_max" and "capped_fraction" (share of tokens
    with w > cap). All 0.0 for an empty mask. Costs one device-to-host sync."""
    weights = torch.where(loss_mask, _behaviour_weights(old_logprobs, rollout_logprobs), 0.0)
    stats = torch.stack(
        [
            _masked_mean(weights, loss_mask),
            weights.max(),
            _masked_mean((weights > cap).float(), loss_mask),
        ]
    ).tolist()
    return dict(zip(["weight_mean", "weight_max", "capped_fraction"], stats, strict=True))
