"""Weight pushes into the rollout service's own engine (hf), over gRPC and real gloo groups
whose rank 0 is a `weight_sender` process standing in for the trainer: a push that breaks off
part-way leaves the engine refusing to generate, with the reason in GetStats, until a complete
push."""

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.rollout_svc import weight_sender
from tests.rollout_svc.test_rollout_service import generate, prompts, rollout_stack
from turnrl.config import REPO_ROOT
from turnrl.errors import FailedPreconditionError
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from turnrl.weights import TensorMeta

Finish = common_pb2.FinishReason
BROKEN = "weights incomplete after a broken push to version 1"
BUCKET_SIZE_BYTES = 64 * 1024  # some twenty buckets of the tiny model


def parameter_specs(model_dir: Path) -> list[str]:
    """Every tensor of the model's checkpoint as a weight_sender spec, NAME:DTYPE:D0xD1."""
    specs = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 - a safe_open handle is no dict
                shape = checkpoint.get_slice(name).get_shape()
                specs.append(f"{name}:float32:{'x'.join(str(size) for size in shape)}")
    return specs


def update_request(group: str, specs: list[str], version: int) -> rollout_pb2.UpdateWeightsRequest:
    tensors = weight_sender.sent_tensors(specs)
    return rollout_pb2.UpdateWeightsRequest(
        group_name=group,
        tensors=[
            TensorMeta(name, t.dtype, tuple(t.shape)).to_proto() for name, t in tensors.items()
        ],
        bucket_size_bytes=BUCKET_SIZE_BYTES,
        policy_version=version,
        layout=rollout_pb2.WEIGHT_LAYOUT_ALIGNED_BUCKETS,
    )


@contextlib.asynccontextmanager
async def joined(
    stub: rollout_pb2_grpc.RolloutServiceStub,
    group: str,
    specs: list[str],
    die_after_buckets: int | None = None,
) -> AsyncIterator[None]:
    """The service in a gloo group with a trainer's rank 0 that broadcasts one update of
    `specs` (or dies after `die_after_buckets` buckets); checks the sender's exit."""
    command = weight_sender.command(
        group, specs, layout="aligned_buckets", bucket_size=BUCKET_SIZE_BYTES,
        die_after_buckets=die_after_buckets,
    )  # fmt: skip
    sender = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        port = int(await sender.stdout.readline())
        request = rollout_pb2.InitWeightSyncRequest(
            master_address="127.0.0.1", master_port=port, world_size=2, rank_offset=1,
            backend=rollout_pb2.InitWeightSyncRequest.BACKEND_GLOO, group_name=group,
        )  # fmt: skip
        await stub.InitWeightSync(request, timeout=60)
        yield
        async with asyncio.timeout(60):
            expected = 0 if die_after_buckets is None else weight_sender.DIED
            assert await sender.wait() == expected
    finally:
        if sender.returncode is None:
            sender.kill()
            await sender.wait()


async def test_a_broken_push_refuses_generate_until_a_complete_push(tiny_model_dir):
    specs = parameter_specs(tiny_model_dir)
    run = rollout_pb2.GenerateRequest(
        prompts=prompts(2), n=1, sampling=common_pb2.SamplingParams(temperature=0.0),
        limits=common_pb2.LengthLimits(max_new_tokens=8),
    )  # fmt: skip
    stats = rollout_pb2.GetStatsRequest()
    async with rollout_stack(tiny_model_dir) as stub:
        # Paused as the trainer pauses for a push: these two wait in the engine meanwhile.
        await stub.Pause(rollout_pb2.PauseRequest(), timeout=10)
        in_flight = stub.Generate(run, timeout=300)
        async with asyncio.timeout(60):
            while (await stub.GetStats(stats, timeout=10)).metrics["waiting"] < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # The trainer dies after the first bucket has landed in the engine's parameters.
        async with joined(stub, "broken", specs, die_after_buckets=1):
            with pytest.raises(FailedPreconditionError) as broke:
                await stub.UpdateWeights(update_request("broken", specs, 1), timeout=60)
        assert "broke off after 1 of" in broke.value.details
        paused = await stub.GetStats(stats, timeout=10)
        assert (paused.policy_version, paused.metrics["weights_incomplete"]) == (0, 1.0)
        await stub.Resume(rollout_pb2.ResumeRequest(), timeout=10)
        resumed = await stub.GetStats(stats, timeout=10)
        assert BROKEN in resumed.weights_incomplete_reason
        # The trajectories in flight end as the system's failure, not the model's.
        failed = [reply.trajectory async for reply in in_flight]
        assert [t.finish_reason for t in failed] == [Finish.FINISH_REASON_ERROR] * 2
        assert all(BROKEN in t.error_message for t in failed)
        with pytest.raises(FailedPreconditionError) as refused:
            await generate(stub, run)
        assert BROKEN in refused.value.details and "push again" in refused.value.details

        async with joined(stub, "whole", specs):
            reply = await stub.UpdateWeights(update_request("whole", specs, 1), timeout=60)
        assert reply.policy_version == 1
        after_push = await stub.GetStats(stats, timeout=10)
        assert (after_push.weights_incomplete_reason, after_push.policy_version) == ("", 1)
        assert after_push.metrics["weights_incomplete"] == 0.0
        trajectories = await generate(stub, run)
    assert len(trajectories) == 2
    for trajectory in trajectories:
        assert trajectory.finish_reason != Finish.FINISH_REASON_ERROR, trajectory.error_message
        model = [s for s in trajectory.segments if s.source == common_pb2.SEGMENT_SOURCE_MODEL]
        assert model and {segment.policy_version for segment in model} == {1}
