"""The trainer's weight push into a real vLLM CPU server (`conftest.vllm_server`) through a real
rollout service on the vLLM engine: over a gloo group into turnrl's worker extension inside
vLLM, and as a safetensors folder without one; checked by the logprobs the server then samples
with against a transformers forward pass of the pushed weights (the tied head included). Also:
a push in the middle of a Generate, a push that breaks off, and updates that do not fit.

Every test puts the shipped weights and vLLM's initial version label back when it ends
(`shipped_weights_after`): the other engine tests compare with them."""

import asyncio
import contextlib
import datetime
import sys
from collections.abc import AsyncIterator

import httpx
import pytest
import torch
from google.protobuf import duration_pb2

from rollout_svc.engines.base import SamplingParams
from tests.engines.test_vllm_engine import ATTEMPTS, paused_mid_request
from tests.rollout_svc import weight_sender
from tests.rollout_svc.test_rollout_service import generate, rollout_server, teacher_forced_logprobs
from tests.trainer_svc.test_weight_push import DEAD_ADDRESS, connected, load, packed
from turnrl.config import REPO_ROOT
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2, rollout_pb2
from turnrl.weights import LAYOUTS, TensorMeta

pytestmark = pytest.mark.engines

# The most a logprob of the server may differ from transformers' on the same fp32 weights.
EXACT = 1e-5
# Two buckets of the weight_sender's tiny model tensors: the last norm, then the first.
NORMS = ["model.norm.weight:float32:128", "model.layers.0.input_layernorm.weight:float32:128"]
WAIT_SECONDS = 60.0
BROKEN = "weights incomplete after a broken push to version 1"


@contextlib.asynccontextmanager
async def vllm_replica(vllm_server, **engine_options) -> AsyncIterator:
    """A rollout service on the vLLM engine, connected to `vllm_server`, with
    `engine_options` besides its url."""
    async with rollout_server(
        vllm_server.model_path, DEAD_ADDRESS, DEAD_ADDRESS, engine="vllm",
        engine_options={"url": vllm_server.url, **engine_options},
        max_model_len=vllm_server.max_model_len,
        max_response_length=vllm_server.max_model_len // 2,
    ) as stub:  # fmt: skip
        yield stub


@pytest.fixture
async def shipped_weights_after(vllm_server) -> AsyncIterator[None]:
    """Puts the shipped weights back into the server (its extension loads the model's own
    folder) and its initial version label, and resumes it, when the test ends."""
    yield
    async with httpx.AsyncClient(base_url=vllm_server.url, trust_env=False, timeout=60) as http:
        (await http.post("/resume")).raise_for_status()
        body = {
            "method": "turnrl_load_weights_from_folder",
            "kwargs": {"folder": vllm_server.model_path},
        }
        reply = await http.post("/collective_rpc", json=body)
        assert reply.json() == {"results": [{"load_seconds": pytest.approx(0, abs=60)}]}
        (
            await http.post("/update_weight_version", json={"new_version": "default"})
        ).raise_for_status()


async def greedy_trajectory(stub, max_new_tokens: int = 24) -> common_pb2.Trajectory:
    message = dict_to_message({"role": "user", "content": "What is 12 * 7?"})
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.RolloutPrompt(prompt_id="p", messages=[message])],
        n=1,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        limits=common_pb2.LengthLimits(max_new_tokens=max_new_tokens),
        max_turns=1,
    )
    (trajectory,) = await generate(stub, request)
    return trajectory


def logprob_gap(trajectory: common_pb2.Trajectory, model) -> float:
    """The largest difference between the server's logprobs and `model`'s forward pass."""
    segments = [s for s in trajectory.segments if s.source == common_pb2.SEGMENT_SOURCE_MODEL]
    token_ids = [t for s in trajectory.segments for t in s.token_ids]
    positions = [i - 1 for i, mask in enumerate(trajectory.loss_mask) if mask]
    served = torch.tensor([lp for s in segments for lp in s.logprobs])
    assert len(served) >= 4, trajectory.segments
    return (served - teacher_forced_logprobs(model, token_ids)[positions]).abs().max().item()


async def test_the_trainers_broadcast_loads_into_vllm_tied_head_included(
    vllm_server, shipped_weights_after
):
    original, perturbed = load(vllm_server.model_path), load(vllm_server.model_path, noise_seed=1)
    assert original.config.tie_word_embeddings
    async with vllm_replica(vllm_server) as stub:
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert (stats.engine, stats.weight_sync_ranks, stats.policy_version) == ("vllm", 1, 0)
        async with connected([stub], "broadcast") as pusher:
            result = await pusher.push(packed(perturbed.state_dict(), 64 * 1024), 1)
            assert (result.mode, result.policy_versions) == ("broadcast", [1])
            pushed = await greedy_trajectory(stub)
            # The group is kept: a second push goes over it too.
            again = await pusher.push(packed(original.state_dict(), 64 * 1024), 2)
            assert (again.mode, again.policy_versions) == ("broadcast", [2])
            restored = await greedy_trajectory(stub)
    # The embedding is the head: a stale head would score with the old embedding.
    assert logprob_gap(pushed, perturbed) < EXACT < logprob_gap(pushed, original)
    assert {s.policy_version for s in pushed.segments if s.source == 2} == {1}
    assert logprob_gap(restored, original) < EXACT


async def test_without_a_group_pushweights_loads_through_a_folder(
    vllm_server, shipped_weights_after
):
    original, perturbed = load(vllm_server.model_path), load(vllm_server.model_path, noise_seed=2)
    async with vllm_replica(vllm_server) as stub, connected([stub], "grpc") as pusher:
        result = await pusher.push(packed(perturbed.state_dict()), 1)
        assert (result.mode, result.policy_versions) == ("grpc", [1])
        pushed = await greedy_trajectory(stub)
    assert logprob_gap(pushed, perturbed) < EXACT < logprob_gap(pushed, original)
    assert {s.policy_version for s in pushed.segments if s.source == 2} == {1}


async def test_a_push_during_a_generation_splits_its_tokens_by_version(
    vllm_server, vllm_engine, shipped_weights_after
):
    perturbed = load(vllm_server.model_path, noise_seed=3)
    async with vllm_replica(vllm_server) as stub, connected([stub], "broadcast") as pusher:
        # Paused first: on a busy machine the request could end before the push's own pause
        # lands. The push pauses again (a no-op), loads, and resumes the request. A request
        # the server had not yet scheduled when paused samples every token after the push:
        # tried again, with the next version.
        for version in range(1, ATTEMPTS + 1):
            running, _ = await paused_mid_request(vllm_engine, f"long-{version}")
            await pusher.push(packed(perturbed.state_dict(), 64 * 1024), version)
            output = await asyncio.wait_for(running, WAIT_SECONDS)
            if output.policy_versions[0] < version:
                break
    count = len(output.output_ids)
    split = output.policy_versions.index(version)
    assert 0 < split < count
    assert output.policy_versions == [version - 1] * split + [version] * (count - split)


async def test_a_push_drops_the_prefix_cache_the_old_weights_computed(
    vllm_server, vllm_engine, shipped_weights_after
):
    perturbed = load(vllm_server.model_path, noise_seed=4)
    prompt = [(7 * i) % 600 + 10 for i in range(400)]  # several blocks of the prefix cache
    await vllm_engine.generate(prompt, greedy(4), "cached")
    async with vllm_replica(vllm_server) as stub, connected([stub], "broadcast") as pusher:
        await pusher.push(packed(perturbed.state_dict(), 64 * 1024), 1)
    output = await vllm_engine.generate(prompt, greedy(16), "after")
    expected = teacher_forced_logprobs(perturbed, prompt + output.output_ids)[len(prompt) - 1 :]
    assert (torch.tensor(output.logprobs) - expected).abs().max().item() < EXACT


async def test_a_push_that_breaks_off_refuses_generation_until_a_complete_one(
    vllm_server, shipped_weights_after
):
    original = load(vllm_server.model_path)
    metas = [TensorMeta(spec.split(":")[0], torch.float32, (128,)) for spec in NORMS]
    # The trainer: a process that dies after the first of two buckets.
    command = weight_sender.command(
        "dies", NORMS, layout="aligned_buckets", bucket_size=512, die_after_buckets=1
    )
    sender = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    async with vllm_replica(vllm_server) as stub:
        try:
            port = int(await sender.stdout.readline())
            timeout = duration_pb2.Duration()
            timeout.FromTimedelta(datetime.timedelta(seconds=WAIT_SECONDS))
            joined = await stub.InitWeightSync(
                rollout_pb2.InitWeightSyncRequest(
                    master_address="127.0.0.1", master_port=port, world_size=2, rank_offset=1,
                    backend=rollout_pb2.InitWeightSyncRequest.BACKEND_GLOO, group_name="dies",
                    timeout=timeout,
                ),
                timeout=WAIT_SECONDS,
            )  # fmt: skip
            assert joined.ranks_joined == 1
            update = rollout_pb2.UpdateWeightsRequest(
                group_name="dies", tensors=[meta.to_proto() for meta in metas],
                bucket_size_bytes=512, policy_version=1, layout=LAYOUTS["aligned_buckets"],
            )  # fmt: skip
            with pytest.raises(FailedPreconditionError, match="broke off after 1 of 2 buckets"):
                await stub.UpdateWeights(update, timeout=WAIT_SECONDS)
            assert await asyncio.wait_for(sender.wait(), WAIT_SECONDS) == weight_sender.DIED
        finally:
            if sender.returncode is None:
                sender.kill()
                await sender.wait()
        with pytest.raises(FailedPreconditionError, match=BROKEN):
            await greedy_trajectory(stub)
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert (stats.policy_version, stats.paused) == (0, False)
        assert stats.weights_incomplete_reason.startswith("weights incomplete")
        # A complete push (the whole model: the extension loads every layer) ends it.
        async with connected([stub], "broadcast") as pusher:
            await pusher.push(packed(original.state_dict(), 64 * 1024), 1)
        trajectory = await greedy_trajectory(stub)
    assert logprob_gap(trajectory, original) < EXACT


async def test_updates_that_do_not_fit_the_model_are_refused_before_anything_is_sent(
    vllm_server, vllm_engine, shipped_weights_after
):
    original = load(vllm_server.model_path)
    async with vllm_replica(vllm_server) as stub, connected([stub], "grpc") as pusher:
        with pytest.raises(InvalidArgumentError, match=r"'model\.norm\.weight' has shape \[3\]"):
            await pusher.push(packed({"model.norm.weight": torch.ones(3)}), 1)
        with pytest.raises(InvalidArgumentError, match=r"'model\.nope' is not a parameter"):
            await pusher.push(packed({"model.nope": torch.ones(3)}), 1)
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert (stats.policy_version, stats.weights_incomplete_reason) == (0, "")
        assert logprob_gap(await greedy_trajectory(stub), original) < EXACT
    # Over a group, the engine refuses before it asks the server to receive (it is in no
    # group: a call that reached the server would fail for that instead).
    await vllm_engine.pause()
    try:
        wrong = [TensorMeta("model.norm.weight", torch.float32, (3,))]
        with pytest.raises(InvalidArgumentError, match=r"has shape \[3\]"):
            await vllm_engine.receive_weights("g", wrong, 1 << 20, "aligned_buckets", 1)
    finally:
        await vllm_engine.resume()
    assert vllm_engine.stats()["weights_incomplete"] == 0.0


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
