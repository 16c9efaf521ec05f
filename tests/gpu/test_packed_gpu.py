"""Packed micro-batches on a GPU (`optim.pack_sequences`, one rank, no engine needed): the
rows forwarded as one sequence through transformers' block-diagonal mask under CUDA's sdpa
kernels give the padded forward's logprobs and step metrics, in fp32 and under bf16
autocast."""

import pytest
import torch

from tests.gpu.test_fsdp_gpu import GPU_SETTINGS
from tests.trainer_svc.fsdp_worker import token_mean_loss
from tests.trainer_svc.test_packed import heavy_tailed_batch
from trainer_svc.fsdp import FsdpPolicy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_packed_rows_on_the_gpu_give_the_padded_logprobs(cuda, gpu_model_dir, dtype, tolerance):
    batch = heavy_tailed_batch()
    settings = GPU_SETTINGS.model_copy(update={"dtype": dtype, "micro_batch_tokens": 64})
    padded = FsdpPolicy(gpu_model_dir, settings)
    packed = FsdpPolicy(gpu_model_dir, settings.model_copy(update={"pack_sequences": True}))
    assert packed.device.type == "cuda" and packed.packs(batch)
    expected, _ = padded.logprobs(batch)
    got, _ = packed.logprobs(batch)
    print(f"{dtype}: packed vs padded logprobs, max |diff| {(got - expected).abs().max():.2e}")
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
    padded_metrics = padded.train_step(batch, token_mean_loss)
    packed_metrics = packed.train_step(batch, token_mean_loss)
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], abs=tolerance)
