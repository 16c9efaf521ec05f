"""The trainer's policy on a GPU (the FSDP2 back end's model on CUDA, one rank; no engine
needed): its logprobs are a CPU forward pass's and its steps train; a bf16 step runs under
autocast and keeps fp32 weights; and its weights reach an hf replica on a GPU over the
weight-sync group, from the trainer's own GPU over NCCL with two GPUs, over gloo with one."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout_svc.test_rollout_service import rollout_server
from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, token_mean_loss
from tests.trainer_svc.test_weight_push import (
    BUCKET_SIZE_BYTES,
    DEAD_ADDRESS,
    assert_sampled_by,
    load,
    sample,
)
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.weight_push import WeightPusher

pytestmark = pytest.mark.gpu

GPU_SETTINGS = SETTINGS.model_copy(update={"micro_batch_tokens": 4096})
# bf16 matmuls against fp32 ones: per-token logprobs agree to this on average (0.02 on the
# tiny model).
BF16_MEAN_ABS_TOLERANCE = 0.1


def test_logprobs_on_the_gpu_are_the_cpus_and_steps_train(cuda, gpu_model_dir):
    policy = FsdpPolicy(gpu_model_dir, GPU_SETTINGS)
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


def test_a_bf16_step_runs_under_autocast_and_keeps_fp32_weights(cuda, gpu_model_dir):
    """Autocast on CUDA: logprobs near fp32's but not equal to them (the matmuls really ran in
    bf16), losses that fall, and fp32 master weights that stay finite."""
    batch = fixed_batch()
    exact, _ = FsdpPolicy(gpu_model_dir, GPU_SETTINGS).logprobs(batch)
    policy = FsdpPolicy(gpu_model_dir, GPU_SETTINGS.model_copy(update={"dtype": "bfloat16"}))
    rounded, _ = policy.logprobs(batch)
    mask = batch.attention_mask.bool()
    mask[:, 0] = False  # column 0 has no logprob
    diff = (rounded - exact)[mask.to(rounded.device)].abs()
    print(f"bf16 autocast vs fp32 logprobs: mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")
    assert rounded.dtype == torch.float32
    assert diff.max() > 0 and diff.mean() < BF16_MEAN_ABS_TOLERANCE
    losses = [policy.train_step(batch, token_mean_loss)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses
    for name, parameter in policy.model.named_parameters():
        assert parameter.dtype == torch.float32, name
        assert torch.isfinite(parameter).all(), name


async def test_trained_weights_reach_an_hf_replica_on_a_gpu(
    cuda, gpu_model_dir, weight_sync_backend
):
    """The policy trains on cuda:0, the replica runs on the last GPU in fp32; the replica then
    samples with the trained weights (its logprobs are theirs, not the original model's)."""
    policy = FsdpPolicy(gpu_model_dir, GPU_SETTINGS)
    for _ in range(3):
        policy.train_step(fixed_batch(), token_mean_loss)
    trained = load(gpu_model_dir)
    trained.load_state_dict(policy.full_state_dict())
    weights = policy.full_weights(BUCKET_SIZE_BYTES)
    replica = {"device": f"cuda:{torch.cuda.device_count() - 1}", "dtype": "float32"}
    async with rollout_server(
        gpu_model_dir, DEAD_ADDRESS, DEAD_ADDRESS, engine_options=replica
    ) as stub:
        pusher = await WeightPusher.connect(
            [stub], backend=weight_sync_backend, timeout_seconds=120
        )
        try:
            assert pusher.mode == "broadcast"  # else the push would go over gRPC
            result = await pusher.push(weights, 1)
        finally:
            pusher.close()
        trajectories = await sample(stub)
    print(f"push over {weight_sync_backend}: {result.gib_per_second:.2f} GiB/s")
    assert result.policy_versions == [1]
    assert_sampled_by(trajectories, trained, load(gpu_model_dir), policy_version=1)
