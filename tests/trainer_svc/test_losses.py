"""Losses, KL estimators and mismatch metrics against values worked out by hand in each test."""

import math

import pytest
import torch
from torch.testing import assert_close

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


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def mask(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.5 * 0.5**2, 0.5 * 1.0**2]),
        ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
    ],
)
def test_kl_estimators(estimator: str, expected: list[float]) -> None:
    # log p - log q = 0.5 and -1.0.
    assert_close(
        kl_estimate(tensor([-1.0, -2.0]), tensor([-1.5, -1.0]), estimator), tensor(expected)
    )


def test_unknown_kl_estimator_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'k4'.*\['k1', 'k2', 'k3'\]"):
        kl_estimate(tensor([0.0]), tensor([0.0]), "k4")


# Rows of 3, 1 and 0 model tokens; NaN padding must not leak through.
NAN = float("nan")
PER_TOKEN = tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
ROWS_MASK = mask([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),  # the empty row counts for nothing
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 4) / (3 * 4)),  # B = 3 rows, normalizer 4
    ],
)
def test_aggregation_modes_differ_on_rows_of_different_lengths(mode: str, expected: float) -> None:
    assert_close(aggregate(PER_TOKEN, ROWS_MASK, mode, normalizer=4), torch.tensor(expected))


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_all_empty_mask_gives_zero_and_a_finite_gradient(mode: str) -> None:
    per_token = torch.ones(2, 3, requires_grad=True)
    loss = aggregate(per_token, torch.zeros(2, 3, dtype=torch.bool), mode, normalizer=3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(per_token.grad).all()


def test_aggregation_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"'mean'.*'seq-mean-token-mean'"):
        aggregate(PER_TOKEN, ROWS_MASK, "mean")
    with pytest.raises(ValueError, match=r"normalizer.*None"):
        aggregate(PER_TOKEN, ROWS_MASK, "seq-mean-token-sum-norm")


def _token_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ratios 1.5, 0.5, 1.1, 0.7 then a masked tool token with ratio 3."""
    old_logprobs = torch.zeros(1, 5)
    logprobs = torch.log(tensor([[1.5, 0.5, 1.1, 0.7, 3.0]])).requires_grad_()
    advantages = tensor([[1.0, -1.0, 1.0, -1.0, 5.0]])
    return logprobs, old_logprobs, advantages, mask([[1, 1, 1, 1, 0]])


def test_ppo_clip_with_asymmetric_bounds() -> None:
    logprobs, old_logprobs, advantages, loss_mask = _token_batch()
    loss, metrics = policy_loss(
        logprobs, old_logprobs, advantages, loss_mask, clip_low=0.2, clip_high=0.28
    )
    # max(-A * r, -A * clip(r, 0.8, 1.28)) per token:
    # 1.5, A=+1 -> -1.28 (clipped); 0.5, A=-1 -> 0.8 (clipped); 1.1, A=+1 -> -1.1;
    # 0.7, A=-1 -> 0.8 (clipped). The tool token adds nothing.
    assert_close(loss, torch.tensor((-1.28 + 0.8 - 1.1 + 0.8) / 4))
    assert_close(metrics["clip_fraction"], torch.tensor(3 / 4))
    assert_close(metrics["dual_clip_fraction"], torch.tensor(0.0))
    log_ratios = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)]
    assert_close(metrics["approx_kl"], torch.tensor(sum(0.5 * x**2 for x in log_ratios) / 4))
    loss.backward()
    # Only the unclipped token has a gradient: d(-A * exp(lp)) / d lp = -A * r, over 4 tokens.
    assert_close(logprobs.grad, tensor([[0.0, 0.0, -1.1 / 4, 0.0, 0.0]]))


@pytest.mark.parametrize(("clip_high", "expected"), [(0.2, -1.2), (0.28, -1.25)])
def test_clip_higher_lets_a_positive_advantage_ratio_grow(
    clip_high: float, expected: float
) -> None:
    logprobs = torch.log(tensor([[1.25]]))
    loss, _ = policy_loss(
        logprobs, torch.zeros(1, 1), tensor([[1.0]]), mask([[1]]), clip_high=clip_high
    )
    assert_close(loss, torch.tensor(expected))


def test_dual_clip_caps_the_loss_of_a_negative_advantage() -> None:
    # Ratios 5 and 0.1 with A = -1, ratio 5 with A = +1.
    logprobs = torch.log(tensor([[5.0, 0.1, 5.0]])).requires_grad_()
    advantages = tensor([[-1.0, -1.0, 1.0]])
    args = (logprobs, torch.zeros(1, 3), advantages, mask([[1, 1, 1]]))
    plain, _ = policy_loss(*args)
    # Without dual clip: max(5, 1.2) = 5; max(0.1, 0.8) = 0.8; max(-5, -1.2) = -1.2.
    assert_close(plain, torch.tensor((5.0 + 0.8 - 1.2) / 3))
    loss, metrics = policy_loss(*args, dual_clip=3.0)
    # Dual clip caps the first at 3 * -A = 3; 0.8 < 3 stays; positive advantages are untouched.
    assert_close(loss, torch.tensor((3.0 + 0.8 - 1.2) / 3))
    assert_close(metrics["dual_clip_fraction"], torch.tensor(1 / 3))
    loss.backward()
    assert_close(logprobs.grad, torch.zeros(1, 3))  # every token sits on a constant branch


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match=r"dual_clip.*0\.9"):
        policy_loss(*_token_batch(), dual_clip=0.9)


def test_gspo_ratio_is_the_per_sequence_geometric_mean() -> None:
    old_logprobs = torch.zeros(1, 4)
    token_ratios = [1.3, 0.9, 50.0, 1.1]  # the third is a tool token, outside the mean
    logprobs = torch.log(tensor([token_ratios])).requires_grad_()
    loss, _ = policy_loss(
        logprobs, old_logprobs, torch.ones(1, 4), mask([[1, 1, 0, 1]]),
        clip_high=1.0, ratio_level="sequence",
    )  # fmt: skip
    geometric_mean = (1.3 * 0.9 * 1.1) ** (1 / 3)
    assert_close(loss, torch.tensor(-geometric_mean))
    loss.backward()
    # Straight-through: every model token's gradient is -A * s / (3 tokens).
    g = -geometric_mean / 3
    assert_close(logprobs.grad, tensor([[g, g, 0.0, g]]))


def test_gspo_clips_whole_sequences() -> None:
    # Row 0: log ratios 0.1, -0.3, (tool 5.0), 0.5 -> mean 0.1; row 1: 0.2, -0.6 -> mean -0.2.
    # Row 2: log ratios 0.6, 0.6 -> s = e^0.6 = 1.82 > 1.2, clipped.
    log_ratios = tensor([[0.1, -0.3, 5.0, 0.5], [0.2, -0.6, 0.0, 0.0], [0.6, 0.6, 0.0, 0.0]])
    loss_mask = mask([[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    advantages = tensor([[1.0] * 4, [-1.0] * 4, [1.0] * 4])
    loss, metrics = policy_loss(
        log_ratios, torch.zeros(3, 4), advantages, loss_mask,
        ratio_level="sequence", aggregation="seq-mean-token-mean",
    )  # fmt: skip
    # Row 0: -e^0.1 (inside [0.8, 1.2]); row 1: max(e^-0.2, 0.8) = e^-0.2; row 2: -1.2.
    assert_close(loss, torch.tensor((-math.exp(0.1) + math.exp(-0.2) - 1.2) / 3))
    assert_close(metrics["clip_fraction"], torch.tensor(2 / 7))  # row 2's 2 of 7 model tokens


def test_importance_weights_scale_the_per_token_loss() -> None:
    logprobs, old_logprobs, advantages, loss_mask = _token_batch()
    weights = tensor([[2.0, 1.0, 0.5, 1.0, 100.0]])
    loss, _ = policy_loss(
        logprobs, old_logprobs, advantages, loss_mask, clip_high=0.28, importance_weights=weights
    )
    assert_close(loss, torch.tensor((2 * -1.28 + 0.8 + 0.5 * -1.1 + 0.8) / 4))


def test_policy_loss_rejects_unknown_ratio_level() -> None:
    with pytest.raises(ValueError, match=r"'segment'.*'sequence', 'token'"):
        policy_loss(*_token_batch(), ratio_level="segment")


def test_policy_loss_on_an_empty_mask_is_zero_with_finite_gradient() -> None:
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for ratio_level in ("token", "sequence"):
        loss, metrics = policy_loss(
            logprobs, torch.zeros(2, 3), torch.ones(2, 3), empty, ratio_level=ratio_level
        )
        loss.backward()
        assert loss.item() == 0.0
        assert all(value.item() == 0.0 for value in metrics.values())
        assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize(
    ("clip_range", "expected", "expected_grad", "clip_fraction"),
    [
        # Unclipped: 0.5 * mean((1 - 2)^2, (2 - 1)^2); gradient (V - R) / 2 tokens.
        (None, 0.5 * (1.0 + 1.0) / 2, [-0.5, 0.5, 0.0], 0.0),
        # Clipped values 0.8 + 0.1 = 0.9 and 2.5 - 0.1 = 2.4: max(1, 1.21), max(1, 1.96).
        # Both maxima are on the clipped branch, which is constant in V: no gradient.
        (0.1, 0.5 * (1.21 + 1.96) / 2, [0.0, 0.0, 0.0], 1.0),
        # Clip range 0.3: token 1 moved 0.2 and is not clipped (a tie is no clip); token 2
        # is clipped to 2.5 - 0.3 = 2.2, (2.2 - 1)^2 = 1.44 > 1.
        (0.3, 0.5 * (1.0 + 1.44) / 2, [-0.5, 0.0, 0.0], 0.5),
        # Clip range 2 clips nothing: back to the plain loss.
        (2.0, 0.5 * (1.0 + 1.0) / 2, [-0.5, 0.5, 0.0], 0.0),
    ],
)
def test_value_loss(
    clip_range: float | None, expected: float, expected_grad: list, clip_fraction: float
) -> None:
    values = tensor([[1.0, 2.0, 50.0]]).requires_grad_()  # third: a tool token
    loss, metrics = value_loss(
        values, tensor([[0.8, 2.5, 0.0]]), tensor([[2.0, 1.0, 0.0]]), mask([[1, 1, 0]]),
        clip_range=clip_range, aggregation="token-mean",
    )  # fmt: skip
    assert_close(loss, torch.tensor(expected))
    assert metrics["clip_fraction"].item() == clip_fraction
    loss.backward()
    assert_close(values.grad, tensor([expected_grad]))


def test_value_loss_aggregates_like_the_policy_loss() -> None:
    # Row 0: squared errors 1, 4 on two tokens; row 1: 9 on one token (the rest is a tool token).
    values, returns = tensor([[1.0, 2.0, 0.0], [3.0, 7.0, 0.0]]), tensor([[0.0, 0.0, 0.0]] * 2)
    loss_mask = mask([[1, 1, 0], [1, 0, 0]])

    def loss(aggregation: str) -> float:
        result, _ = value_loss(
            values, values, returns, loss_mask, clip_range=None, aggregation=aggregation,
            normalizer=4,
        )  # fmt: skip
        return result.item()

    assert loss("token-mean") == pytest.approx(0.5 * (1 + 4 + 9) / 3)
    assert loss("seq-mean-token-mean") == pytest.approx(0.5 * ((1 + 4) / 2 + 9) / 2)
    assert loss("seq-mean-token-sum-norm") == pytest.approx(0.5 * (1 + 4 + 9) / (2 * 4))


def test_explained_variance() -> None:
    returns = tensor([[1.0, 3.0, 99.0], [2.0, 6.0, 99.0]])  # the 99s are off the mask
    loss_mask = mask([[1, 1, 0], [1, 1, 0]])
    # Returns 1, 3, 2, 6: mean 3, population variance (4 + 0 + 1 + 9) / 4 = 3.5.
    assert explained_variance(returns, returns, loss_mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 3.0), returns, loss_mask) == 0.0
    # Errors 1, -1, 1, -1 (mean 0): variance 1.
    values = returns - tensor([[1.0, -1.0, 0.0], [1.0, -1.0, 0.0]])
    assert explained_variance(values, returns, loss_mask) == pytest.approx(1 - 1 / 3.5)
    assert explained_variance(values, torch.ones_like(returns), loss_mask) is None
    assert explained_variance(values, returns, torch.zeros_like(loss_mask)) is None


def test_logprob_mismatch() -> None:
    rollout, trainer = tensor([[-1.0, -2.0, -0.5]]), tensor([[-1.5, -1.0, -9.0]])
    stats = logprob_mismatch(rollout, trainer, mask([[1, 1, 0]]))
    # rollout - trainer = 0.5, -1.0 on model tokens; the masked 8.5 is not seen.
    assert stats == pytest.approx(
        {
            "mean_abs_diff": 0.75,
            "max_abs_diff": 1.0,
            "kl_k1": (0.5 - 1.0) / 2,
            "kl_k3": ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2,
        }
    )
    empty = logprob_mismatch(rollout, trainer, mask([[0, 0, 0]]))
    assert empty == {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "kl_k1": 0.0, "kl_k3": 0.0}


# Row 0: w = e^0.5 = 1.65 (over the cap 1.5), e^-0.5, then a tool token (its 8.0 unseen).
# Row 1: w = 1, e^0.25 = 1.28, both under the cap; its last position is padding.
OLD_LOGPROBS = tensor([[-1.0, -1.0, 7.0], [-1.0, -1.0, 0.0]])
ROLLOUT_LOGPROBS = tensor([[-1.5, -0.5, -1.0], [-1.0, -1.25, 0.0]])
MODEL_TOKENS = mask([[1, 1, 0], [1, 1, 0]])
E = math.exp


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("truncate", [[1.5, E(-0.5), 1.0], [1.0, E(0.25), 1.0]]),  # capped at 1.5
        ("mask", [[0.0, E(-0.5), 1.0], [1.0, E(0.25), 1.0]]),  # the token over the cap is 0
        ("reject", [[0.0, 0.0, 1.0], [1.0, E(0.25), 1.0]]),  # its whole row is 0
    ],
)
def test_behaviour_importance_weights(mode: str, expected: list) -> None:
    weights = behaviour_importance_weights(
        OLD_LOGPROBS, ROLLOUT_LOGPROBS, MODEL_TOKENS, mode=mode, cap=1.5
    )
    assert_close(weights, tensor(expected))  # 1 off the mask in every mode


def test_behaviour_importance_weights_off_is_no_weights() -> None:
    # "none" is the ablation: `policy_loss` reads None as no weights at all.
    off = behaviour_importance_weights(
        OLD_LOGPROBS, ROLLOUT_LOGPROBS, MODEL_TOKENS, mode="none", cap=1
    )
    assert off is None


def test_behaviour_importance_weights_carry_no_gradient() -> None:
    old = OLD_LOGPROBS.clone().requires_grad_()
    weights = behaviour_importance_weights(
        old, ROLLOUT_LOGPROBS, MODEL_TOKENS, mode="truncate", cap=1.5
    )
    assert not weights.requires_grad


@pytest.mark.parametrize(
    ("mode", "cap", "message"),
    [
        ("clip", 1.5, r"'clip'.*\['mask', 'none', 'reject', 'truncate'\]"),
        ("mask", 0.0, r"cap.*0\.0"),
    ],
)
def test_behaviour_importance_weights_refuse_bad_settings(mode: str, cap: float, message: str):
    with pytest.raises(ValueError, match=message):
        behaviour_importance_weights(
            OLD_LOGPROBS, ROLLOUT_LOGPROBS, MODEL_TOKENS, mode=mode, cap=cap
        )


def test_importance_weight_metrics_are_of_the_raw_weights() -> None:
    stats = importance_weight_metrics(OLD_LOGPROBS, ROLLOUT_LOGPROBS, MODEL_TOKENS, cap=1.5)
    assert stats == pytest.approx(
        {
            "weight_mean": (E(0.5) + E(-0.5) + 1.0 + E(0.25)) / 4,
            "weight_max": E(0.5),  # not the tool token's e^8
            "capped_fraction": 1 / 4,
        }
    )
    empty = importance_weight_metrics(OLD_LOGPROBS, ROLLOUT_LOGPROBS, ~mask([[1] * 3] * 2), cap=1)
    assert empty == {"weight_mean": 0.0, "weight_max": 0.0, "capped_fraction": 0.0}
