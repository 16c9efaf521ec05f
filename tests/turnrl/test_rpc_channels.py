"""turnrl/rpc/channels.py: client calls that are safe to repeat are tried again on UNAVAILABLE,
within the caller's deadline; waiting for a server; channels to one address only."""

import grpc
import pytest

from turnrl import errors, rpc
from turnrl.config import ClientConfig, ServerConfig
from turnrl.v1 import tool_pb2, tool_pb2_grpc

from .test_rpc import ProbeToolServicer, client, running_server


def rpc_error(code: grpc.StatusCode) -> errors.RpcError:
    return rpc.RPC_ERROR_BY_STATUS.get(code, errors.RpcError)(
        "probe", method="/probe", address="probe:1", status=code.name, details="probe"
    )


class FlakyMethod:
    """A unary stub method that fails with the given errors before it answers."""

    def __init__(self, *failures: grpc.StatusCode) -> None:
        self.failures = list(failures)
        self.timeouts: list[float] = []

    async def __call__(self, request, *, timeout):  # noqa: ASYNC109 - a gRPC stub method signature
        self.timeouts.append(timeout)
        if self.failures:
            raise rpc_error(self.failures.pop(0))
        return f"answer to {request}"


async def test_idempotent_call_retries_unavailable():
    method = FlakyMethod(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    reply = await rpc.call_idempotent(method, "q", timeout_seconds=10, max_attempts=3)
    assert reply == "answer to q"
    assert len(method.timeouts) == 3
    assert method.timeouts[0] > method.timeouts[-1]  # each try gets what is left of the deadline


async def test_idempotent_call_does_not_retry_other_codes():
    method = FlakyMethod(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(errors.InvalidArgumentError):
        await rpc.call_idempotent(method, "q", timeout_seconds=10, max_attempts=3)
    assert len(method.timeouts) == 1


async def test_idempotent_call_gives_up_after_max_attempts():
    method = FlakyMethod(*[grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(errors.UnavailableError):
        await rpc.call_idempotent(method, "q", timeout_seconds=10, max_attempts=2)
    assert len(method.timeouts) == 2


async def test_idempotent_call_never_retries_past_the_deadline():
    method = FlakyMethod(*[grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(errors.UnavailableError):
        await rpc.call_idempotent(method, "q", timeout_seconds=0.3, max_attempts=100)
    assert 1 <= len(method.timeouts) < 100


async def test_idempotent_call_retries_unavailable_from_a_real_server():
    servicer = ProbeToolServicer(unavailable=2)
    async with (
        running_server(ServerConfig(port=0), servicer) as running,
        client(running) as channel,
    ):
        reply = await rpc.call_idempotent(
            tool_pb2_grpc.ToolServiceStub(channel).ListTools,
            tool_pb2.ListToolsRequest(),
            timeout_seconds=5,
            max_attempts=3,
        )
        assert reply.tools[0].max_concurrency == 3
        assert servicer.unavailable == 0
        servicer.unavailable = 2
        with pytest.raises(errors.RpcUnavailableError, match="UNAVAILABLE: warming up"):
            await rpc.call_idempotent(
                tool_pb2_grpc.ToolServiceStub(channel).ListTools,
                tool_pb2.ListToolsRequest(),
                timeout_seconds=5,
                max_attempts=2,
            )


async def test_wait_until_serving_names_the_address_on_timeout():
    async with running_server(ServerConfig(port=0)) as running:
        port = running.port
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} not SERVING"):
        await rpc.wait_until_serving(ClientConfig(address=f"127.0.0.1:{port}"), timeout_seconds=0.5)


def test_a_channel_to_several_replicas_is_refused():
    # Only the replica-aware callers (turnrl/replicas.py, trainer_svc/rollout_router.py) take
    # a list; a plain channel to "a,b" would fail at its first call with a gRPC target error.
    with pytest.raises(errors.ConfigError, match="names several replicas"):
        rpc.open_channel(ClientConfig(address="127.0.0.1:1,127.0.0.1:2"))
