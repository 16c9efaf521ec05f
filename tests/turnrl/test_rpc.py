"""gRPC plumbing on real loopback servers: status mapping both ways (turnrl error -> status on
the server, status -> turnrl error on `open_channel`'s channels), auth, TLS, limits, deadlines,
retries, graceful drain. Small probe servicers stand in for service logic."""

import asyncio
import contextlib
import datetime
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from turnrl import errors, rpc
from turnrl.config import ClientConfig, ServerConfig, TlsConfig
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc, tool_pb2, tool_pb2_grpc

TOOL_SERVICE = tool_pb2.DESCRIPTOR.services_by_name["ToolService"]
ROLLOUT_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
TOKEN_ENV = "TURNRL_TEST_RPC_TOKEN"


class ProbeToolServicer(tool_pb2_grpc.ToolServiceServicer):
    """Execute behaves as `tool_name` says; ListTools answers after `unavailable` UNAVAILABLEs;
    the rest stay UNIMPLEMENTED."""

    def __init__(self, unavailable: int = 0) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.unavailable = unavailable

    async def ListTools(self, request, context):
        if self.unavailable:
            self.unavailable -= 1
            raise errors.UnavailableError("warming up")
        return tool_pb2.ListToolsResponse(tools=[tool_pb2.ToolInfo(max_concurrency=3)])

    async def Execute(self, request, context):
        if request.tool_name in grpc.StatusCode.__members__:
            await context.abort(grpc.StatusCode[request.tool_name], "probe details")
        if request.tool_name == "block":
            self.started.set()
            await self.release.wait()
            return tool_pb2.ExecuteResponse(result=tool_pb2.ToolResult(text="released"))
        if request.tool_name == "bug":
            raise KeyError("internal-secret-detail")
        error_type = ERRORS_BY_NAME[request.tool_name]
        raise error_type(f"probe failure with {request.arguments!r}")


class ProbeRolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate streams one trajectory, then fails with INVALID_ARGUMENT; PushWeights reads
    every request, then fails with FAILED_PRECONDITION."""

    async def Generate(self, request, context):
        yield rollout_pb2.GenerateResponse()
        raise errors.InvalidArgumentError(f"bad n {request.n!r}")

    async def PushWeights(self, request_iterator, context):
        count = len([request async for request in request_iterator])
        raise errors.FailedPreconditionError(f"paused after {count} requests")


ERRORS_BY_NAME = {error.__name__: error for error in rpc.STATUS_BY_ERROR}


@contextlib.asynccontextmanager
async def running_server(
    config: ServerConfig, servicer=None, service=TOOL_SERVICE
) -> AsyncIterator[rpc.RunningServer]:
    servicer = servicer or ProbeToolServicer()
    add = (
        tool_pb2_grpc.add_ToolServiceServicer_to_server
        if service is TOOL_SERVICE
        else rollout_pb2_grpc.add_RolloutServiceServicer_to_server
    )
    running = await rpc.start_server(config, service, lambda server: add(servicer, server))
    try:
        yield running
    finally:
        await running.server.stop(None)


def client(running: rpc.RunningServer, **kwargs) -> grpc.aio.Channel:
    return rpc.open_channel(ClientConfig(address=f"127.0.0.1:{running.port}", **kwargs))


async def test_serving_health_and_reflection():
    async with running_server(ServerConfig(port=0)) as running, client(running) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="turnrl.v1.ToolService"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = await rpc.list_services(channel, timeout_seconds=5)
        assert "turnrl.v1.ToolService" in services
        assert "grpc.health.v1.Health" in services


@pytest.mark.parametrize(("error_type", "code"), list(rpc.STATUS_BY_ERROR.items()))
async def test_domain_errors_map_to_their_status_and_back(error_type, code):
    async with running_server(ServerConfig(port=0)) as running, client(running) as channel:
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        request = tool_pb2.ExecuteRequest(tool_name=error_type.__name__, arguments="x=41")
        with pytest.raises(errors.RpcError) as info:
            await stub.Execute(request, timeout=5)
    assert info.value.status == code.name
    assert type(info.value) is rpc.RPC_ERROR_BY_STATUS[code]
    assert "'x=41'" in info.value.details


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK])
async def test_every_status_raises_its_turnrl_error(code):
    async with running_server(ServerConfig(port=0)) as running, client(running) as channel:
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(errors.RpcError) as info:
            await stub.Execute(tool_pb2.ExecuteRequest(tool_name=code.name), timeout=5)
    error = info.value
    assert type(error) is rpc.RPC_ERROR_BY_STATUS.get(code, errors.RpcError)
    domain = {c: e for e, c in rpc.STATUS_BY_ERROR.items() if e is not errors.ConfigError}
    if code in domain:
        assert isinstance(error, domain[code])  # `except NotFoundError` catches it too
    assert (error.method, error.status, error.details) == (
        "/turnrl.v1.ToolService/Execute",
        code.name,
        "probe details",
    )
    assert error.address == f"127.0.0.1:{running.port}"
    assert str(error) == (
        f"/turnrl.v1.ToolService/Execute at 127.0.0.1:{running.port} failed: "
        f"{code.name}: probe details"
    )


async def test_unexpected_error_is_internal_without_details(caplog):
    async with running_server(ServerConfig(port=0)) as running, client(running) as channel:
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(errors.RpcError) as info:
            await stub.Execute(tool_pb2.ExecuteRequest(tool_name="bug"), timeout=5)
    assert info.value.status == "INTERNAL"
    assert "internal-secret-detail" not in info.value.details
    assert "internal-secret-detail" in caplog.text  # the traceback is logged on the server


async def test_streaming_error_maps_after_items_were_sent():
    config = ServerConfig(port=0)
    async with (
        running_server(config, ProbeRolloutServicer(), ROLLOUT_SERVICE) as running,
        client(running) as channel,
    ):
        call = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
            rollout_pb2.GenerateRequest(n=-3), timeout=5
        )
        received = []
        with pytest.raises(errors.InvalidArgumentError) as info:
            async for response in call:
                received.append(response)
    assert len(received) == 1
    assert isinstance(info.value, errors.RpcInvalidArgumentError)
    assert info.value.method == "/turnrl.v1.RolloutService/Generate"
    assert "-3" in info.value.details


async def push_requests(count: int):
    for _ in range(count):
        yield rollout_pb2.PushWeightsRequest()


async def test_client_streaming_error_is_raised_when_awaited():
    config = ServerConfig(port=0)
    async with (
        running_server(config, ProbeRolloutServicer(), ROLLOUT_SERVICE) as running,
        client(running) as channel,
    ):
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with pytest.raises(errors.RpcFailedPreconditionError, match="after 3 requests"):
            await stub.PushWeights(push_requests(3), timeout=5)
        call = stub.PushWeights(timeout=5)  # requests written one by one, not an iterator
        for _ in range(2):
            await call.write(rollout_pb2.PushWeightsRequest())
        await call.done_writing()
        with pytest.raises(errors.FailedPreconditionError, match="after 2 requests"):
            await call


async def test_unimplemented_rpc_names_the_method():
    async with running_server(ServerConfig(port=0)) as running, client(running) as channel:
        with pytest.raises(errors.RpcError) as info:
            await tool_pb2_grpc.ToolServiceStub(channel).CalcReward(
                tool_pb2.CalcRewardRequest(), timeout=5
            )
    assert info.value.status == "UNIMPLEMENTED"
    assert "ToolService/CalcReward" in info.value.details


async def test_bearer_token_is_required_except_for_health(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "right-token")
    config = ServerConfig(port=0, auth_token_env=TOKEN_ENV)
    async with running_server(config) as running:
        for token, reason in [(None, "missing bearer token"), ("wrong", "invalid bearer token")]:
            async with client(running) as channel:
                channel_with_token = (
                    rpc.open_channel(channel_config(running), token=token) if token else channel
                )
                async with channel_with_token:
                    stub = tool_pb2_grpc.ToolServiceStub(channel_with_token)
                    with pytest.raises(errors.RpcError) as info:
                        await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
                    assert info.value.status == "UNAUTHENTICATED"
                    assert info.value.details == reason
                    health = await health_pb2_grpc.HealthStub(channel_with_token).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    )
                    assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with rpc.open_channel(channel_config(running), token="right-token") as channel:
            reply = await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_pb2.ListToolsRequest(), timeout=5
            )
            assert reply.tools[0].max_concurrency == 3


async def test_bearer_token_guards_streaming_rpcs(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "right-token")
    config = ServerConfig(port=0, auth_token_env=TOKEN_ENV)
    async with (
        running_server(config, ProbeRolloutServicer(), ROLLOUT_SERVICE) as running,
        client(running) as channel,
    ):
        call = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
            rollout_pb2.GenerateRequest(), timeout=5
        )
        with pytest.raises(errors.RpcError) as info:
            async for _ in call:
                pass
        assert info.value.status == "UNAUTHENTICATED"
        with pytest.raises(errors.RpcError) as info:  # reflection: a bidirectional stream
            await rpc.list_services(channel, timeout_seconds=5)
    assert info.value.status == "UNAUTHENTICATED"
    assert info.value.method == "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def channel_config(running: rpc.RunningServer) -> ClientConfig:
    return ClientConfig(address=f"127.0.0.1:{running.port}")


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files."""
    now = datetime.datetime.now(datetime.UTC)

    def issue(subject_name, issuer_name, public_key, signing_key, *, ca, sans=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = issue("turnrl test CA", "turnrl test CA", ca_key.public_key(), ca_key, ca=True)
    paths = {"ca": folder / "ca.pem"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = issue(name, "turnrl test CA", key.public_key(), ca_key, ca=False, sans=sans)
        paths[f"{name}_cert"] = folder / f"{name}.pem"
        paths[f"{name}_key"] = folder / f"{name}.key"
        paths[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths


async def list_tools(config: ClientConfig) -> tool_pb2.ListToolsResponse:
    async with rpc.open_channel(config) as channel:
        return await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
            tool_pb2.ListToolsRequest(), timeout=3
        )


async def test_tls_server_accepts_tls_clients_only(tmp_path):
    certs = make_certificates(tmp_path)
    tls = TlsConfig(cert_file=certs["server_cert"], key_file=certs["server_key"])
    async with running_server(ServerConfig(port=0, tls=tls)) as running:
        address = f"127.0.0.1:{running.port}"
        reply = await list_tools(ClientConfig(address=address, tls_ca_file=certs["ca"]))
        assert reply.tools[0].max_concurrency == 3
        with pytest.raises(errors.UnavailableError):
            await list_tools(ClientConfig(address=address))


async def test_mutual_tls_requires_a_client_certificate(tmp_path):
    certs = make_certificates(tmp_path)
    tls = TlsConfig(
        cert_file=certs["server_cert"], key_file=certs["server_key"], client_ca_file=certs["ca"]
    )
    async with running_server(ServerConfig(port=0, tls=tls)) as running:
        address = f"127.0.0.1:{running.port}"
        with pytest.raises(errors.UnavailableError):
            await list_tools(ClientConfig(address=address, tls_ca_file=certs["ca"]))
        reply = await list_tools(
            ClientConfig(
                address=address,
                tls_ca_file=certs["ca"],
                tls_cert_file=certs["client_cert"],
                tls_key_file=certs["client_key"],
            )
        )
        assert reply.tools[0].max_concurrency == 3


async def test_missing_tls_file_is_a_config_error(tmp_path):
    tls = TlsConfig(cert_file=tmp_path / "absent.pem", key_file=tmp_path / "absent.key")
    with pytest.raises(errors.ConfigError, match=r"absent\.key"):
        await rpc.start_server(ServerConfig(port=0, tls=tls), TOOL_SERVICE, lambda server: None)


async def test_oversized_request_is_rejected():
    config = ServerConfig(port=0, max_message_bytes=1024)
    async with running_server(config) as running, client(running) as channel:
        request = tool_pb2.ExecuteRequest(tool_name="block", arguments="x" * 4096)
        with pytest.raises(errors.RpcResourceExhaustedError):
            await tool_pb2_grpc.ToolServiceStub(channel).Execute(request, timeout=5)


async def test_bind_conflict_is_an_os_error():
    async with running_server(ServerConfig(port=0)) as running:
        with pytest.raises(OSError, match=f"127.0.0.1:{running.port}"):
            await rpc.start_server(
                ServerConfig(port=running.port), TOOL_SERVICE, lambda server: None
            )


async def test_default_deadline_applies_to_calls_without_timeout():
    servicer = ProbeToolServicer()
    async with (
        running_server(ServerConfig(port=0), servicer) as running,
        client(running, timeout_seconds=0.3) as channel,
    ):
        with pytest.raises(errors.RpcDeadlineExceededError):
            await tool_pb2_grpc.ToolServiceStub(channel).Execute(
                tool_pb2.ExecuteRequest(tool_name="block")
            )
    assert servicer.started.is_set()


async def test_graceful_stop_drains_in_flight_calls():
    servicer = ProbeToolServicer()
    async with (
        running_server(ServerConfig(port=0), servicer) as running,
        client(running) as channel,
    ):
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        call = asyncio.ensure_future(
            stub.Execute(tool_pb2.ExecuteRequest(tool_name="block"), timeout=10)
        )
        await servicer.started.wait()
        stopping = asyncio.create_task(rpc.stop_server(running, grace_seconds=10))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stopping.done()
        watch.cancel()  # an open Watch stream would hold the server for the whole grace
        servicer.release.set()
        reply = await call
        await stopping
    assert reply.result.text == "released"


async def test_stop_cancels_calls_still_running_after_the_grace():
    servicer = ProbeToolServicer()
    async with (
        running_server(ServerConfig(port=0), servicer) as running,
        client(running) as channel,
    ):
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        call = asyncio.ensure_future(
            stub.Execute(tool_pb2.ExecuteRequest(tool_name="block"), timeout=10)
        )
        await servicer.started.wait()
        await rpc.stop_server(running, grace_seconds=0.2)
        with pytest.raises(errors.RpcError) as info:
            await call
    assert info.value.status in ("UNAVAILABLE", "CANCELLED")


async def test_a_failed_watch_stops_the_server_and_is_raised(capsys):
    engine_died = asyncio.Event()

    async def engine_watch() -> None:
        await engine_died.wait()
        raise errors.UnavailableError("the engine's worker failed")

    serving = asyncio.create_task(
        rpc.serve(
            ServerConfig(port=0, shutdown_grace_seconds=1),
            TOOL_SERVICE,
            lambda server: tool_pb2_grpc.add_ToolServiceServicer_to_server(
                ProbeToolServicer(), server
            ),
            metrics=CollectorRegistry(),
            watch=engine_watch,
        )
    )
    printed = ""
    while "serving ToolService on 127.0.0.1:" not in printed:
        await asyncio.sleep(0.01)
        printed += capsys.readouterr().out
    config = ClientConfig(address=printed.split()[-1])
    await rpc.wait_until_serving(config, service=TOOL_SERVICE.full_name, timeout_seconds=5)
    async with rpc.open_channel(config) as channel:
        engine_died.set()
        with pytest.raises(errors.UnavailableError, match="worker failed"):
            await serving
        with pytest.raises(errors.RpcError) as info:
            await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_pb2.ListToolsRequest(), timeout=5
            )
    assert info.value.status == "UNAVAILABLE"
