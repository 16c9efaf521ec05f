"""The trainer's weight push into a rollout service on a real engine server on a GPU (SGLang,
vLLM; launched by the engine on the last GPU): the server joins the group (NCCL with two GPUs
or more, gloo with one) and samples from the pushed weights afterwards."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.gpu.conftest import reference_logprobs, sglang_options, vllm_options
from tests.rollout_svc.test_rollout_service import rollout_server
from tests.trainer_svc.test_weight_push import DEAD_ADDRESS, sample
from trainer_svc.weight_push import WeightPusher
from turnrl.v1 import rollout_pb2
from turnrl.weights import BucketedWeights

pytestmark = pytest.mark.gpu

ENGINE_OPTIONS = {"sglang": sglang_options, "vllm": vllm_options}


@pytest.fixture(params=sorted(ENGINE_OPTIONS))
def engine(request) -> tuple[str, dict]:
    """An engine's name and its `engine_options`, launched from its interpreter."""
    python = request.getfixturevalue(f"{request.param}_python")
    options = ENGINE_OPTIONS[request.param](python)
    return request.param, options.model_dump(mode="json", exclude_none=True)


async def test_a_push_through_the_service_changes_what_the_server_samples(
    engine, gpu_model_dir, max_model_len, reference, tokenizer, weight_sync_backend
):
    engine_name, options = engine
    perturbed = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter) * 0.02)
    weights = BucketedWeights.pack(perturbed.state_dict().items(), 256 << 20)
    async with rollout_server(
        gpu_model_dir, DEAD_ADDRESS, DEAD_ADDRESS, engine=engine_name, engine_options=options,
        max_model_len=max_model_len,
    ) as stub:  # fmt: skip
        pusher = await WeightPusher.connect(
            [stub], backend=weight_sync_backend, timeout_seconds=120
        )
        try:
            result = await pusher.push(weights, 1)
        finally:
            pusher.close()
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=30)
        trajectories = await sample(stub)
    assert (result.mode, result.policy_versions, stats.policy_version) == ("broadcast", [1], 1)
    pushed = perturbed.to(next(reference.parameters()).device).eval()
    to_pushed, to_original = [], []
    for trajectory in trajectories:
        token_ids = [t for segment in trajectory.segments for t in segment.token_ids]
        first = len(trajectory.segments[0].token_ids)  # the prompt's
        sampled = [lp for s in trajectory.segments[1:] for lp in s.logprobs]
        for model, diffs in ((pushed, to_pushed), (reference, to_original)):
            expected = reference_logprobs(model, token_ids[:first], token_ids[first:])
            diffs += (torch.tensor(sampled) - expected).abs().tolist()
    mean_pushed = sum(to_pushed) / len(to_pushed)
    mean_original = sum(to_original) / len(to_original)
    print(f"after the push: to the pushed model {mean_pushed:.4f}, to the old {mean_original:.4f}")
    assert mean_pushed <= 0.05 and mean_original > 2 * mean_pushed
    print(f"push of {weights.nbytes / 2**20:.0f} MiB to {engine_name} over "
          f"{weight_sync_backend}: {result.seconds:.2f} s, {result.gib_per_second:.2f} GiB/s")  # fmt: skip
