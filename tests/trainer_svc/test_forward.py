"""Forward passes that compute each group's shared prefix once equal one forward over whole rows."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer_svc.fsdp_worker import SETTINGS, grouped_batch, step_gradients, token_mean_loss
from trainer_svc.batch import shared_prefix_micro_batch_rows
from trainer_svc.forward import (
    entropy_from_logits,
    prefix_levels,
    prefix_units,
    shared_prefix_logprobs,
    token_logprobs,
    whole_row_logprobs,
)
from trainer_svc.fsdp import FsdpPolicy


def test_prefix_units_are_each_groups_common_prefix_and_leave_every_row_a_token():
    batch = grouped_batch()
    lengths = batch.attention_mask.sum(1)
    units = prefix_units(batch.input_ids, lengths, batch.groups)
    # The first group's samples share their opening two tokens as well as the 9-token prompt;
    # the one-row group keeps its last token for the second forward; the last group's rows
    # differ from their first token, so each is a unit of its own, of one token.
    assert units.lengths.tolist() == [6 + 9 + 2, 6 + 5, 6 + 12, 6 + 6 + 5 - 1, 1, 1]
    assert units.of_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 5]
    for row, unit in enumerate(units.of_row.tolist()):
        length = int(units.lengths[unit])
        first = int(units.rows[unit])
        assert torch.equal(batch.input_ids[row, :length], batch.input_ids[first, :length])
        assert length < int(lengths[row]) or length == 1


def test_prefix_levels_compute_the_shared_system_prompt_once():
    batch = grouped_batch()
    trunks, units, rows = prefix_levels(batch.input_ids, batch.attention_mask.sum(1), batch.groups)
    # The four groups with the system prompt share one trunk: its 6 tokens (the prompts
    # after it happen to differ from their first token on); each row of the last group is
    # a trunk of its first token.
    assert sorted(trunks.end.tolist()) == [1, 1, 6] and trunks.start.tolist() == [0, 0, 0]
    assert trunks.end[units.parent].tolist() == [6, 6, 6, 6, 1, 1]
    assert len(set(units.parent.tolist())) == 3
    assert units.start.tolist() == [6, 6, 6, 6, 1, 1]
    assert units.end.tolist() == [6 + 9 + 2, 6 + 5, 6 + 12, 6 + 6 + 5 - 1, 1, 1]
    assert rows.start.tolist() == [17, 17, 17, 11, 11, 11, 18, 18, 18, 16, 1, 1]
    assert torch.equal(rows.end, batch.attention_mask.sum(1))


def test_shared_prefix_logprobs_and_gradients_equal_a_whole_row_forward(model_dir):
    batch = grouped_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, forward in {
        "whole": lambda: whole_row_logprobs(model, batch.input_ids, batch.attention_mask, True),
        "shared": lambda: shared_prefix_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.groups, True
        ),
    }.items():
        model.zero_grad()
        logprobs, entropy = forward()
        ((logprobs + entropy) * weights).sum().backward()
        gradients = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = (logprobs.detach(), entropy.detach(), gradients)
    (whole_logprobs, whole_entropy, whole_gradients) = results["whole"]
    (shared_logprobs, shared_entropy, shared_gradients) = results["shared"]
    assert whole_logprobs.abs().sum() > 1
    torch.testing.assert_close(shared_logprobs, whole_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_entropy, whole_entropy, atol=1e-5, rtol=0)
    for name, gradient in whole_gradients.items():
        torch.testing.assert_close(shared_gradients[name], gradient, atol=1e-5, rtol=1e-4)


def forward_tokens(batch, rows: list[int]) -> int:
    """The tokens of the forwards of `rows` computed together, padding included."""
    lengths = batch.attention_mask.sum(1)[rows]
    levels = prefix_levels(batch.input_ids[rows], lengths, batch.groups[rows])
    return sum(
        len(level.end) * int((level.end - level.start).max().clamp(min=1)) for level in levels
    )


@pytest.mark.parametrize("max_tokens", [1, 30, 60, 4096])
def test_shared_prefix_micro_batches_hold_every_row_once_within_the_budget(max_tokens):
    batch = grouped_batch()
    lengths = batch.attention_mask.sum(1)
    micro_batches = shared_prefix_micro_batch_rows(
        prefix_levels(batch.input_ids, lengths, batch.groups), max_tokens
    )
    assert sorted(row for rows in micro_batches for row in rows) == list(range(len(lengths)))
    for rows in micro_batches:
        # The forwards' tokens of the micro-batch as it is computed, padding included.
        levels = prefix_levels(batch.input_ids[rows], lengths[rows], batch.groups[rows])
        cost = sum(
            len(level.end) * int((level.end - level.start).max().clamp(min=1)) for level in levels
        )
        # Over the budget only as a single row, which nothing can split.
        assert cost <= max_tokens or len(rows) == 1
    # A group whose rows fit the budget together is never split.
    for group in batch.groups.unique():
        rows = (batch.groups == group).nonzero().squeeze(1).tolist()
        levels = prefix_levels(batch.input_ids[rows], lengths[rows], batch.groups[rows])
        cost = sum(
            len(level.end) * int((level.end - level.start).max().clamp(min=1)) for level in levels
        )
        if cost <= max_tokens:
            assert sum(bool(set(rows) & set(micro)) for micro in micro_batches) == 1
    assert (len(micro_batches) == 1) == (max_tokens == 4096)


def test_policy_steps_on_groups_as_on_whole_rows(model_dir):
    batch = grouped_batch()
    shared = FsdpPolicy(model_dir, SETTINGS)
    whole = FsdpPolicy(model_dir, SETTINGS.model_copy(update={"shared_prefix_forward": False}))
    assert shared.shares_prefixes and not whole.shares_prefixes
    torch.testing.assert_close(
        shared.logprobs(batch)[0], whole.logprobs(batch)[0], atol=1e-5, rtol=0
    )
    shared_gradients, whole_gradients = step_gradients(shared), step_gradients(whole)
    shared_metrics = shared.train_step(batch, token_mean_loss)
    whole_metrics = whole.train_step(batch, token_mean_loss)
    for name, gradient in whole_gradients.items():
        torch.testing.assert_close(shared_gradients[name], gradient, atol=1e-6, rtol=1e-4)
    assert shared_metrics == pytest.approx(whole_metrics, abs=1e-5)


def test_token_entropy_is_exact_at_large_logits_and_matches_the_plain_formula():
    # Logits (1, 0, 0) shifted by 1e4 (exact in float32): p = (e, 1, 1) / (e + 2), so
    # H = ln(e + 2) - e / (e + 2); logsumexp(z) - sum p z loses ~1e-3 of it in float32.
    exact = math.log(math.e + 2) - math.e / (math.e + 2)
    logits = torch.tensor([[[1e4 + 1, 1e4, 1e4], [0.0, 0.0, 0.0]]]).requires_grad_()
    _, entropy = token_logprobs(logits, torch.tensor([[0, 0]]), with_entropy=True)
    torch.testing.assert_close(entropy, torch.tensor([[0.0, exact]]), atol=1e-6, rtol=0)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # Where the plain formula is precise, the two agree.
    moderate = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    plain = moderate.logsumexp(-1) - (moderate.softmax(-1) * moderate).sum(-1)
    torch.testing.assert_close(entropy_from_logits(moderate), plain, atol=1e-5, rtol=0)


def test_entropy_from_logits() -> None:
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25), -1e9]]
    )
    # Uniform over 4: ln 4. (1/2, 1/4, 1/4): 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2.
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([math.log(4), 1.5 * math.log(2)])
    )
    assert entropy_from_logits(torch.zeros(2, 3, 7)).shape == (2, 3)
