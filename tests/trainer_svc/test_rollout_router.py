"""The trainer's rollout router against real rollout services: two `turnrl serve rollout`
processes on the tiny model, sharing real tool and reward services on loopback."""

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator

import pytest

from tests.conftest import ServedProcess, free_port, serve_subprocess
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.test_rollout_service import prompts
from tests.trainer_svc.runs import follow, run_config
from trainer_svc.rollout_router import RolloutRouter, engine_metrics
from turnrl import errors, rpc
from turnrl.config import ClientConfig
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc


@contextlib.asynccontextmanager
async def rollout_settings(tiny_model_dir) -> AsyncIterator[list[str]]:
    """Real tool and reward services in this process; yields the overrides of a rollout
    service on the tiny model that calls them."""
    async with tool_service_address() as tools, reward_service_address() as rewards:
        yield [
            f"rollout.model_path={tiny_model_dir}",
            f"rollout.tool_service.address={tools}",
            f"rollout.reward_service.address={rewards}",
        ]


@contextlib.asynccontextmanager
async def rollout_replicas(
    tiny_model_dir, count: int, *overrides: str
) -> AsyncIterator[list[ServedProcess]]:
    """`count` rollout services on the tiny model, each its own process."""
    async with rollout_settings(tiny_model_dir) as settings, contextlib.AsyncExitStack() as stack:
        started = [serve_subprocess("rollout", *settings, *overrides) for _ in range(count)]
        yield list(await asyncio.gather(*(stack.enter_async_context(s) for s in started)))


def request(count: int, n: int, max_new_tokens: int = 48) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=prompts(count),
        n=n,
        enable_scoring=True,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=3),
        limits=common_pb2.LengthLimits(max_new_tokens=max_new_tokens),
        request_id="router-test",
    )


async def test_groups_spread_over_replicas_by_load_and_come_back_whole(tiny_model_dir):
    async with rollout_replicas(tiny_model_dir, 2) as replicas:
        addresses = ",".join(replica.address for replica in replicas)
        router = RolloutRouter(ClientConfig(address=addresses), no_catch_up)
        try:
            trajectories = await router.generate(request(6, 2), timeout_seconds=300)
            stats = await router.stats()
        finally:
            await router.close()
    assert sorted(t.trajectory_id for t in trajectories) == sorted(
        f"p{i}/{j}" for i in range(6) for j in range(2)
    )
    # Equal load: three groups each, every group whole on one replica.
    assert [replica.trajectories for replica in router.replicas] == [6, 6]
    assert [replica.in_flight for replica in router.replicas] == [0, 0]
    assert [s.finished_trajectories for s in stats] == [6, 6]
    assert engine_metrics(stats)["engine/tokens_generated"] == sum(
        s.metrics["tokens_generated"] for s in stats
    )
    assert router.redispatched_groups == 0


async def test_a_killed_replica_has_its_groups_dispatched_again(tiny_model_dir):
    async with rollout_replicas(tiny_model_dir, 2) as replicas:
        addresses = ",".join(replica.address for replica in replicas)
        router = RolloutRouter(ClientConfig(address=addresses), no_catch_up)
        try:
            call = asyncio.create_task(
                router.generate(request(4, 2, max_new_tokens=256), timeout_seconds=300)
            )
            # Kill replica 1 once its trajectories are running there.
            while router.replicas[1].in_flight < 4 or router.replicas[1].trajectories:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            os.kill(replicas[1].process.pid, signal.SIGKILL)
            trajectories = await call
            members = await router.members_for_push()
        finally:
            await router.close()
    # Every prompt's whole group came back, once; the lost replica's went to replica 0.
    ids = sorted(t.trajectory_id for t in trajectories)
    assert ids == sorted(f"p{i}/{j}" for i in range(4) for j in range(2))
    assert router.redispatched_groups >= 1
    assert router.replicas[0].trajectories == 8 - router.replicas[1].trajectories
    assert [m.address for m in members] == [replicas[0].address]
    assert not router.replicas[1].live


@pytest.mark.timeout(600)  # three rollout services start, one after the other
async def test_a_replica_killed_after_part_of_its_group_came_back_is_counted_empty(
    tiny_model_dir,
):
    # Replica 1 dies once some of its group's four trajectories are back: they are dropped
    # with their group, which goes to replica 0; back at its address, replica 1 has nothing
    # in flight and takes its share of the next request.
    port = free_port()
    async with (
        rollout_settings(tiny_model_dir) as settings,
        serve_subprocess("rollout", *settings) as first,
        contextlib.AsyncExitStack() as stack,
    ):
        second = await stack.enter_async_context(serve_subprocess("rollout", *settings, port=port))
        router = RolloutRouter(
            ClientConfig(address=f"{first.address},{second.address}"), no_catch_up
        )
        try:
            call = asyncio.create_task(
                router.generate(request(2, 4, max_new_tokens=256), timeout_seconds=300)
            )
            async with asyncio.timeout(240):  # until the first of its group is back
                while router.replicas[1].in_flight == 4:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            os.kill(second.process.pid, signal.SIGKILL)
            trajectories = await call
            assert [r.in_flight for r in router.replicas] == [0, 0]
            await stack.enter_async_context(serve_subprocess("rollout", *settings, port=port))
            async with asyncio.timeout(120):  # its channel connects again after a back-off
                while len(await router.members_for_push()) < 2:  # noqa: ASYNC110
                    await asyncio.sleep(1.0)
            before = [r.trajectories for r in router.replicas]
            await router.generate(request(2, 1), timeout_seconds=300)
        finally:
            await router.close()
    assert sorted(t.trajectory_id for t in trajectories) == [
        f"p{i}/{j}" for i in (0, 1) for j in range(4)
    ]
    assert router.redispatched_groups == 1
    # Equal load again: one group each.
    assert [r.trajectories - b for r, b in zip(router.replicas, before, strict=True)] == [1, 1]
    assert [r.in_flight for r in router.replicas] == [0, 0]


async def test_with_every_replica_lost_a_request_waits_no_longer_than_its_deadline():
    unreachable = "127.0.0.1:1"  # nothing listens on port 1
    router = RolloutRouter(ClientConfig(address=unreachable), no_catch_up)  # waits up to 180 s
    router.lose(unreachable, lost(unreachable))
    try:
        async with asyncio.timeout(60):
            with pytest.raises(errors.DeadlineExceededError, match=r"deadline of 2s"):
                await router.generate(request(1, 1), timeout_seconds=2)
    finally:
        await router.close()


async def no_catch_up(replica) -> None:
    raise AssertionError(f"{replica.address} was not lost")


def lost(address: str) -> errors.RpcError:
    return errors.RpcUnavailableError(
        "gone", method="/test", address=address, status="UNAVAILABLE", details="gone"
    )


async def test_a_lost_replica_that_answers_again_rejoins_at_the_push(tiny_model_dir):
    async with rollout_replicas(tiny_model_dir, 1) as replicas:
        unreachable = "127.0.0.1:1"  # nothing listens on port 1
        router = RolloutRouter(
            ClientConfig(address=f"{replicas[0].address},{unreachable}"), no_catch_up
        )
        try:
            for address in (replicas[0].address, unreachable):
                router.lose(address, lost(address))
            members = await router.members_for_push()
            trajectories = await router.generate(request(2, 1), timeout_seconds=300)
        finally:
            await router.close()
    assert [m.address for m in members] == [replicas[0].address]
    assert len(trajectories) == 2 and router.replicas[0].trajectories == 2


async def test_with_every_replica_lost_a_request_waits_for_one_to_come_back(tiny_model_dir):
    caught_up = []

    async def catch_up(replica) -> None:
        caught_up.append(replica.address)

    async with rollout_replicas(tiny_model_dir, 1) as replicas:
        unreachable = "127.0.0.1:1"  # nothing listens on port 1
        router = RolloutRouter(
            ClientConfig(address=f"{unreachable},{replicas[0].address}"), catch_up
        )
        alone = RolloutRouter(ClientConfig(address=unreachable), catch_up, return_seconds=2)
        try:
            for address in (replicas[0].address, unreachable):
                router.lose(address, lost(address))
            # The one that answers is brought the policy first, then takes the groups.
            trajectories = await router.generate(request(2, 1), timeout_seconds=300)
            alone.lose(unreachable, lost(unreachable))
            with pytest.raises(errors.UnavailableError, match="none came back in 2s"):
                await alone.generate(request(1, 1), timeout_seconds=60)
        finally:
            await router.close()
            await alone.close()
    assert caught_up == [replicas[0].address]
    assert len(trajectories) == 2 and router.replicas[1].trajectories == 2


async def test_a_request_error_is_raised_not_dispatched_again(tiny_model_dir):
    async with rollout_replicas(tiny_model_dir, 2) as replicas:
        router = RolloutRouter(
            ClientConfig(address=",".join(r.address for r in replicas)), no_catch_up
        )
        bad = request(2, 1)
        bad.limits.max_new_tokens = 10**6  # past the engine's context: INVALID_ARGUMENT
        try:
            with pytest.raises(errors.InvalidArgumentError):
                await router.generate(bad, timeout_seconds=60)
        finally:
            await router.close()
    assert all(replica.live for replica in router.replicas)
    assert router.redispatched_groups == 0


async def test_an_unavailable_sent_by_a_replica_that_answers_is_not_a_lost_replica(
    tiny_model_dir,
):
    # Its tool service is unreachable: Generate fails with UNAVAILABLE from the replica itself
    # (once ListTools' deadline, kept short here, is spent trying again).
    unreachable = [
        "rollout.tool_service.address=127.0.0.1:1",
        "rollout.tool_service.timeout_seconds=3",
    ]
    async with rollout_replicas(tiny_model_dir, 1, *unreachable) as (replica,):
        router = RolloutRouter(ClientConfig(address=replica.address), no_catch_up)
        try:
            with pytest.raises(errors.UnavailableError, match="ListTools"):
                await router.generate(request(1, 1), timeout_seconds=60)
        finally:
            await router.close()
    assert router.replicas[0].live and router.redispatched_groups == 0


async def test_a_run_goes_on_without_a_killed_replica_which_rejoins_at_a_push(
    tiny_model_dir, tmp_path
):
    # Replica 1 dies after step 1 and comes back at its address while the run goes on: the
    # steps in between train on replica 0 alone; a push after its return forms the weight-sync
    # group with both again, and the next steps use both. The run is stopped once it has.
    port = free_port()
    async with (
        rollout_settings(tiny_model_dir) as settings,
        serve_subprocess("rollout", *settings) as first,
        serve_subprocess(
            "trainer", f"trainer.model_path={tiny_model_dir}", f"trainer.runs_root={tmp_path}"
        ) as trainer,
        contextlib.AsyncExitStack() as stack,
    ):
        second = await stack.enter_async_context(serve_subprocess("rollout", *settings, port=port))
        config = run_config(
            {"rollout": f"{first.address},{second.address}"}, tmp_path, run_name="rejoin",
            steps=1000, eval_every=0, checkpoint={"every": 0}, loggers=[],
        )  # fmt: skip
        run_dir = tmp_path / "rejoin"
        async with rpc.open_channel(ClientConfig(address=trainer.address)) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
            async with asyncio.timeout(600):
                await _until(run_dir, lambda live: len(live) >= 1)
                os.kill(second.process.pid, signal.SIGKILL)
                await _until(run_dir, lambda live: 1 in live)
                back = await stack.enter_async_context(
                    serve_subprocess("rollout", *settings, port=port)
                )
                await _until(run_dir, lambda live: live[-2:] == [2, 2])
                stop = trainer_pb2.StopRunRequest(run_name="rejoin", save_checkpoint=False)
                await stub.StopRun(stop, timeout=60)
                await follow(stub, "rejoin")
            request = trainer_pb2.GetRunRequest(run_name="rejoin")
            run = (await stub.GetRun(request, timeout=10)).run
        async with rpc.open_channel(ClientConfig(address=back.address)) as channel:
            stats = await rollout_pb2_grpc.RolloutServiceStub(channel).GetStats(
                rollout_pb2.GetStatsRequest(), timeout=10
            )
    assert run.state == trainer_pb2.Run.State.STATE_STOPPED, run.error_message
    live = _live_replicas(run_dir)
    assert live[0] == 2 and live.index(1) < len(live) - 2, live
    # Back, it took the pushed weights and generated again.
    assert stats.policy_version > 1 and stats.finished_trajectories > 0


def _live_replicas(run_dir) -> list[float]:
    """router/live_replicas of each step the run logged."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [
        record["router/live_replicas"]
        for record in map(json.loads, lines)
        if "router/live_replicas" in record
    ]


async def _until(run_dir, condition) -> None:
    """Returns once `condition` holds of the steps' live replica counts."""
    while not condition(_live_replicas(run_dir)):  # noqa: ASYNC110
        await asyncio.sleep(0.1)
