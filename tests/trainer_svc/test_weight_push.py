"""The trainer's weight push into real rollout servers (hf engine, tiny model) on loopback: a
gloo broadcast and the gRPC fallback, checked by the engine's logprobs after the push."""

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout_svc.test_rollout_service import generate, rollout_server, teacher_forced_logprobs
from trainer_svc.weight_push import WeightPusher, push_device
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from turnrl.weights import BucketedWeights

DEAD_ADDRESS = "127.0.0.1:1"  # nothing listens; weight pushes call no tool or reward service
MODES = ["broadcast", "grpc"]
BUCKET_SIZE_BYTES = 1 << 20


@contextlib.asynccontextmanager
async def replicas(model_dir, count: int) -> AsyncIterator[list]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(rollout_server(model_dir, DEAD_ADDRESS, DEAD_ADDRESS))
            for _ in range(count)
        ]


@contextlib.asynccontextmanager
async def connected(stubs, mode: str) -> AsyncIterator[WeightPusher]:
    pusher = await WeightPusher.connect(stubs, mode=mode, timeout_seconds=30)
    try:
        assert pusher.mode == mode
        yield pusher
    finally:
        pusher.close()


def load(model_dir, noise_seed: int | None = None):
    """The model in fp32; with `noise_seed`, every weight moved by seeded noise."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if noise_seed is not None:
        generator = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def packed(
    tensors: dict[str, torch.Tensor],
    bucket_size_bytes: int = BUCKET_SIZE_BYTES,
    dtype: torch.dtype | None = None,
) -> BucketedWeights:
    return BucketedWeights.pack(tensors.items(), bucket_size_bytes, dtype=dtype)


async def sample(stub) -> list[common_pb2.Trajectory]:
    message = dict_to_message({"role": "user", "content": "What is 12 * 7?"})
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.RolloutPrompt(prompt_id="p", messages=[message])],
        n=4,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=3),
        limits=common_pb2.LengthLimits(max_new_tokens=24),
        max_turns=1,
    )
    return await generate(stub, request)


def assert_sampled_by(
    trajectories, model, other_model, policy_version: int, atol: float = 1e-4
) -> None:
    """The engine's logprobs are `model`'s (fp32, within `atol`), and `other_model`'s are
    further off than 1e-3."""
    engine, expected, other = [], [], []
    for trajectory in trajectories:
        segments = [s for s in trajectory.segments if s.source == common_pb2.SEGMENT_SOURCE_MODEL]
        assert segments and {s.policy_version for s in segments} == {policy_version}
        token_ids = [t for s in trajectory.segments for t in s.token_ids]
        positions = [i - 1 for i, mask in enumerate(trajectory.loss_mask) if mask]
        engine += [lp for s in segments for lp in s.logprobs]
        expected += teacher_forced_logprobs(model, token_ids)[positions].tolist()
        other += teacher_forced_logprobs(other_model, token_ids)[positions].tolist()
    engine, expected, other = map(torch.tensor, (engine, expected, other))
    assert len(engine) >= 8, [t.segments for t in trajectories]
    assert torch.allclose(engine, expected, atol=atol), (engine - expected).abs().max()
    assert (engine - other).abs().max() > 1e-3


async def assert_resumed(stubs) -> None:
    for stub in stubs:
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert not stats.paused


@pytest.mark.parametrize("mode", MODES)
async def test_push_is_exact_in_fp32(tiny_model_dir, mode):
    original, perturbed = load(tiny_model_dir), load(tiny_model_dir, noise_seed=1)
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, mode) as pusher:
        result = await pusher.push(packed(perturbed.state_dict(), 64 * 1024), 1)
        assert result.policy_versions == [1] and result.mode == mode
        # The tied output layer is the embedding: sent once.
        assert result.total_bytes == sum(p.nbytes for p in perturbed.parameters())
        assert_sampled_by(await sample(stubs[0]), perturbed, original, policy_version=1)
        await assert_resumed(stubs)


async def test_a_bf16_push_halves_the_bytes_and_loads_the_rounded_weights(tiny_model_dir):
    original, perturbed = load(tiny_model_dir), load(tiny_model_dir, noise_seed=1)
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, "broadcast") as pusher:
        result = await pusher.push(packed(perturbed.state_dict(), dtype=torch.bfloat16), 1)
        assert result.total_bytes == sum(p.nbytes for p in perturbed.parameters()) // 2
        rounded = load(tiny_model_dir)
        rounded.load_state_dict(
            {k: v.bfloat16().float() for k, v in perturbed.state_dict().items()}
        )
        assert_sampled_by(await sample(stubs[0]), rounded, original, policy_version=1)


async def test_two_replicas_receive_one_broadcast_and_the_group_is_reused(tiny_model_dir):
    original, perturbed = load(tiny_model_dir), load(tiny_model_dir, noise_seed=2)
    async with replicas(tiny_model_dir, 2) as stubs, connected(stubs, "broadcast") as pusher:
        result = await pusher.push(packed(perturbed.state_dict()), 1)
        assert result.policy_versions == [1, 1]
        for stub in stubs:
            assert_sampled_by(await sample(stub), perturbed, original, policy_version=1)
        result = await pusher.push(packed(original.state_dict(), bucket_size_bytes=1), 2)
        assert result.policy_versions == [2, 2] and result.mode == "broadcast"
        for stub in stubs:
            assert_sampled_by(await sample(stub), original, perturbed, policy_version=2)


@pytest.mark.parametrize("mode", MODES)
async def test_a_stale_version_is_refused_before_sending_and_replicas_resume(tiny_model_dir, mode):
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, mode) as pusher:
        with pytest.raises(FailedPreconditionError, match="policy_version 0 is not newer than"):
            await pusher.push(packed(load(tiny_model_dir).state_dict()), 0)
        await assert_resumed(stubs)


@pytest.mark.parametrize("mode", MODES)
async def test_a_replica_error_names_the_replica_and_a_later_push_works(tiny_model_dir, mode):
    model = load(tiny_model_dir, noise_seed=2)
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, mode) as pusher:
        bad = {**model.state_dict(), "nope.weight": torch.zeros(3)}
        with pytest.raises(
            InvalidArgumentError,
            match="rollout replica 0: INVALID_ARGUMENT: unknown parameter 'nope",
        ):
            await pusher.push(packed(bad), 1)
        await assert_resumed(stubs)
        assert (await pusher.push(packed(model.state_dict()), 1)).policy_versions == [1]
        assert pusher.mode == mode  # the broadcast ran to its end: the group is still in step


async def test_the_trainers_group_timeout_bounds_a_replicas_wait_for_a_broadcast(tiny_model_dir):
    """The group's timeout reaches the replica's end of the group (not torch's 30 minutes): a
    replica told to receive an update that rank 0 never sends gives up after it."""
    metas = packed(load(tiny_model_dir).state_dict()).metas
    request = rollout_pb2.UpdateWeightsRequest(
        group_name="turnrl-weights", tensors=[meta.to_proto() for meta in metas],
        bucket_size_bytes=BUCKET_SIZE_BYTES, policy_version=1,
        layout=rollout_pb2.WEIGHT_LAYOUT_ALIGNED_BUCKETS,
    )  # fmt: skip
    async with replicas(tiny_model_dir, 1) as stubs:
        pusher = await WeightPusher.connect(stubs, timeout_seconds=2)
        try:
            assert pusher.mode == "broadcast"
            started = time.monotonic()
            with pytest.raises(FailedPreconditionError, match="broke off after 0 of"):
                await stubs[0].UpdateWeights(request, timeout=60)
            assert time.monotonic() - started < 30
        finally:
            pusher.close()


async def test_falls_back_to_grpc_when_no_group_forms(caplog):
    async with rpc.open_channel(ClientConfig(address=DEAD_ADDRESS)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with caplog.at_level(logging.WARNING):
            pusher = await WeightPusher.connect([stub], timeout_seconds=1)
    assert pusher.mode == "grpc"
    assert "rollout replica 0: UNAVAILABLE" in caplog.text


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"backend": "mpi"}, "backend 'mpi'"), ({"mode": "udp"}, "mode 'udp'"), ({}, "no rollout")],
)
async def test_bad_settings_are_invalid(settings, message):
    with pytest.raises(InvalidArgumentError, match=message):
        await WeightPusher.connect([] if not settings else [object()], **settings)


def test_nccl_broadcasts_from_this_ranks_own_gpu(monkeypatch):
    """Not cuda:0 (the device of a fresh thread, perhaps a rollout server's), but the GPU
    `FsdpModel` trains on: the node's GPU of LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert push_device("nccl") == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert push_device("nccl") == torch.device("cuda", 0)
    assert push_device("gloo") == torch.device("cpu")
