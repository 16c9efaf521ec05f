"""The trainer's policy on a GPU (the FSDP2 back end's model on CUDA, one rank): its logprobs
are a CPU forward pass's, and its steps train."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, token_mean_loss
from trainer_svc.fsdp import FsdpPolicy

pytestmark = pytest.mark.gpu


def test_logprobs_on_the_gpu_are_the_cpus_and_steps_train(cuda, gpu_model_dir):
    policy = FsdpPolicy(gpu_model_dir, SETTINGS.model_copy(update={"micro_batch_tokens": 4096}))
    assert policy.device.type == "cuda"
    batch = fixed_batch()
    logprobs, _ = policy.logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32)
    with torch.no_grad():
        log_probs = model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    expected = log_probs[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(logprobs.cpu()[:, 1:][mask], expected[mask], atol=1e-3, rtol=0)
    losses = [policy.train_step(batch, token_mean_loss)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses
