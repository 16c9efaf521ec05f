"""The `sandbox_fusion` tool against a local stand-in of Sandbox Fusion's `/run_code` API.

The stand-in speaks the real request and response shape and really runs the code (python via
`python -c`, cpp via g++), unsandboxed: it only ever runs this file's own snippets.
"""

import asyncio
import contextlib
import json
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.tool_svc.http_stand_in import serve_app
from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.sandbox_fusion import SandboxFusionTool


async def run_command(argv: list[str], stdin: str, timeout_seconds: float) -> dict[str, Any]:
    """Runs `argv` as Sandbox Fusion would, answering its CommandRunResult shape."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_seconds):
            stdout, stderr = await process.communicate(stdin.encode())
    except TimeoutError:
        return {"status": "TimeLimitExceeded", "execution_time": timeout_seconds}
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return {
        "status": "Finished",
        "execution_time": loop.time() - started,
        "return_code": process.returncode,
        "stdout": stdout.decode(),
        "stderr": stderr.decode(),
    }


async def run_code(body: dict[str, Any]) -> dict[str, Any]:
    """What Sandbox Fusion's run_code answers for python and cpp."""
    compile_result = run_result = None
    with tempfile.TemporaryDirectory() as workdir:
        if body["language"] == "python":
            run_argv = [sys.executable, "-c", body["code"]]
        else:
            assert body["language"] == "cpp", body["language"]
            binary = str(Path(workdir, "main"))
            compile_argv = ["g++", "-x", "c++", "-o", binary, "-"]
            compile_result = await run_command(compile_argv, body["code"], body["compile_timeout"])
            run_argv = [binary]
        if compile_result is None or compile_result.get("return_code") == 0:
            run_result = await run_command(run_argv, body["stdin"], body["run_timeout"])
    results = [r for r in (compile_result, run_result) if r is not None]
    succeeded = all(r["status"] == "Finished" and r["return_code"] == 0 for r in results)
    return {
        "status": "Success" if succeeded else "Failed",
        "message": "",
        "compile_result": compile_result,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": {},
    }


@dataclass
class SandboxServer:
    """The stand-in server: its URL, the bodies it received, and an optional canned answer."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    canned: Response | None = None


@pytest.fixture
async def sandbox() -> AsyncIterator[SandboxServer]:
    state = SandboxServer()

    async def handle(request: Request) -> Response:
        body = await request.json()
        state.requests.append(body)
        return state.canned or JSONResponse(await run_code(body))

    async with serve_app(Starlette(routes=[Route("/run_code", handle, methods=["POST"])])) as url:
        state.url = url
        yield state


@contextlib.asynccontextmanager
async def make_tool(url: str, **options: Any) -> AsyncIterator[SandboxFusionTool]:
    [tool] = await SandboxFusionTool.from_config("code_interpreter", {"url": url, **options}, None)
    try:
        yield tool
    finally:
        await tool.close()


async def call(tool: SandboxFusionTool, code: str):
    """Parses `code` as the model's arguments and executes it."""
    return await tool.execute(None, tool.parse_args(json.dumps({"code": code})))


async def test_success_returns_stdout_and_sends_the_documented_request(sandbox):
    async with make_tool(sandbox.url, run_timeout_seconds=5, memory_limit_mb=256) as tool:
        result = await call(tool, "print(6 * 7)")
    assert result.text == "42\n"
    assert result.error_kind is None
    assert result.metrics["exit_code"] == 0
    assert result.metrics["runtime_seconds"] > 0
    assert sandbox.requests == [
        {
            "code": "print(6 * 7)",
            "language": "python",
            "run_timeout": 5,
            "compile_timeout": 10,
            "memory_limit_MB": 256,
            "stdin": "",
            "files": {},
        }
    ]


async def test_nonzero_exit_returns_stdout_and_labelled_stderr(sandbox):
    async with make_tool(sandbox.url) as tool:
        result = await call(tool, "print('partial')\nraise ValueError('bad input')")
    stdout, stderr = result.text.split("stderr:\n")
    assert stdout == "partial\n"
    assert "ValueError: bad input" in stderr
    assert result.metrics["exit_code"] == 1


async def test_run_past_its_time_limit_is_a_timeout(sandbox):
    async with make_tool(sandbox.url, run_timeout_seconds=0.5) as tool:
        with pytest.raises(ToolCallError) as caught:
            await call(tool, "import time\ntime.sleep(60)")
    assert caught.value.kind is ToolErrorKind.TIMEOUT
    assert "run_timeout_seconds=0.5" in caught.value.message


async def test_compile_error_returns_the_compiler_output(sandbox):
    async with make_tool(sandbox.url, language="cpp") as tool:
        result = await call(tool, "int main() { return undefined_name; }")
    assert result.text.startswith("Compilation failed:\n")
    assert "undefined_name" in result.text
    assert result.metrics["exit_code"] != 0
    assert sandbox.requests[0]["language"] == "cpp"
    assert sandbox.requests[0]["compile_timeout"] == 10


async def test_long_output_is_cut_to_max_output_bytes(sandbox):
    async with make_tool(sandbox.url, max_output_bytes=100) as tool:
        result = await call(tool, "print('x' * 10000)")
    assert result.text.startswith("x" * 100 + "\n[... 9901 more bytes cut]")
    assert len(result.text) < 200


async def test_server_error_is_unavailable_naming_url_and_status(sandbox):
    sandbox.canned = PlainTextResponse("internal failure", status_code=500)
    async with make_tool(sandbox.url) as tool:
        with pytest.raises(ToolCallError) as caught:
            await call(tool, "print(1)")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert f"{sandbox.url}/run_code" in caught.value.message
    assert "HTTP 500" in caught.value.message


async def test_sandbox_error_answer_is_unavailable(sandbox):
    sandbox.canned = JSONResponse(
        {"status": "SandboxError", "message": "runner crashed", "run_result": None}
    )
    async with make_tool(sandbox.url) as tool:
        with pytest.raises(ToolCallError) as caught:
            await call(tool, "print(1)")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert "runner crashed" in caught.value.message


async def test_malformed_answer_is_unavailable(sandbox):
    sandbox.canned = PlainTextResponse("not json")
    async with make_tool(sandbox.url) as tool:
        with pytest.raises(ToolCallError) as caught:
            await call(tool, "print(1)")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert "malformed" in caught.value.message


async def test_server_down_is_unavailable_naming_url():
    # A bound socket that does not listen: connections to it are refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with make_tool(url) as tool:
            with pytest.raises(ToolCallError) as caught:
                await call(tool, "print(1)")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert f"{url}/run_code" in caught.value.message


async def test_missing_code_is_invalid_arguments(sandbox):
    async with make_tool(sandbox.url) as tool:
        assert tool.schema["name"] == "code_interpreter"
        with pytest.raises(ToolCallError) as caught:
            tool.parse_args("{}")
    assert caught.value.kind is ToolErrorKind.INVALID_ARGUMENTS
    assert "'code' is a required property" in caught.value.message
    assert sandbox.requests == []


async def test_request_timeout_must_outlast_the_sandbox_limits():
    with pytest.raises(pydantic.ValidationError, match="request_timeout_seconds 15"):
        await SandboxFusionTool.from_config(
            "code_interpreter",
            {"url": "http://127.0.0.1:1", "run_timeout_seconds": 10, "request_timeout_seconds": 15},
            None,
        )
