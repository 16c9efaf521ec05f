"""The SGLang engine's weight pushes against the weight routes of SGLang 0.5.23, as the stand-in
(`sglang_stand_in_weights`) reproduces them: every push inside a weight-update session (its
rules: one at a time, required for a distributed update, left open by a failure), servers from
before sessions, and flattened buckets of several dtypes."""

import asyncio
import datetime

import httpx
import pytest
import torch

from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from tests.rollout_svc.sglang_stand_in import (
    MAX_MODEL_LEN,
    MODEL_PATH,
    WAIT_SECONDS,
    SglangStandIn,
    engine_options,
)
from tests.rollout_svc.test_sglang_engine import engine as engine
from tests.rollout_svc.test_sglang_engine import stand_in as stand_in
from tests.rollout_svc.test_sglang_engine import weight_group
from tests.rollout_svc.test_sglang_engine_weights import SPECS, metas_of
from tests.tool_svc.http_stand_in import serve_app
from turnrl.errors import FailedPreconditionError
from turnrl.weight_group import broadcast, form_group, host_store, leave_group

# SGLang 0.5.23's words (managers/scheduler_components/weight_updater.py).
NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
SESSION_PATHS = ("/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update")


def weight_calls(stand_in: SglangStandIn) -> list[str]:
    return [path for path in stand_in.paths() if path in SESSION_PATHS]


async def push(engine: SglangEngine, name: str, version: int) -> None:
    async with weight_group(engine, SPECS, name=name) as sent:
        await engine.receive_weights(name, metas_of(sent), 2048, "per_tensor", version)


async def test_every_push_runs_in_one_weight_update_session(stand_in, engine):
    await engine.pause()
    await push(engine, "g", 1)
    await push(engine, "g2", 2)
    # The first push closes a session an earlier client may have left open (none here).
    one_push = [
        "/begin_weight_update", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/end_weight_update",
    ]  # fmt: skip
    assert weight_calls(stand_in) == ["/end_weight_update", *one_push, *one_push]
    assert stand_in.bodies("/begin_weight_update") == [{}, {}]
    assert not stand_in.weight_routes.session_open
    assert engine.policy_version == 2


async def test_the_stand_in_refuses_an_update_outside_a_session_before_receiving(stand_in):
    """SGLang 0.5.23 answers success=false before it looks at the group or receives."""
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "none"}
    async with httpx.AsyncClient(base_url=stand_in.url, trust_env=False) as client:
        refused = await client.post("/update_weights_from_distributed", json=body)
        assert (refused.status_code, refused.json()) == (
            400,
            {"success": False, "message": NO_SESSION},
        )
        assert (await client.post("/begin_weight_update", json={})).status_code == 200
        again = await client.post("/begin_weight_update", json={})
        assert again.json()["message"].startswith("a weight-update session is already open")
        in_session = await client.post("/update_weights_from_distributed", json=body)
        assert "Group none not in []" in in_session.json()["message"]
        assert stand_in.weight_routes.session_open  # a failed update leaves it open
        assert (await client.post("/end_weight_update", json={})).status_code == 200
        closed = await client.post("/end_weight_update", json={})
        assert (closed.status_code, closed.json()["success"]) == (400, False)


async def test_a_failed_push_closes_its_session_and_the_next_push_opens_one(stand_in, engine):
    await engine.pause()
    async with weight_group(engine, SPECS, die_after_buckets=1) as sent:
        with pytest.raises(FailedPreconditionError, match="Failed to receive weights"):
            await engine.receive_weights("g", metas_of(sent), 2048, "per_tensor", 1)
    assert weight_calls(stand_in)[-1] == "/end_weight_update"
    assert not stand_in.weight_routes.session_open
    await push(engine, "again", 1)
    assert engine.stats()["weights_incomplete"] == 0.0


async def test_a_session_left_open_on_the_server_is_closed_before_the_push(stand_in, engine):
    stand_in.weight_routes.session_open = True  # a client before this one died in its push
    await engine.pause()
    await push(engine, "g", 1)
    assert weight_calls(stand_in)[:2] == ["/end_weight_update", "/begin_weight_update"]
    assert engine.policy_version == 1


async def test_a_server_from_before_sessions_is_updated_without(stand_in, engine):
    stand_in.weight_routes.sessions = False  # SGLang before 0.5.21: no such routes
    await engine.pause()
    await push(engine, "g", 1)
    await push(engine, "g2", 2)
    assert weight_calls(stand_in) == [
        "/end_weight_update", "/begin_weight_update",  # both 404: asked once
        *["/update_weights_from_distributed"] * 4,
    ]  # fmt: skip
    assert engine.policy_version == 2


@pytest.fixture
async def trainer_group(stand_in, engine):
    """A gloo group of two: this test's process as the trainer (rank 0, yielded) and the
    stand-in server, joined through the engine."""
    timeout = datetime.timedelta(seconds=WAIT_SECONDS)
    store = await asyncio.to_thread(host_store, "127.0.0.1", 0, 2, timeout)
    group, _ = await asyncio.gather(
        asyncio.to_thread(form_group, store, 0, 2, "gloo", "g", timeout),
        engine.join_weight_sync("127.0.0.1", store.port, 2, 1, "gloo", "g", WAIT_SECONDS),
    )
    try:
        yield group
    finally:
        leave_group(group)


async def test_the_stand_in_takes_a_flattened_bucket_of_several_dtypes(
    stand_in, engine, trainer_group
):
    """As SGLang 0.5.23's FlattenedTensorBucket: the tensors' bytes end to end in one uint8
    broadcast, each at an offset its dtype's size divides."""
    sent = {
        "a": torch.randn(8),
        "b": torch.randn(16).to(torch.bfloat16),
        "c": torch.randn(2, 3),
    }
    flat = torch.cat([tensor.reshape(-1).view(torch.uint8) for tensor in sent.values()])
    await engine.pause()
    await asyncio.gather(
        engine.update_weights_from_distributed(
            list(sent), [t.dtype for t in sent.values()], [t.shape for t in sent.values()], 1,
            group_name="g", flattened=True,
        ),
        asyncio.to_thread(broadcast, trainer_group, flat),
    )  # fmt: skip
    for name, tensor in sent.items():
        assert torch.equal(stand_in.weights[name], tensor), name
    # A float32 tensor 6 bytes in is refused before anything is received.
    odd = {"d": torch.randn(3).to(torch.bfloat16), "e": torch.randn(2)}
    with pytest.raises(FailedPreconditionError, match="Unaligned received tensor: byte offset 6"):
        await engine.update_weights_from_distributed(
            list(odd), [t.dtype for t in odd.values()], [t.shape for t in odd.values()], 2,
            group_name="g", flattened=True,
        )  # fmt: skip
    assert "d" not in stand_in.weights


async def test_the_server_joins_with_every_tensor_parallel_rank():
    stand_in = SglangStandIn(tp_size=2)
    async with serve_app(stand_in.app()) as url:
        options = SglangEngineOptions(url=url, **engine_options())
        engine = await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)
        timeout = datetime.timedelta(seconds=WAIT_SECONDS)
        store = await asyncio.to_thread(host_store, "127.0.0.1", 0, 3, timeout)
        try:
            assert engine.weight_sync_ranks == 2
            group, _ = await asyncio.gather(
                asyncio.to_thread(form_group, store, 0, 3, "gloo", "g", timeout),
                engine.join_weight_sync("127.0.0.1", store.port, 3, 1, "gloo", "g", WAIT_SECONDS),
            )
            weight = torch.randn(4)
            await engine.pause()
            await asyncio.gather(
                engine.update_weights_from_distributed(
                    ["w"], [weight.dtype], [weight.shape], 1, group_name="g"
                ),
                asyncio.to_thread(broadcast, group, weight),
            )
            leave_group(group)
            for rank_weights in stand_in.weight_routes.rank_weights:
                assert torch.equal(rank_weights["w"], weight)
        finally:
            await engine.close()
            stand_in.leave_groups()
