"""The rollout service's Prometheus endpoint, scraped from a real `turnrl serve rollout` process
on the tiny model (hf engine), its tool and reward services on loopback."""

import json

import torch

from tests.conftest import scrape_metrics, serve_subprocess
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.test_rollout_service import generate, prompts
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

Source = common_pb2.SegmentSource


def norm_push(model_dir) -> list[rollout_pb2.PushWeightsRequest]:
    """A push of one tensor, the final norm's weight, as ones."""
    hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    spec = rollout_pb2.TensorSpec(
        name="model.norm.weight", dtype=rollout_pb2.TensorSpec.D_TYPE_FLOAT32, shape=[hidden_size]
    )
    data = torch.ones(hidden_size, dtype=torch.float32).numpy().tobytes()
    return [
        rollout_pb2.PushWeightsRequest(
            header=rollout_pb2.PushWeightsHeader(tensors=[spec], policy_version=1)
        ),
        rollout_pb2.PushWeightsRequest(chunk=rollout_pb2.TensorChunk(tensor_index=0, data=data)),
    ]


async def test_metrics_count_tokens_trajectories_and_weight_pushes(tiny_model_dir):
    async with (
        tool_service_address() as tools,
        reward_service_address() as rewards,
        serve_subprocess(
            "rollout",
            f"rollout.model_path={tiny_model_dir}",
            f"rollout.tool_service.address={tools}",
            f"rollout.reward_service.address={rewards}",
            "rollout.server.metrics_port=0",
        ) as served,
    ):
        assert served.metrics_url is not None
        before = await scrape_metrics(served.metrics_url)
        async with rpc.open_channel(ClientConfig(address=served.address)) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            request = rollout_pb2.GenerateRequest(
                prompts=prompts(1),
                n=2,
                sampling=common_pb2.SamplingParams(temperature=1.0, seed=3),
                limits=common_pb2.LengthLimits(max_new_tokens=16),
            )
            trajectories = await generate(stub, request)
            pushed = await stub.PushWeights(iter(norm_push(tiny_model_dir)), timeout=60)
        after = await scrape_metrics(served.metrics_url)
    hf = (("engine", "hf"),)
    assert before[("turnrl_rollout_generated_tokens_total", hf)] == 0
    generated = sum(
        len(s.token_ids)
        for t in trajectories
        for s in t.segments
        if s.source == Source.SEGMENT_SOURCE_MODEL
    )
    assert after[("turnrl_rollout_generated_tokens_total", hf)] >= generated > 0
    assert after[("turnrl_rollout_finished_trajectories_total", hf)] == 2
    assert after[("turnrl_rollout_running_trajectories", hf)] == 0
    assert after[("turnrl_rollout_requests_running", hf)] == 0
    assert after[("turnrl_rollout_requests_queued", hf)] == 0
    assert ("turnrl_rollout_kv_cache_bytes", hf) in after
    assert after[("turnrl_rollout_weight_pushes_total", hf)] == 1
    assert after[("turnrl_rollout_weight_push_bytes_total", hf)] == pushed.bytes_received > 0
    assert after[("turnrl_rollout_last_weight_push_stall_seconds", hf)] > 0
    assert after[("turnrl_rollout_policy_version", hf)] == 1
    assert after[("turnrl_rollout_engine_prefill_tokens", hf)] > 0
    assert after[("process_resident_memory_bytes", ())] > 0
