"""The trainer's weight push into a rollout service on the SGLang engine, whose server (the
stand-in of `sglang_stand_in.py`, joining real gloo groups as SGLang does) holds the weights:
the server joins the group itself and receives each tensor, alone or in one group with an
hf replica, and PushWeights reaches it through a safetensors folder; a server of two
tensor-parallel ranks joins with both."""

import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from tests.rollout_svc.sglang_stand_in import SglangStandIn, engine_options
from tests.rollout_svc.test_rollout_service import rollout_server
from tests.tool_svc.http_stand_in import serve_app
from tests.trainer_svc.test_weight_push import (
    DEAD_ADDRESS,
    assert_sampled_by,
    connected,
    load,
    packed,
    sample,
)
from turnrl.errors import InvalidArgumentError
from turnrl.v1 import rollout_pb2
from turnrl.weights import BucketedWeights


@contextlib.asynccontextmanager
async def sglang_replica(
    model_dir, tp_size: int = 1, argv: list[str] | None = None, **options
) -> AsyncIterator[tuple]:
    """A rollout service on the SGLang engine with engine `options`, its server a stand-in
    of `tp_size` tensor-parallel ranks, started with the flags `argv`, that serves `model_dir`
    (the rollout config's model_path, whose checkpoint the engine checks updates against)."""
    server = SglangStandIn(model_path=str(model_dir), argv=argv, tp_size=tp_size)
    async with serve_app(server.app()) as url:
        server.url = url
        options = engine_options(url=url, **options)
        try:
            async with rollout_server(
                model_dir, DEAD_ADDRESS, DEAD_ADDRESS, engine="sglang", engine_options=options
            ) as stub:
                yield stub, server
        finally:
            await server.abort_everything()
            server.leave_groups()


def assert_holds(server: SglangStandIn, weights: BucketedWeights) -> None:
    assert server.weights.keys() == {meta.name for meta in weights.metas}
    for name, tensor in weights.named_tensors():
        assert torch.equal(server.weights[name], tensor), name


async def test_the_server_joins_and_receives_every_tensor(tiny_model_dir):
    perturbed = load(tiny_model_dir, noise_seed=1)
    async with sglang_replica(tiny_model_dir) as (stub, server):
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert (stats.engine, stats.weight_sync_ranks) == ("sglang", 1)
        async with connected([stub], "broadcast") as pusher:
            weights = packed(perturbed.state_dict(), 64 * 1024)
            result = await pusher.push(weights, 1)
            again = packed(load(tiny_model_dir, noise_seed=2).state_dict(), 64 * 1024)
            second = await pusher.push(again, 2)  # the group is kept
        assert (result.mode, result.policy_versions, second.policy_versions) == (
            "broadcast",
            [1],
            [2],
        )
        assert_holds(server, again)
        (joined,) = server.bodies("/init_weights_update_group")
        assert (joined["backend"], joined["rank_offset"], joined["world_size"]) == ("gloo", 1, 2)
        updates = server.bodies("/update_weights_from_distributed")
        assert [body["flush_cache"] for body in updates].count(True) == 2  # once a push
        assert updates[-1]["weight_version"] == "2"
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert (stats.policy_version, stats.paused) == (2, False)


async def test_a_server_of_two_tensor_parallel_ranks_joins_with_both(tiny_model_dir):
    perturbed = load(tiny_model_dir, noise_seed=6)
    async with (
        sglang_replica(tiny_model_dir, tp_size=2) as (sglang, server),
        rollout_server(tiny_model_dir, DEAD_ADDRESS, DEAD_ADDRESS) as hf,
        connected([sglang, hf], "broadcast") as pusher,
    ):
        stats = await sglang.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert stats.weight_sync_ranks == 2
        weights = packed(perturbed.state_dict(), 64 * 1024)
        assert (await pusher.push(weights, 1)).policy_versions == [1, 1]
        (joined,) = server.bodies("/init_weights_update_group")
        assert (joined["rank_offset"], joined["world_size"]) == (1, 4)  # the hf replica: 3
        for rank_weights in server.weight_routes.rank_weights:
            assert rank_weights.keys() == {meta.name for meta in weights.metas}
            for name, tensor in weights.named_tensors():
                assert torch.equal(rank_weights[name], tensor), name


async def test_one_group_with_an_hf_replica_sends_tensor_by_tensor_to_both(tiny_model_dir):
    original, perturbed = load(tiny_model_dir), load(tiny_model_dir, noise_seed=3)
    async with (
        sglang_replica(tiny_model_dir) as (sglang, server),
        rollout_server(tiny_model_dir, DEAD_ADDRESS, DEAD_ADDRESS) as hf,
        connected([hf, sglang], "broadcast") as pusher,
    ):
        weights = packed(perturbed.state_dict(), 64 * 1024)
        result = await pusher.push(weights, 1)
        assert result.policy_versions == [1, 1]
        assert_holds(server, weights)
        # The hf replica received the same broadcasts, tensor by tensor, into its model.
        assert_sampled_by(await sample(hf), perturbed, original, policy_version=1)
        (joined,) = server.bodies("/init_weights_update_group")
        assert (joined["rank_offset"], joined["world_size"]) == (2, 3)


async def test_a_server_that_takes_flattened_buckets_gets_them_hf_replicas_too(tiny_model_dir):
    original, perturbed = load(tiny_model_dir), load(tiny_model_dir, noise_seed=5)
    async with (
        sglang_replica(tiny_model_dir, weight_layout="flattened_buckets") as (sglang, server),
        rollout_server(tiny_model_dir, DEAD_ADDRESS, DEAD_ADDRESS) as hf,
        connected([sglang, hf], "broadcast") as pusher,
    ):
        weights = packed(perturbed.state_dict(), 64 * 1024)
        assert (await pusher.push(weights, 1)).policy_versions == [1, 1]
        assert_holds(server, weights)
        assert_sampled_by(await sample(hf), perturbed, original, policy_version=1)
        updates = server.bodies("/update_weights_from_distributed")
        assert {body.get("load_format") for body in updates} == {"flattened_bucket"}
        assert len(updates) < len(weights.metas)  # fewer calls, so fewer broadcasts


async def test_without_a_group_the_server_loads_the_update_from_disk(tiny_model_dir):
    perturbed = load(tiny_model_dir, noise_seed=4)
    async with sglang_replica(tiny_model_dir) as (stub, server):
        async with connected([stub], "grpc") as pusher:
            weights = packed(perturbed.state_dict())
            assert (await pusher.push(weights, 1)).policy_versions == [1]
        assert_holds(server, weights)
        assert "/update_weights_from_distributed" not in server.paths()


async def test_an_update_that_does_not_fit_the_model_reaches_no_server(tiny_model_dir):
    wrong = {"model.norm.weight": torch.ones(3)}
    async with sglang_replica(tiny_model_dir) as (stub, server):
        async with connected([stub], "grpc") as pusher:
            with pytest.raises(InvalidArgumentError, match=r"'model\.norm\.weight' has shape"):
                await pusher.push(packed(wrong), 1)
        assert "/update_weights_from_disk" not in server.paths()
        assert not server.weights
