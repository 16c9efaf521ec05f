"""Each service started with `turnrl serve` as a real subprocess on a free loopback port."""

import asyncio
import signal

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnrl import errors, rpc
from turnrl.config import ClientConfig
from turnrl.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    tool_pb2,
    tool_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from .conftest import SERVICE_NAMES, run_turnrl, serve_subprocess

# These start the rollout service, whose default model is the tiny one: build it before the
# services' start-up timeouts begin.
pytestmark = pytest.mark.usefixtures("tiny_model_dir")

TOKEN_ENV = "TURNRL_TEST_SERVE_TOKEN"
TOKEN = "serve-test-token"
GRACE_SECONDS = 3.0
# One unary RPC of each service, called to show that auth guards it. The trainer's asks for a
# run that does not exist, which an authenticated caller learns with NOT_FOUND.
UNARY_PROBES = {
    "tool": lambda ch: tool_pb2_grpc.ToolServiceStub(ch).ListTools(tool_pb2.ListToolsRequest()),
    "reward": lambda ch: reward_pb2_grpc.RewardServiceStub(ch).ListScorers(
        reward_pb2.ListScorersRequest()
    ),
    "rollout": lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).GetStats(
        rollout_pb2.GetStatsRequest()
    ),
    "trainer": lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).GetRun(
        trainer_pb2.GetRunRequest(run_name="r")
    ),
}


def full_name(service: str) -> str:
    return f"turnrl.v1.{service.capitalize()}Service"


@pytest.mark.parametrize("service", SERVICE_NAMES)
async def test_serve_health_reflection_auth_and_sigterm(service):
    overrides = [
        f"{service}.server.auth_token_env={TOKEN_ENV}",
        f"{service}.server.shutdown_grace_seconds={GRACE_SECONDS}",
    ]
    async with serve_subprocess(service, *overrides, env={TOKEN_ENV: TOKEN}) as served:
        assert served.address.startswith("127.0.0.1:")
        config = ClientConfig(address=served.address)

        async with rpc.open_channel(config) as channel:  # no token: health only
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=full_name(service)), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(errors.RpcError) as info:
                await UNARY_PROBES[service](channel)
            assert info.value.status == "UNAUTHENTICATED"

        async with rpc.open_channel(config, token="wrong") as channel:
            # A unary call: a stream refused before the client has sent its request can fail
            # on the client's side with INTERNAL ("execute_batch") instead of the server's code.
            with pytest.raises(errors.RpcError) as info:
                await UNARY_PROBES[service](channel)
            assert info.value.status == "UNAUTHENTICATED"

        async with rpc.open_channel(config, token=TOKEN) as channel:
            assert full_name(service) in await rpc.list_services(channel, timeout_seconds=10)
            if service == "trainer":
                with pytest.raises(errors.NotFoundError):
                    await UNARY_PROBES[service](channel)
            else:
                await UNARY_PROBES[service](channel)

        served.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(GRACE_SECONDS + 5):
            code = await served.process.wait()
        assert code == 0


async def test_serve_refuses_a_port_in_use():
    async with serve_subprocess("tool") as served:
        port = served.address.rsplit(":", 1)[1]
        code, _, stderr = await run_turnrl("serve", "reward", "--port", port)
    assert code == 1
    assert f"127.0.0.1:{port}" in stderr


async def test_serve_rejects_a_bad_config_key_naming_it():
    code, _, stderr = await run_turnrl("serve", "tool", "tool.server.prot=1")
    assert code == 2
    assert "'tool.server.prot'" in stderr and "override" in stderr


async def test_serve_requires_the_token_variable_it_names():
    code, _, stderr = await run_turnrl(
        "serve", "tool", "--port", "0", "tool.server.auth_token_env=TURNRL_TEST_NOT_SET"
    )
    assert code == 2
    assert "TURNRL_TEST_NOT_SET" in stderr
