"""Every built-in tool end to end: one `turnrl serve tool` process serving all of them, called
over gRPC on loopback as a rollout service would (sessions created and released per call)."""

import json
import sys
from pathlib import Path

import yaml
from google.protobuf import struct_pb2

from tests.conftest import run_turnrl, serve_subprocess
from tests.tool_svc.test_sandbox_fusion import sandbox  # noqa: F401 - the stand-in server fixture
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import tool_pb2, tool_pb2_grpc


def write_config(tmp_path: Path, fixtures: Path, sandbox_url: str) -> Path:
    passages = (fixtures / "search" / "wiki18_dpr_sample_1000.jsonl").read_text().splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(passages[:50]) + "\n")
    tools = [
        {"class_name": "calculator"},
        {"class_name": "gsm8k_answer"},
        {"class_name": "python", "config": {"wall_timeout_seconds": 5}},
        {
            "class_name": "search",
            "config": {"corpus_path": str(corpus), "index_cache_dir": str(tmp_path / "index")},
        },
        {
            "class_name": "mcp",
            "name": "time",
            "config": {
                "command": [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
            },
        },
        {"class_name": "sandbox_fusion", "config": {"url": sandbox_url}},
    ]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tool": {"tools": tools}}))
    return path


async def call(stub, tool: str, arguments: dict, session_kwargs: dict | None = None):
    session_id = ""
    if session_kwargs is not None:
        kwargs = struct_pb2.Struct()
        kwargs.update(session_kwargs)
        created = await stub.CreateSession(
            tool_pb2.CreateSessionRequest(tool_name=tool, session_kwargs=kwargs), timeout=10
        )
        session_id = created.session_id
    try:
        request = tool_pb2.ExecuteRequest(
            tool_name=tool, arguments=json.dumps(arguments), session_id=session_id
        )
        return (await stub.Execute(request, timeout=30)).result
    finally:
        if session_id:
            release = tool_pb2.ReleaseSessionRequest(session_id=session_id)
            assert (await stub.ReleaseSession(release, timeout=10)).released


async def test_every_tool_through_one_service(tmp_path, fixtures, sandbox):  # noqa: F811
    config = write_config(tmp_path, fixtures, sandbox.url)
    first_passage = json.loads(
        (fixtures / "search" / "wiki18_dpr_sample_1000.jsonl").open().readline()
    )
    title = first_passage["contents"].split("\n", 1)[0].strip('"')
    async with serve_subprocess("tool", "--config", str(config)) as served:
        code, stdout, _ = await run_turnrl("tool", "list", "--addr", served.address)
        assert code == 0
        names = {tool["function"]["name"] for tool in json.loads(stdout)}
        assert {"calculator", "gsm8k_answer", "python", "search", "code_interpreter"} <= names
        assert {"time_get_current_time", "time_convert_time"} <= names

        async with rpc.open_channel(ClientConfig(address=served.address)) as channel:
            stub = tool_pb2_grpc.ToolServiceStub(channel)
            assert (await call(stub, "calculator", {"expression": "17 * 3"})).text == "51"
            graded = await call(stub, "gsm8k_answer", {"answer": "51"}, {"ground_truth": "#### 51"})
            assert graded.text == "Your answer 51 is correct."
            ran = await call(stub, "python", {"code": "print(sum(range(10)))"})
            assert ran.text.strip() == "45" and not ran.HasField("error")
            found = await call(stub, "search", {"query": title})
            assert found.text.startswith(f"Doc 1(Title: {title})")
            converted = await call(
                stub,
                "time_convert_time",
                {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
            )
            assert "21:00" in converted.text and not converted.HasField("error")
            remote = await call(stub, "code_interpreter", {"code": "print(2 ** 5)"})
            assert remote.text.strip() == "32" and sandbox.requests[-1]["code"] == "print(2 ** 5)"
