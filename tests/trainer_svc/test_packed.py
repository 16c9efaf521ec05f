"""Packed micro-batches (`optim.pack_sequences`): a micro-batch's rows forwarded as one sequence
without padding give the padded forward's logprobs, entropies, values, gradients and step
metrics to 1e-5, on rows of heavy-tailed lengths, as a policy, a critic and in SFT; the
packing plan fills micro-batches by tokens, not rows x the longest."""

import pytest
import torch
from transformers import AutoTokenizer

from tests.trainer_svc.fsdp_worker import SETTINGS, token_mean_loss
from trainer_svc.batch import Batch, packed_micro_batch_rows
from trainer_svc.config import DataConfig, SftConfig, TrainSettings
from trainer_svc.critic import FsdpCritic
from trainer_svc.data import load_conversations
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.sft import sft_in_process, tokenize_conversations


def heavy_tailed_batch() -> Batch:
    """Nine rows: one of 60 tokens, the rest 2 to 12 (vocabulary 256); the loss covers each
    row's tail."""
    generator = torch.Generator().manual_seed(3)
    lengths = [60, 2, 7, 12, 3, 9, 5, 11, 4]
    token_ids = [torch.randint(256, (n,), generator=generator).tolist() for n in lengths]
    loss_masks = [[i >= n // 2 for i in range(n)] for n in lengths]
    advantages = [[float(torch.randn(1, generator=generator))] * n for n in lengths]
    return Batch.from_sequences(token_ids, loss_masks, {"advantages": advantages}, pad_token_id=0)


def settings(packed: bool):
    # No shared-prefix forward: the batch has no groups anyway; a budget of several rows.
    return SETTINGS.model_copy(update={"pack_sequences": packed, "micro_batch_tokens": 64})


def forwards(policy: FsdpPolicy, batch: Batch) -> int:
    """How many forwards the policy's logprobs of `batch` take."""
    calls = []
    hook = policy.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    policy.logprobs(batch)
    hook.remove()
    return len(calls)


def test_packed_micro_batches_fill_by_tokens():
    assert packed_micro_batch_rows([60, 2, 7, 12, 3], 64) == [[0, 4], [3, 2, 1]]
    assert packed_micro_batch_rows([70, 5], 64) == [[0], [1]]  # too long: alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_policy_equals_the_padded_one(model_dir, dtype):
    batch = heavy_tailed_batch()
    padded = FsdpPolicy(model_dir, settings(False).model_copy(update={"dtype": dtype}))
    packed = FsdpPolicy(model_dir, settings(True).model_copy(update={"dtype": dtype}))
    tolerance = 1e-5 if dtype == "float32" else 2e-2  # bf16 rounds each matmul
    for with_entropy in (False, True):
        expected = padded.logprobs(batch, with_entropy=with_entropy)
        got = packed.logprobs(batch, with_entropy=with_entropy)
        for left, right in zip(got, expected, strict=True):
            if right is not None:
                torch.testing.assert_close(left, right, atol=tolerance, rtol=0)
    assert packed.logprobs(batch)[0][:, 0].eq(0).all()  # a row's first token: no prefix
    assert forwards(packed, batch) == 2 and forwards(padded, batch) == 3  # 60 + 4, the rest
    padded_metrics = padded.train_step(batch, token_mean_loss)
    packed_metrics = packed.train_step(batch, token_mean_loss)
    assert packed_metrics == pytest.approx(padded_metrics, abs=tolerance)
    weights = packed.full_state_dict()
    for name, tensor in padded.full_state_dict().items():
        torch.testing.assert_close(weights[name], tensor, atol=tolerance, rtol=0)


def test_a_packed_critic_equals_the_padded_one(model_dir):
    batch = heavy_tailed_batch()
    batch.extras["returns"] = batch.extras["advantages"]
    padded, packed = FsdpCritic(model_dir, settings(False)), FsdpCritic(model_dir, settings(True))

    def value_loss(micro: Batch, values: torch.Tensor):
        error = (values - micro.extras["returns"]) ** 2 * micro.loss_mask
        return error.sum() / micro.global_token_count, {}

    for critic in (padded, packed):  # a step moves the head off zero
        critic.train_step(batch, value_loss)
    expected = padded.values(batch)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(packed.values(batch), expected, atol=1e-5, rtol=0)


def test_packed_sft_takes_the_padded_steps(tiny_model_dir):
    """SFT on calculator conversations of the tiny model: each step's loss and gradient norm
    packed as padded, and the weights after them."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = DataConfig(generated_train_size=8, generated_eval_size=1)
    train, _ = load_conversations(data, seed=0)
    examples = tokenize_conversations(tokenizer, train, max_length=512)
    results = {}
    for packed in (False, True):
        steps = []
        models = sft_in_process(
            tiny_model_dir,
            examples,
            tokenizer.pad_token_id,
            sft=SftConfig(conversations_per_step=4),
            optim=TrainSettings(learning_rate=1e-3, pack_sequences=packed),
            steps=2,
            seed=0,
            on_step=lambda step, total, metrics, steps=steps: steps.append(metrics),
        )
        results[packed] = steps, models.policy.full_state_dict()
    (padded_steps, padded_weights), (packed_steps, packed_weights) = results.values()
    for padded, packed in zip(padded_steps, packed_steps, strict=True):
        assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
        assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], abs=1e-4)
    # Adam moves a weight by about lr x sign(gradient): where a gradient is near zero, float
    # noise moves it by up to a few % of lr (1e-3).
    for name, tensor in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], tensor, atol=1e-4, rtol=0)
