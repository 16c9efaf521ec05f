"""`turnrl up`: starts the four services, checks them, supervises, stops them all."""

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest
from google.protobuf import struct_pb2

from turnrl import errors, rpc
from turnrl.config import CLIENT_TOKEN_ENV, ClientConfig, HttpJsonServerConfig, ServerConfig
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, tool_pb2, tool_pb2_grpc
from turnrl_cli.processes import replica_overrides
from turnrl_cli.up_table import UP_READY_LINE, UP_TABLE_ROW

from .conftest import (
    EXAMPLE_CONFIG,
    FREE_PORTS,
    SERVICE_NAMES,
    pid_alive,
    run_turnrl,
    serve_subprocess,
    spawn_turnrl,
)

# These start the rollout service, whose default model is the tiny one: build it before the
# services' start-up timeouts begin.
pytestmark = pytest.mark.usefixtures("tiny_model_dir")

SHORT_GRACE = [f"{name}.server.shutdown_grace_seconds=2" for name in SERVICE_NAMES]
GATEWAY_PRINTED = re.compile(r"(rollout(?:#\d+)?)'s OpenAI-compatible gateway: (http://\S+) ")
HTTP_JSON_PRINTED = re.compile(r"(\w+(?:#\d+)?) over HTTP/JSON: (http://\S+) ")


async def test_up_check_starts_checks_and_stops_all_four(example_on_tiny_model):
    code, stdout, stderr = await run_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), "--check", *FREE_PORTS, *example_on_tiny_model
    )
    assert code == 0, stderr
    rows = {name: (address, int(pid)) for name, address, pid in UP_TABLE_ROW.findall(stdout)}
    assert set(rows) == set(SERVICE_NAMES)
    assert len({address for address, _ in rows.values()}) == 4
    assert "check passed" in stdout
    for name in SERVICE_NAMES:
        assert f"turnrl.v1.{name.capitalize()}Service" in stdout
    assert not any(pid_alive(pid) for _, pid in rows.values())


async def test_up_starts_each_replica_and_points_the_rollout_replicas_at_all_peers(
    example_on_tiny_model,
):
    replicas = ["tool.replicas=2", "rollout.replicas=2", "rollout.gateway.enabled=true"]
    replicas += ["tool.server.http_port=0", "reward.server.http_port=0"]
    process = await spawn_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *SHORT_GRACE, *example_on_tiny_model,
        *replicas,
    )  # fmt: skip
    rows: dict[str, tuple[str, int]] = {}
    gateways: dict[str, str] = {}
    http_json: dict[str, str] = {}
    try:
        async with asyncio.timeout(120):
            async for raw in process.stdout:
                if match := UP_TABLE_ROW.search(line := raw.decode()):
                    rows[match.group(1)] = (match.group(2), int(match.group(3)))
                if match := GATEWAY_PRINTED.search(line):
                    gateways[match.group(1)] = match.group(2)
                if match := HTTP_JSON_PRINTED.search(line):
                    http_json[match.group(1)] = match.group(2)
                if UP_READY_LINE in line:
                    break
        assert set(rows) == {"tool", "tool#1", "reward", "rollout", "rollout#1", "trainer"}
        # Each rollout replica's gateway, at the URL `up` printed.
        assert set(gateways) == {"rollout", "rollout#1"}
        async with httpx.AsyncClient() as http:
            for url in gateways.values():
                models = (await http.get(f"{url}/v1/models", timeout=10)).json()
                assert models["object"] == "list" and models["data"]
            # Each tool replica's and the reward service's methods as JSON over HTTP.
            assert set(http_json) == {"tool", "tool#1", "reward"}
            for name, url in http_json.items():
                method = (
                    "ToolService/ListTools"
                    if name.startswith("tool")
                    else "RewardService/ListScorers"
                )
                listed = await http.post(f"{url}/v1/{method}", json={}, timeout=10)
                assert listed.status_code == 200 and listed.json(), (name, listed.text)
        assert len({address for address, _ in rows.values()}) == 6
        tools = f"rollout.tool_service.address={rows['tool'][0]},{rows['tool#1'][0]}"
        for rollout in ("rollout", "rollout#1"):
            command = Path(f"/proc/{rows[rollout][1]}/cmdline").read_bytes().split(b"\0")  # noqa: ASYNC240
            assert tools.encode() in command
    finally:
        process.send_signal(signal.SIGINT)
        await process.communicate()
    assert process.returncode == 0
    assert not any(pid_alive(pid) for _, pid in rows.values())


async def start_up(*overrides: str) -> tuple[asyncio.subprocess.Process, dict[str, int]]:
    """Starts `turnrl up` (supervising) and returns it once all four are SERVING, with pids."""
    process, pids, _ = await start_up_with_addresses(*overrides)
    return process, pids


async def start_up_with_addresses(
    *overrides: str, printed: list[str] | None = None
) -> tuple[asyncio.subprocess.Process, dict[str, int], dict[str, str]]:
    """`start_up`, with each service's address too, and what it printed until then added to
    `printed`."""
    process = await spawn_turnrl("up", *FREE_PORTS, *SHORT_GRACE, *overrides)
    pids: dict[str, int] = {}
    addresses: dict[str, str] = {}
    async with asyncio.timeout(60):
        async for raw in process.stdout:
            line = raw.decode()
            if printed is not None:
                printed.append(line)
            if match := UP_TABLE_ROW.search(line):
                pids[match.group(1)] = int(match.group(3))
                addresses[match.group(1)] = match.group(2)
            if UP_READY_LINE in line:
                break
    assert set(pids) == set(SERVICE_NAMES)
    return process, pids, addresses


async def test_up_restarts_a_service_that_dies_at_its_address(tmp_path):
    process, pids, addresses = await start_up_with_addresses(f"trainer.output_dir={tmp_path}")
    os.kill(pids["reward"], signal.SIGKILL)
    try:
        async with asyncio.timeout(60):
            # The reward service answers again where it was: a new process on the same port.
            await asyncio.sleep(1.0)  # its back-off
            await rpc.wait_until_serving(
                ClientConfig(address=addresses["reward"]), timeout_seconds=60
            )
    finally:
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(60):
            _, stderr = await process.communicate()
    stderr = stderr.decode()
    assert process.returncode == 0, stderr
    assert "reward service (pid" in stderr and "killed by signal 9" in stderr
    assert "restarting it in 1.0s (restart 1 of 5)" in stderr
    assert not any(pid_alive(pid) for pid in pids.values())
    # `turnrl up` keeps each service's output under trainer.output_dir; a restart appends.
    log = (tmp_path / "logs" / "reward.log").read_text()
    assert log.count("serving RewardService on ") == 2
    assert log.index("turnrl: start of") < log.index("turnrl: restart 1 of the reward service")


async def test_up_stops_everything_when_a_service_it_does_not_restart_dies():
    process, pids = await start_up("launcher.restart.rollout.mode=never")
    os.kill(pids["rollout"], signal.SIGKILL)
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    stderr = stderr.decode()
    assert process.returncode == 1
    assert "rollout service" in stderr and "killed by signal 9" in stderr
    assert not any(pid_alive(pid) for pid in pids.values())


async def test_up_stops_cleanly_on_ctrl_c():
    process, pids = await start_up()
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr
    assert "stopping all services" in stdout.decode()
    assert not any(pid_alive(pid) for pid in pids.values())
    for name in SERVICE_NAMES:
        assert f"[{name}]" in stderr.decode() and "shutting down" in stderr.decode()


async def test_up_reports_a_service_that_cannot_start():
    # Two services on one fixed port: the second cannot bind, and up names it and why.
    async with serve_subprocess("tool") as served:
        port = served.address.rsplit(":", 1)[1]
        code, _, stderr = await run_turnrl(
            "up", "--check", *FREE_PORTS, f"reward.server.port={port}"
        )
    assert code == 1
    assert "reward service" in stderr and "exited with code 1" in stderr
    assert f"127.0.0.1:{port}" in stderr


async def test_up_gives_up_on_a_service_slower_to_start_than_its_timeout():
    # No service comes up within a millisecond: the first started is named, with the setting.
    code, _, stderr = await run_turnrl(
        "up", "--check", *FREE_PORTS, "launcher.startup_timeout_seconds=0.001"
    )
    assert code == 1
    assert "tool service" in stderr
    message = " ".join(stderr.split())  # as printed, wrapped to the terminal
    assert "did not report SERVING within 0.001s (launcher.startup_timeout_seconds)" in message


async def test_up_rejects_a_bad_config_naming_the_key():
    code, _, stderr = await run_turnrl("up", "--check", "rollout.server.max_message_bytes=-1")
    assert code == 2
    assert "rollout.server.max_message_bytes" in stderr


async def test_up_starts_only_the_services_the_config_does_not_point_at():
    async with serve_subprocess("tool") as tool:
        code, stdout, stderr = await run_turnrl(
            "up", "--check", *FREE_PORTS, f"rollout.tool_service.address={tool.address}"
        )
        # The rollout service it started calls the external tool service.
        assert code == 0, stderr
        rows = {name: address for name, address, _ in UP_TABLE_ROW.findall(stdout)}
        assert set(rows) == {"reward", "rollout", "trainer"}
        assert "check passed: 3 services" in stdout
        assert tool.process.returncode is None  # up stopped only what it started


def calculator_generate_request() -> rollout_pb2.GenerateRequest:
    """One scored calculator problem, which may call the tool service."""
    text = common_pb2.ContentPart(text="What is 2 + 3? Use the calculator.")
    prompt = rollout_pb2.RolloutPrompt(
        messages=[common_pb2.Message(role=common_pb2.Message.ROLE_USER, content=[text])],
        tool_names=["calculator"],
        data_source="openai/gsm8k",
        ground_truth=struct_pb2.Value(string_value="5"),
    )
    return rollout_pb2.GenerateRequest(prompts=[prompt], enable_scoring=True, max_turns=2)


async def test_up_makes_a_token_for_services_other_machines_reach():
    printed: list[str] = []
    exposed = [f"{name}.server.host=0.0.0.0" for name in SERVICE_NAMES]
    process, pids, addresses = await start_up_with_addresses(*exposed, printed=printed)
    try:
        (token,) = re.findall(rf"export {CLIENT_TOKEN_ENV}=(\S+)", "".join(printed))
        async with rpc.open_channel(ClientConfig(address=addresses["tool"])) as channel:
            stub = tool_pb2_grpc.ToolServiceStub(channel)
            with pytest.raises(errors.RpcError) as refused:
                await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=10)
        async with rpc.open_channel(
            ClientConfig(address=addresses["tool"]), token=token
        ) as channel:
            listed = await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_pb2.ListToolsRequest(), timeout=10
            )
        # The rollout service calls the tool and reward services with it: a trajectory runs.
        async with rpc.open_channel(
            ClientConfig(address=addresses["rollout"]), token=token
        ) as channel:
            generated = [
                reply
                async for reply in rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
                    calculator_generate_request(), timeout=120
                )
            ]
        command_lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids.values()]  # noqa: ASYNC240
    finally:
        process.send_signal(signal.SIGINT)
        await process.communicate()
    assert refused.value.status == "UNAUTHENTICATED"
    assert "calculator" in [tool.schema.name for tool in listed.tools]
    (trajectory,) = [reply.trajectory for reply in generated]
    assert (
        not trajectory.reward.error and trajectory.finish_reason != common_pb2.FINISH_REASON_ERROR
    )
    assert not any(token.encode() in line for line in command_lines)  # `ps` shows these


async def test_up_without_a_token_refuses_to_expose_a_service():
    code, _, stderr = await run_turnrl(
        "up", "--check", *FREE_PORTS, "tool.server.host=0.0.0.0", "launcher.auth_token=none"
    )
    assert code == 1
    assert "tool service" in stderr and "is reachable from other machines" in stderr
    assert "server.allow_insecure" in stderr


def test_replicas_past_the_first_take_free_ports_where_the_config_fixes_them():
    tool = HttpJsonServerConfig(port=50051, metrics_port=9100, http_port=8051)
    assert replica_overrides("tool", 0, tool) == []
    assert replica_overrides("tool", 1, tool) == [
        "tool.server.port=0",
        "tool.server.metrics_port=0",
        "tool.server.http_port=0",
    ]
    assert replica_overrides("rollout", 1, ServerConfig(port=50053)) == ["rollout.server.port=0"]
