"""ReplicaSet on real tool services on loopback: which replica each call goes to, pins, and a
replica that stops and comes back."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.in_process_services import tool_service_address
from turnrl.config import ClientConfig, load_config_data, validate_config
from turnrl.errors import ConfigError, UnavailableError
from turnrl.replicas import ReplicaSet
from turnrl.v1 import tool_pb2, tool_pb2_grpc

# Longer than gRPC's first reconnect back-off (1 s, jittered by up to 20%), so a replica that
# restarts within the cooldown is reachable when the cooldown ends.
COOLDOWN_SECONDS = 1.5


@contextlib.asynccontextmanager
async def replica_set(*addresses: str) -> AsyncIterator[ReplicaSet[tool_pb2_grpc.ToolServiceStub]]:
    replicas = ReplicaSet(
        ClientConfig(address=",".join(addresses), timeout_seconds=5),
        tool_pb2_grpc.ToolServiceStub,
        cooldown_seconds=COOLDOWN_SECONDS,
    )
    try:
        yield replicas
    finally:
        await replicas.close()


async def list_tools(replicas: ReplicaSet[tool_pb2_grpc.ToolServiceStub], key: str = "") -> str:
    """Calls ListTools through `replicas`; the address of the replica that answered."""
    with replicas.call(key) as replica:
        await replica.stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
    return replica.address


def test_an_address_lists_replicas_comma_separated():
    data, overrides = load_config_data(None, ["address=127.0.0.1:1, 127.0.0.1:2"])
    config = validate_config(ClientConfig, data, path=None, overrides=overrides)
    assert config.addresses() == ["127.0.0.1:1", "127.0.0.1:2"]
    assert config.for_address("127.0.0.1:2").addresses() == ["127.0.0.1:2"]
    assert ClientConfig(address="127.0.0.1:1").addresses() == ["127.0.0.1:1"]


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("a:1,,b:2", "address 'a:1,,b:2' has an empty entry"),
        ("a:1,b:2, a:1", r"address 'a:1,b:2, a:1' lists \['a:1'\] more than once"),
    ],
)
def test_an_empty_or_repeated_replica_is_refused(address, message):
    data, overrides = load_config_data(None, [f"address={address}"])
    with pytest.raises(ConfigError, match=f"override 'address={address}': address: .*{message}"):
        validate_config(ClientConfig, data, path=None, overrides=overrides)


async def test_one_address_is_one_replica_that_takes_every_call():
    async with tool_service_address() as address, replica_set(address) as replicas:
        assert [replica.address for replica in replicas.replicas] == [address]
        assert [await list_tools(replicas) for _ in range(3)] == [address] * 3
    async with replica_set("127.0.0.1:1") as replicas:  # nothing listens there
        for _ in range(2):  # still its only replica after an UNAVAILABLE
            with pytest.raises(UnavailableError, match=r"at 127\.0\.0\.1:1 failed"):
                await list_tools(replicas)
        assert replicas.unavailable_answers == 2  # counted for the caller's metrics


async def test_calls_take_turns_when_none_is_in_flight():
    async with (
        tool_service_address() as a,
        tool_service_address() as b,
        replica_set(a, b) as replicas,
    ):
        assert [await list_tools(replicas) for _ in range(4)] == [a, b, a, b]


async def test_a_call_goes_to_the_replica_with_the_fewest_calls_in_flight():
    async with (
        tool_service_address() as a,
        tool_service_address() as b,
        replica_set(a, b) as replicas,
    ):
        with replicas.call() as busy:
            assert busy.address == a and busy.in_flight == 1
            assert [await list_tools(replicas) for _ in range(3)] == [b] * 3
            with replicas.call() as second, replicas.call() as third:
                assert (second.address, third.address) == (b, a)  # 1 and 1: a tie
        assert [replica.in_flight for replica in replicas.replicas] == [0, 0]


async def test_a_pinned_key_sticks_to_its_replica_until_unpinned():
    async with (
        tool_service_address() as a,
        tool_service_address() as b,
        replica_set(a, b) as replicas,
    ):
        replicas.pin("session-1", replicas.replicas[1])
        with replicas.call("session-1"):  # b is busier now, and still gets the key
            assert [await list_tools(replicas, "session-1") for _ in range(3)] == [b] * 3
            assert await list_tools(replicas) == a
        replicas.unpin("session-1")
        with replicas.call() as busy:
            assert busy.address == b
            assert await list_tools(replicas, "session-1") == a


async def test_a_stopped_replica_is_passed_over_for_the_cooldown_then_used_again():
    async with (
        tool_service_address() as a,
        contextlib.AsyncExitStack() as b_lifetime,
    ):
        b = await b_lifetime.enter_async_context(tool_service_address())
        async with replica_set(a, b) as replicas:
            assert [await list_tools(replicas) for _ in range(2)] == [a, b]
            await b_lifetime.aclose()  # b stops
            assert await list_tools(replicas) == a
            with pytest.raises(UnavailableError, match=f"at {b} failed"):
                await list_tools(replicas)  # b's turn
            assert [await list_tools(replicas) for _ in range(4)] == [a] * 4
            # A call pinned to b still goes there: what the key names lives there.
            replicas.pin("session-on-b", replicas.replicas[1])
            with pytest.raises(UnavailableError, match=f"at {b} failed"):
                await list_tools(replicas, "session-on-b")
            replicas.unpin("session-on-b")
            port = int(b.rsplit(":", 1)[1])
            async with tool_service_address(port=port):  # b is back, on its old port
                await asyncio.sleep(COOLDOWN_SECONDS)  # the cooldown is what is under test
                assert [await list_tools(replicas) for _ in range(4)] == [b, a, b, a]
