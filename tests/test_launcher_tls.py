"""The TLS a launch makes for itself (`launcher.tls`, turnrl_cli.launch_tls): when, and that its
services then serve TLS only, verified with the launch's CA, token and traffic end to end.
The local launcher (`launcher.tls=on`) goes the same way as Ray's; `test_ray_launcher.py`
checks a Ray launch's services (TLS by default there)."""

import asyncio
import json
import re
import signal
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLE_CONFIG, FREE_PORTS, run_turnrl, spawn_turnrl
from turnrl import errors, rpc
from turnrl.config import CLIENT_TOKEN_ENV, ClientConfig
from turnrl.v1 import tool_pb2, tool_pb2_grpc
from turnrl_cli.launch_tls import needs_launch_tls
from turnrl_cli.project_config import load_project_config
from turnrl_cli.up_table import UP_TABLE_ROW

pytestmark = pytest.mark.usefixtures("tiny_model_dir")


@pytest.mark.parametrize(
    ("overrides", "needed"),
    [
        ([], False),  # local, every service on 127.0.0.1
        (["launcher.tls=on"], True),
        (["launcher.kind=ray"], True),  # each service binds its node's address
        (["launcher.kind=ray", "launcher.tls=off"], False),
        # Every service has TLS of its own: nothing to make.
        (
            [
                "launcher.kind=ray",
                *(
                    f"{name}.server.tls.{kind}_file=/etc/{name}.pem"
                    for name in ("tool", "reward", "rollout", "trainer")
                    for kind in ("cert", "key")
                ),
            ],
            False,
        ),
    ],
)
def test_a_launch_makes_its_tls_when_its_services_are_exposed(overrides, needed):
    assert needs_launch_tls(load_project_config(None, [*FREE_PORTS, *overrides])) is needed


async def _list_tools(config: ClientConfig) -> str:
    """The status of ListTools at `config`'s address: OK, or the failure's."""
    async with rpc.open_channel(config) as channel:
        try:
            await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_pb2.ListToolsRequest(), timeout=10
            )
        except errors.RpcError as e:
            return e.status
    return "OK"


async def test_with_launcher_tls_a_service_refuses_plaintext_and_serves_the_launch_ca(
    example_on_tiny_model,
):
    process = await spawn_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *example_on_tiny_model,
        "launcher.tls=on", "launcher.auth_token=generate",
    )  # fmt: skip
    printed = []
    try:
        async with asyncio.timeout(120):
            async for raw in process.stdout:
                printed.append(line := raw.decode())
                if "Ctrl-C stops them" in line:
                    break
        text = "".join(printed)
        tool = next(m.group(2) for m in UP_TABLE_ROW.finditer(text) if m.group(1) == "tool")
        token = re.search(rf"export {CLIENT_TOKEN_ENV}=(\S+)", text).group(1)
        ca_file = re.search(r"--tls-ca (\S+)", text).group(1)
        with_tls = ClientConfig(address=tool, tls_ca_file=ca_file)
        async with rpc.open_channel(with_tls, token=token) as channel:
            reply = await tool_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_pb2.ListToolsRequest(), timeout=10
            )
        plaintext = await _list_tools(ClientConfig(address=tool))
        without_token = await _list_tools(with_tls)
    finally:
        process.send_signal(signal.SIGINT)
        await process.communicate()
    assert len(reply.tools) == 1  # the calculator
    assert plaintext == "UNAVAILABLE"  # no plaintext handshake succeeds
    assert without_token == "UNAUTHENTICATED"  # TLS does not stand in for the token
    assert process.returncode == 0
    assert not Path(ca_file).parent.exists()  # the launch's certificates and CA key are gone


async def test_a_run_with_launcher_tls_goes_through_every_service(tmp_path, example_on_tiny_model):
    code, _, stderr = await run_turnrl(
        "run", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *example_on_tiny_model,
        "launcher.tls=on", "launcher.auth_token=generate",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=tls", "trainer.steps=1",
        "trainer.eval_every=0", "trainer.checkpoint.every=0",
        "trainer.rollout.prompts_per_step=2", "trainer.rollout.samples_per_prompt=2",
        timeout_seconds=300,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    run_dir = tmp_path / "tls"
    rollout_client = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"][
        "rollout_service"
    ]
    assert rollout_client["tls_ca_file"].endswith("/ca.pem")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 1
    # The rollout service reached the tool and reward services over TLS: nothing failed.
    assert steps[0]["rollout/infra_failed_trajectories"] == 0
    assert steps[0]["rollout/tool_errors"] == 0
