"""LoRA adapter pushes (`WeightPusher.push(..., adapter=...)`) into real rollout servers on
loopback: with the hf engine, what it samples is the peft model of base + adapter; with SGLang
(its stand-in server), the peft folder it loads and the adapter each /generate names."""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from rollout_svc.engines.server_engine_options import ServerLoraOptions
from rollout_svc.engines.sglang import lora_server_flags
from tests.trainer_svc.test_lora import trained_policy
from tests.trainer_svc.test_weight_push import (
    BUCKET_SIZE_BYTES,
    assert_resumed,
    assert_sampled_by,
    connected,
    load,
    packed,
    replicas,
    sample,
)
from tests.trainer_svc.test_weight_push_sglang import sglang_replica
from trainer_svc.config import LoraSettings
from trainer_svc.ranks import Models, gather_weights, pushed_adapter
from trainer_svc.served_model import check_loads_adapters
from turnrl.errors import FailedPreconditionError
from turnrl.v1 import common_pb2, rollout_pb2
from turnrl.weights import LoraAdapter

ADAPTER = LoraAdapter(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def peft_model(model_dir, seed: int, adapter: LoraAdapter = ADAPTER):
    """The base model with a peft adapter of `adapter`'s shape whose weights are seeded noise
    (peft starts B at 0, which would make the adapter a no-op); and its saved tensors."""
    torch.manual_seed(seed)  # lora_A's init
    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        target_modules=list(adapter.target_modules),
        lora_dropout=0.0,
    )
    model = get_peft_model(load(model_dir), config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape) * 0.2)
    return model, get_peft_model_state_dict(model)


@pytest.mark.parametrize("mode", ["broadcast", "grpc"])
async def test_an_adapter_push_samples_base_plus_adapter_exactly(tiny_model_dir, mode):
    base = load(tiny_model_dir)
    first, first_tensors = peft_model(tiny_model_dir, seed=1)
    second, second_tensors = peft_model(tiny_model_dir, seed=2)
    # fp32 within 1e-4 (a batch's padding reorders sums: 2.9e-5 seen in CI); each other model
    # is further off than 1e-3, so the check still tells which weights sampled.
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, mode) as pusher:
        result = await pusher.push(packed(first_tensors), 1, adapter=ADAPTER)
        # Adapters go as a gRPC stream even where a group formed; only their bytes travel.
        assert result.mode == "grpc" and result.policy_versions == [1]
        assert result.total_bytes == sum(t.nbytes for t in first_tensors.values())
        assert_sampled_by(await sample(stubs[0]), first, base, policy_version=1)
        # The next adapter replaces the first: base + second, not base + first + second.
        await pusher.push(packed(second_tensors), 2, adapter=ADAPTER)
        assert_sampled_by(await sample(stubs[0]), second, first, policy_version=2)
        await assert_resumed(stubs)


async def test_whole_weights_after_an_adapter_replace_the_adapter_too(tiny_model_dir):
    adapted, tensors = peft_model(tiny_model_dir, seed=1)
    perturbed = load(tiny_model_dir, noise_seed=3)
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, "grpc") as pusher:
        await pusher.push(packed(tensors), 1, adapter=ADAPTER)
        await pusher.push(packed(perturbed.state_dict()), 2)
        assert_sampled_by(await sample(stubs[0]), perturbed, adapted, policy_version=2)


async def test_an_adapter_of_another_shape_is_refused_and_replicas_resume(tiny_model_dir):
    other = LoraAdapter(rank=8, alpha=8.0, target_modules=("q_proj", "v_proj"))
    _, tensors = peft_model(tiny_model_dir, seed=1)
    _, other_tensors = peft_model(tiny_model_dir, seed=1, adapter=other)
    async with replicas(tiny_model_dir, 1) as stubs, connected(stubs, "grpc") as pusher:
        stats = await stubs[0].GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert stats.loads_lora_adapters
        await pusher.push(packed(tensors), 1, adapter=ADAPTER)
        with pytest.raises(FailedPreconditionError, match="restart the rollout service"):
            await pusher.push(packed(other_tensors), 2, adapter=other)
        await assert_resumed(stubs)


def test_a_run_pushing_adapters_fails_on_an_engine_that_does_not_load_them():
    stats = [
        rollout_pb2.GetStatsResponse(engine="hf", loads_lora_adapters=True),
        rollout_pb2.GetStatsResponse(engine="sglang"),
    ]
    with pytest.raises(FailedPreconditionError, match=r"sglang.*trainer.lora.push: merged"):
        check_loads_adapters(stats)
    check_loads_adapters(stats[:1])


def test_gather_weights_packs_the_adapters_alone_and_the_base_once(tiny_model_dir):
    policy = trained_policy(tiny_model_dir)
    lora = LoraSettings(rank=4, alpha=8.0, push="adapter")
    targets = ("k_proj", "o_proj", "q_proj", "v_proj")  # trainer.lora's default
    assert pushed_adapter(lora, policy) == LoraAdapter(rank=4, alpha=8.0, target_modules=targets)
    assert pushed_adapter(lora.model_copy(update={"push": "merged"}), policy) is None
    assert pushed_adapter(None, policy) is None
    models = Models(policy)
    weights = gather_weights(models, "policy", BUCKET_SIZE_BYTES, adapters=True)
    adapters = policy.adapter_state_dict()
    assert [name for name, _ in weights.named_tensors()] == list(adapters)
    assert all(torch.equal(t, adapters[name]) for name, t in weights.named_tensors())
    # The base the adapters apply to: the model's own weights, under its own names, the tied
    # output layer once.
    base = load(tiny_model_dir).state_dict()
    pushed_base = dict(models.base_weights.named_tensors())
    assert pushed_base.keys() == base.keys() - {"lm_head.weight"}
    assert all(torch.equal(t, base[name]) for name, t in pushed_base.items())
    first_base = models.base_weights
    gather_weights(models, "policy", BUCKET_SIZE_BYTES, adapters=True)
    assert models.base_weights is first_base  # frozen: gathered once


async def test_an_sglang_server_loads_each_adapter_and_generates_with_the_newest(tiny_model_dir):
    lora = {"max_rank": 8, "target_modules": ["q_proj", "v_proj"]}
    _, first = peft_model(tiny_model_dir, seed=1)
    _, second = peft_model(tiny_model_dir, seed=2)
    async with (
        sglang_replica(tiny_model_dir, argv=lora_server_flags(ServerLoraOptions(**lora)), lora=lora)
        as (stub, server),
        connected([stub], "grpc") as pusher,
    ):  # fmt: skip
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert stats.loads_lora_adapters
        await pusher.push(packed(first), 1, adapter=ADAPTER)
        (load,) = server.bodies("/load_lora_adapter")
        assert load["lora_name"] == "turnrl-v1"
        config = json.loads((Path(load["lora_path"]) / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
            4, 8.0, ["q_proj", "v_proj"]
        )  # fmt: skip
        assert server.adapters["turnrl-v1"].keys() == first.keys()
        assert all(torch.equal(server.adapters["turnrl-v1"][k], t) for k, t in first.items())
        trajectories = await sample(stub)
        assert {body["lora_path"] for body in server.bodies("/generate")} == {"turnrl-v1"}
        model_segments = [
            s
            for t in trajectories
            for s in t.segments
            if s.source == common_pb2.SEGMENT_SOURCE_MODEL
        ]
        assert model_segments and {s.policy_version for s in model_segments} == {1}

        await pusher.push(packed(second), 2, adapter=ADAPTER)
        # The first is unloaded once the second is live, its folder deleted.
        await server.wait_until(lambda: "turnrl-v1" not in server.adapters)
        assert list(server.adapters) == ["turnrl-v2"]
        assert server.bodies("/unload_lora_adapter") == [{"lora_name": "turnrl-v1"}]
        async with asyncio.timeout(10):
            # The engine deletes it after the server's reply, with no event to wait on.
            while await asyncio.to_thread(Path(load["lora_path"]).exists):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await sample(stub)
        assert server.bodies("/generate")[-1]["lora_path"] == "turnrl-v2"


async def test_whole_weights_after_an_adapter_end_sglang_generating_with_it(tiny_model_dir):
    lora = {"max_rank": 8, "target_modules": ["q_proj", "v_proj"]}
    _, tensors = peft_model(tiny_model_dir, seed=1)
    perturbed = load(tiny_model_dir, noise_seed=3)
    async with (
        sglang_replica(tiny_model_dir, argv=lora_server_flags(ServerLoraOptions(**lora)), lora=lora)
        as (stub, server),
        connected([stub], "grpc") as pusher,
    ):  # fmt: skip
        await pusher.push(packed(tensors), 1, adapter=ADAPTER)
        await pusher.push(packed(perturbed.state_dict()), 2)
        await server.wait_until(lambda: not server.adapters)
        await sample(stub)
        assert "lora_path" not in server.bodies("/generate")[-1]


async def test_an_sglang_server_without_lora_refuses_adapters(tiny_model_dir):
    _, tensors = peft_model(tiny_model_dir, seed=1)
    async with (
        sglang_replica(tiny_model_dir) as (stub, server),
        connected([stub], "grpc") as pusher,
    ):
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert not stats.loads_lora_adapters
        with pytest.raises(FailedPreconditionError, match=r"engine_options\.lora"):
            await pusher.push(packed(tensors), 1, adapter=ADAPTER)
        assert not server.bodies("/load_lora_adapter")
