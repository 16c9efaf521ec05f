"""The `mcp` tool against real MCP servers: mcp-server-time over stdio, an MCPServer over HTTP."""

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pydantic
import pytest
import pytest_asyncio
import uvicorn
from mcp import types
from mcp.server.mcpserver import Audio, Context, Image, MCPServer

from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.mcp import McpTool

# A real 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
LONG_NAME = "x" * 80

# Every test and fixture here runs in one event loop, so the module-scoped server can be shared.
pytestmark = pytest.mark.asyncio(loop_scope="module")


def _child_pids(marker: str) -> list[int]:
    """Live (not zombie) children of this process whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if int(stat[1]) == os.getpid() and stat[0] != "Z" and marker in cmdline:
                pids.append(int(entry.name))
    return pids


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _time_server(local_timezone: str) -> list[str]:
    # The local timezone also tells the servers of different tests apart in `_child_pids`.
    return [sys.executable, "-m", "mcp_server_time", "--local-timezone", local_timezone]


@contextlib.asynccontextmanager
async def _time_tools(local_timezone: str) -> AsyncIterator[dict[str, McpTool]]:
    tools = await McpTool.from_config(
        "time", {"command": _time_server(local_timezone), "call_timeout_seconds": 10}, None
    )
    try:
        yield {tool.name: tool for tool in tools}
    finally:
        for tool in tools:
            await tool.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def time_tools() -> AsyncIterator[dict[str, McpTool]]:
    """One time server for the tests that only call it."""
    async with _time_tools("UTC") as tools:
        yield tools


async def test_lists_remote_tools_under_the_prefix_with_their_schemas(time_tools):
    assert set(time_tools) == {"time_get_current_time", "time_convert_time"}
    current = time_tools["time_get_current_time"].schema
    assert current["name"] == "time_get_current_time"
    assert current["description"] == "Get current time in a specific timezone"
    assert current["parameters"]["required"] == ["timezone"]
    assert current["parameters"]["properties"]["timezone"]["type"] == "string"
    convert = time_tools["time_convert_time"].schema["parameters"]
    assert set(convert["required"]) == {"source_timezone", "time", "target_timezone"}


async def test_get_current_time_is_now(time_tools):
    result = await time_tools["time_get_current_time"].execute(None, {"timezone": "UTC"})
    answer = json.loads(result.text)
    assert answer["timezone"] == "UTC"
    assert (
        abs((datetime.fromisoformat(answer["datetime"]) - datetime.now(UTC)).total_seconds()) < 60
    )
    assert result.images == []


async def test_convert_time_between_zones(time_tools):
    result = await time_tools["time_convert_time"].execute(
        None, {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    )
    answer = json.loads(result.text)
    assert answer["source"]["datetime"].endswith("T12:00:00+00:00")
    assert answer["target"]["datetime"].endswith("T21:00:00+09:00")
    assert answer["time_difference"] == "+9.0h"


async def test_server_error_result_is_execution_failed(time_tools):
    with pytest.raises(ToolCallError) as caught:
        await time_tools["time_get_current_time"].execute(None, {"timezone": "Mars/Olympus"})
    assert caught.value.kind == ToolErrorKind.EXECUTION_FAILED
    assert "Invalid timezone" in caught.value.message
    assert "Mars/Olympus" in caught.value.message


async def test_unknown_remote_tool_is_invalid_arguments(time_tools):
    connection = time_tools["time_get_current_time"].connection
    with pytest.raises(ToolCallError) as caught:
        await connection.call_tool("get_weather", {})
    assert caught.value.kind == ToolErrorKind.INVALID_ARGUMENTS
    assert "Unknown tool: get_weather" in caught.value.message


async def test_parse_args_checks_the_remote_schema(time_tools):
    tool = time_tools["time_get_current_time"]
    assert tool.parse_args('{"timezone": "Europe/Paris"}') == {"timezone": "Europe/Paris"}
    with pytest.raises(ToolCallError) as caught:
        tool.parse_args("{}")
    assert caught.value.kind == ToolErrorKind.INVALID_ARGUMENTS
    assert "'timezone' is a required property" in caught.value.message
    with pytest.raises(ToolCallError, match="is not of type 'string'"):
        tool.parse_args('{"timezone": 5}')


async def test_killed_server_is_unavailable_then_reconnects():
    async with _time_tools("Europe/Paris") as tools:
        tool = tools["time_get_current_time"]
        [pid] = _child_pids("Europe/Paris")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ToolCallError) as caught:
            await tool.execute(None, {"timezone": "UTC"})
        assert caught.value.kind == ToolErrorKind.UNAVAILABLE
        assert "mcp_server_time --local-timezone Europe/Paris" in caught.value.message
        assert "not reachable" in caught.value.message

        result = await tool.execute(None, {"timezone": "UTC"})  # the next call reconnects
        assert json.loads(result.text)["timezone"] == "UTC"
        [new_pid] = _child_pids("Europe/Paris")
        assert new_pid != pid


async def test_close_stops_the_server_and_later_calls_are_unavailable():
    tools = await McpTool.from_config("time", {"command": _time_server("Asia/Tokyo")}, None)
    [pid] = _child_pids("Asia/Tokyo")
    assert _is_running(pid)
    for tool in tools:  # every tool closes the shared connection; only the first does work
        await tool.close()
    assert not _is_running(pid)
    with pytest.raises(ToolCallError) as caught:
        await tools[0].execute(None, {"timezone": "UTC"})
    assert caught.value.kind == ToolErrorKind.UNAVAILABLE


async def test_server_that_exits_at_once_fails_with_command_and_stderr():
    command = [sys.executable, "-c", "import sys; sys.exit('no API key in MY_TOKEN')"]
    with pytest.raises(RuntimeError) as caught:
        await McpTool.from_config("broken", {"command": command}, None)
    message = str(caught.value)
    assert sys.executable in message
    assert "failed to start" in message
    assert "no API key in MY_TOKEN" in message


async def test_missing_executable_fails_with_its_name():
    with pytest.raises(RuntimeError, match=r"/nonexistent/mcp-server.*No such file"):
        await McpTool.from_config("broken", {"command": ["/nonexistent/mcp-server"]}, None)


async def test_server_that_never_answers_initialize_times_out():
    # Reads stdin until it closes and answers nothing.
    command = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    with pytest.raises(RuntimeError, match=r"did not answer initialize within 0\.3 s"):
        await McpTool.from_config(
            "silent", {"command": command, "connect_timeout_seconds": 0.3}, None
        )
    assert _child_pids("sys.stdin.read") == []


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"command": _time_server("UTC"), "url": "http://127.0.0.1:1/mcp"},
        {"url": "http://127.0.0.1:1/mcp", "env": {"A": "1"}},
        {"command": _time_server("UTC"), "headers": {"A": "1"}},
        {"url": "ftp://127.0.0.1/mcp"},
        {"command": []},
    ],
)
async def test_bad_options_are_rejected_before_connecting(options):
    with pytest.raises(pydantic.ValidationError):
        await McpTool.from_config("bad", options, None)


async def test_tool_schema_override_is_rejected():
    with pytest.raises(ValueError, match="tool_schema"):
        await McpTool.from_config("time", {"command": _time_server("UTC")}, {"name": "x"})


def _http_server() -> MCPServer:
    server = MCPServer("proxy-test", log_level="WARNING")

    @server.tool(description="Adds two integers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="A 1x1 PNG and a caption.")
    def pixel() -> list:
        return ["one pixel", Image(data=PNG, format="png")]

    @server.tool(description="Content a model cannot read as text or image.")
    def attachments() -> list:
        resource = types.TextResourceContents(uri="file:///notes.txt", text="buy milk")
        return [Audio(data=b"RIFF", format="wav"), types.EmbeddedResource(resource=resource)]

    @server.tool(description="The X-Team header of the request.")
    def team(ctx: Context) -> str:
        return (ctx.headers or {}).get("x-team", "none")

    @server.tool(description="Never answers.")
    async def hang() -> str:
        await asyncio.Event().wait()
        return "unreachable"

    @server.tool(name=LONG_NAME, description="A tool with a long name.")
    def long() -> str:
        return "long"

    return server


@pytest_asyncio.fixture(loop_scope="module")
async def http_url() -> AsyncIterator[str]:
    """An MCPServer's streamable-HTTP endpoint, served in this loop on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # clients may connect at once; uvicorn answers once started
    config = uvicorn.Config(
        _http_server().streamable_http_app(), log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await serving
        sock.close()


async def test_streamable_http_server_is_proxied(http_url):
    tools = await McpTool.from_config(
        "calc",
        {
            "url": http_url,
            "headers": {"X-Team": "turnrl"},
            "tool_name_prefix": "calc v1/",
            # Every call's limit, the hanging one's too: long enough for a loaded machine
            # (0.5 s once timed out an ordinary call while other test runs held the cores).
            "call_timeout_seconds": 3.0,
        },
        None,
    )
    by_name = {tool.name: tool for tool in tools}
    try:
        long_name = ("calc_v1_" + LONG_NAME)[:64]
        assert set(by_name) == {
            "calc_v1_add",
            "calc_v1_pixel",
            "calc_v1_attachments",
            "calc_v1_team",
            "calc_v1_hang",
            long_name,
        }
        add = by_name["calc_v1_add"]
        assert add.schema["description"] == "Adds two integers."
        assert set(add.schema["parameters"]["required"]) == {"a", "b"}

        assert (await add.execute(None, {"a": 2, "b": 40})).text == "42"
        pixel = await by_name["calc_v1_pixel"].execute(None, {})
        assert pixel.text == "one pixel"
        assert [(image.data, image.mime_type) for image in pixel.images] == [(PNG, "image/png")]
        attachments = await by_name["calc_v1_attachments"].execute(None, {})
        assert attachments.text == (
            "[audio (audio/wav) not shown]\n[resource file:///notes.txt]\nbuy milk"
        )
        assert (await by_name["calc_v1_team"].execute(None, {})).text == "turnrl"
        assert (await by_name[long_name].execute(None, {})).text == "long"

        with pytest.raises(ToolCallError) as caught:
            await by_name["calc_v1_hang"].execute(None, {})
        assert caught.value.kind == ToolErrorKind.TIMEOUT
        assert "within 3 s" in caught.value.message
        # The connection outlives a timed-out call.
        assert (await add.execute(None, {"a": 1, "b": 1})).text == "2"
    finally:
        for tool in tools:
            await tool.close()


async def test_unreachable_url_fails_with_the_url():
    # Bound and never listening: connections are refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        with pytest.raises(RuntimeError, match=re.escape(f"{url} failed to start: ConnectError")):
            await McpTool.from_config("gone", {"url": url, "connect_timeout_seconds": 2}, None)
