"""The SGLang adapter when a weight push breaks off part-way, and when joining a weight-sync
group fails after the server formed it: against the stand-in server (`sglang_stand_in.py`) on
real gloo groups whose rank 0 is a `weight_sender` process."""

import asyncio
import sys

import pytest
import torch

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.sglang_api import sglang_rid
from tests.rollout_svc import weight_sender
from tests.rollout_svc.sglang_stand_in import WAIT_SECONDS, SglangStandIn, continuation
from tests.rollout_svc.test_sglang_engine import engine as engine
from tests.rollout_svc.test_sglang_engine import stand_in as stand_in
from tests.rollout_svc.test_sglang_engine import weight_group
from turnrl.config import REPO_ROOT
from turnrl.errors import DeadlineExceededError, FailedPreconditionError
from turnrl.weights import TensorMeta

# Two buckets of 2 KiB: the embedding and the norm, then the head.
SPECS = [
    "model.embed_tokens.weight:bfloat16:100x8", "model.norm.weight:float32:8",
    "lm_head.weight:bfloat16:100x8",
]  # fmt: skip
BROKEN = r"weights incomplete after a broken push to version 1"


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


async def test_a_broken_push_refuses_generation_until_a_complete_one(stand_in, engine):
    stand_in.hold_at_tokens = 2
    in_flight = asyncio.create_task(
        engine.generate([3], SamplingParams(max_new_tokens=5), "r-in-flight")
    )
    await stand_in.wait_until(lambda: stand_in.decoded(sglang_rid("r-in-flight")) == 2)
    await engine.pause()
    await stand_in.release()
    # The trainer dies after the first bucket: the server loaded it, not the second.
    async with weight_group(engine, SPECS, die_after_buckets=1) as sent:
        with pytest.raises(FailedPreconditionError, match="update_weights_from_distributed"):
            await engine.receive_weights("g", metas_of(sent), 2048, "per_tensor", 1)
    assert (engine.policy_version, engine.stats()["weights_incomplete"]) == (0, 1.0)
    await engine.resume()
    # The request in flight ends with the error (the server was told to abort it), a new one
    # is refused before it is sent.
    with pytest.raises(FailedPreconditionError, match=BROKEN):
        await in_flight
    assert {"rid": sglang_rid("r-in-flight")} in stand_in.bodies("/abort_request")
    sent_before = stand_in.paths().count("/generate")
    with pytest.raises(FailedPreconditionError, match=rf"{BROKEN}; push again"):
        await engine.generate([3], SamplingParams(max_new_tokens=2), "r-refused")
    assert stand_in.paths().count("/generate") == sent_before

    await engine.pause()
    async with weight_group(engine, SPECS, name="again") as sent:
        await engine.receive_weights("again", metas_of(sent), 2048, "per_tensor", 1)
    await engine.resume()
    assert (engine.policy_version, engine.stats()["weights_incomplete"]) == (1, 0.0)
    output = await engine.generate([3], SamplingParams(max_new_tokens=2), "r-after")
    assert (output.output_ids, output.policy_versions) == (continuation([3], 2), [1, 1])


async def test_a_failed_disk_update_refuses_generation(stand_in: SglangStandIn, engine):
    await engine.pause()
    stand_in.failures["/update_weights_from_disk"] = [(400, "out of memory while loading")]
    norm = [("model.norm.weight", torch.randn(8))]
    with pytest.raises(FailedPreconditionError, match="out of memory while loading"):
        await engine.update_weights(norm, policy_version=1)
    await engine.resume()
    with pytest.raises(FailedPreconditionError, match=BROKEN):
        await engine.generate([3], SamplingParams(max_new_tokens=2), "r-refused")
    await engine.pause()
    await engine.update_weights(norm, policy_version=1)
    await engine.resume()
    output = await engine.generate([3], SamplingParams(max_new_tokens=2), "r-after")
    assert output.policy_versions == [1, 1]


async def test_a_join_that_fails_after_the_server_formed_the_group_can_be_retried(
    stand_in: SglangStandIn, engine
):
    # The trainer joins late: the server forms the group after the adapter stopped waiting.
    command = weight_sender.command("g", SPECS, updates=0, join_delay_seconds=1.0)
    late = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        port = int(await late.stdout.readline())
        with pytest.raises(DeadlineExceededError, match="/init_weights_update_group"):
            await engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo", "g", 0.2)
        await stand_in.wait_until(lambda: "g" in stand_in.groups)
        async with asyncio.timeout(WAIT_SECONDS):
            assert await late.wait() == 0
    finally:
        if late.returncode is None:
            late.kill()
            await late.wait()
    # The retry, under the same name, finds the group gone and forms it anew.
    await engine.pause()
    async with weight_group(engine, SPECS) as sent:
        await engine.receive_weights("g", metas_of(sent), 2048, "per_tensor", 1)
    assert stand_in.bodies("/destroy_weights_update_group") == [{"group_name": "g"}]
    for name, tensor in sent.items():
        assert torch.equal(stand_in.weights[name], tensor), name
