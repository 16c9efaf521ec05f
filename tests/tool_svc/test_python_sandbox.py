"""The `python` tool on the real sandbox: bubblewrap, cgroups and real processes.

Setting up a tool fails loudly (SandboxUnavailableError) where bwrap or a writable cgroup
is missing; CI installs bubblewrap and runs as root, so nothing here is skipped.
"""

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tool_svc.cgroups import SandboxUnavailableError
from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.python import PythonTool
from turnrl.config import REPO_ROOT

MIB = 1024 * 1024
# Small limits keep the file fast; tests that probe a limit lower it further.
FAST_OPTIONS = {
    "wall_timeout_seconds": 10,
    "cpu_time_limit_seconds": 5,
    "memory_limit_bytes": 256 * MIB,
    "max_processes": 32,
}
# The test's interpreter (the venv's) by a path from the working directory.
RELATIVE_PYTHON = os.path.relpath(sys.executable)


@contextlib.asynccontextmanager
async def python_tool(**options) -> AsyncIterator[PythonTool]:
    """A python tool with FAST_OPTIONS updated by `options`; checks on close that no sandbox
    process or cgroup is left behind."""
    [tool] = await PythonTool.from_config("python", {**FAST_OPTIONS, **options}, None)
    assert isinstance(tool, PythonTool)
    parent = tool.sandbox.cgroup_parent
    try:
        yield tool
    finally:
        await tool.close()
    assert sandboxed_pids() == []
    assert not parent.memory_dir.exists() and not parent.pids_dir.exists()


def sandboxed_pids() -> list[int]:
    """Processes on this machine that are in one of this test process's sandbox cgroups."""
    name = f"turnrl-sandbox-{os.getpid()}/"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if name in (entry / "cgroup").read_text():
                    pids.append(int(entry.name))
    return pids


async def run(tool: PythonTool, code: str, session=None):
    return await tool.execute(session, {"code": code})


async def test_prints_and_shows_a_trailing_expression():
    async with python_tool() as tool:
        result = await run(tool, "print('hello')\n6 * 7")
    assert result.text == "hello\n42\n"
    assert result.metrics["exit_code"] == 0
    assert result.metrics["oom_killed"] == 0


async def test_errors_are_output_with_a_nonzero_exit_code():
    async with python_tool() as tool:
        syntax = await run(tool, "x = (")
        raised = await run(tool, "def f():\n    raise ValueError('bad value')\nf()")
        exited = await run(tool, "import sys\nsys.exit(3)")
    assert "SyntaxError" in syntax.text and syntax.metrics["exit_code"] == 1
    assert 'File "<cell>", line 2, in f' in raised.text
    assert "ValueError: bad value" in raised.text and raised.metrics["exit_code"] == 1
    assert exited.metrics["exit_code"] == 3 and "[exit code 3]" in exited.text


async def test_network_is_unreachable():
    connected = asyncio.Event()
    server = await asyncio.start_server(lambda r, w: connected.set(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = f"""
import socket
print(socket.if_nameindex())
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print("blocked:", e)
"""
    async with server, python_tool() as tool:
        result = await run(tool, code)
    assert result.text.startswith("[(1, 'lo')]\nblocked:"), result.text
    assert not connected.is_set()


async def test_only_the_work_dir_is_writable_and_it_does_not_persist():
    code = """
import os
print(os.getcwd())
for path in ["/usr/x", "/etc/x", "/root/x", "/x", "/proc/sys/kernel/core_pattern"]:
    try:
        open(path, "a")
        print("wrote", path)
    except OSError as e:
        print("refused", path, e.strerror)
with open("made.txt", "w") as f:
    f.write("data")
print(open("/workspace/made.txt").read())
"""
    async with python_tool() as tool:
        result = await run(tool, code)
        later = await run(tool, "import os\nos.path.exists('made.txt'), os.listdir('.')")
    assert result.metrics["exit_code"] == 0, result.text
    assert result.text.startswith("/workspace\n")
    assert "wrote" not in result.text and result.text.count("refused") == 5
    assert result.text.endswith("data\n")
    assert later.text == "(False, [])\n"


async def test_host_files_are_hidden():
    # The interpreter's prefix is the only thing under /root the sandbox may see.
    prefix = Path(sys.base_prefix)
    exposed = [prefix.parts[2]] if prefix.parts[1:2] == ("root",) else []
    code = f"""
import os
print(os.path.exists({str(REPO_ROOT / "pyproject.toml")!r}), os.path.exists("/etc/shadow"))
print(sorted(os.listdir("/root")) if os.path.isdir("/root") else [])
"""
    async with python_tool() as tool:
        result = await run(tool, code)
    assert (REPO_ROOT / "pyproject.toml").exists()
    assert result.text == f"False False\n{exposed}\n"


async def test_wall_time_limit_kills_an_infinite_loop():
    async with python_tool(wall_timeout_seconds=1) as tool:
        with pytest.raises(ToolCallError) as error:
            await run(tool, "print('started')\nwhile True:\n    pass")
    assert error.value.kind == ToolErrorKind.TIMEOUT
    assert "killed after 1s wall time" in error.value.message
    assert "started" in error.value.message


async def test_cpu_time_limit_kills_a_busy_loop():
    async with python_tool(cpu_time_limit_seconds=1) as tool:
        with pytest.raises(ToolCallError) as error:
            await run(tool, "while True:\n    pass")
    assert error.value.kind == ToolErrorKind.EXECUTION_FAILED
    assert "CPU time limit of 1s" in error.value.message


async def test_memory_limit_kills_a_hog():
    async with python_tool(memory_limit_bytes=64 * MIB) as tool:
        with pytest.raises(ToolCallError) as error:
            await run(tool, "blob = b'x' * (256 * 1024 * 1024)")
    assert error.value.kind == ToolErrorKind.EXECUTION_FAILED
    assert "memory limit of 64 MiB" in error.value.message


async def test_fork_bomb_is_contained_and_cleaned_up():
    code = """
import os
leader, refused = os.getpid(), False
while True:
    try:
        os.fork()
    except OSError:
        if not refused and os.getpid() == leader:
            print("fork refused", flush=True)
        refused = True
"""
    async with python_tool(
        max_processes=16, memory_limit_bytes=512 * MIB, wall_timeout_seconds=1
    ) as tool:
        with pytest.raises(ToolCallError) as error:
            await run(tool, code)
        parent = tool.sandbox.cgroup_parent
        assert sandboxed_pids() == []
        assert not any(parent.pids_dir.glob("run-*")) and not any(parent.memory_dir.glob("run-*"))
    assert error.value.kind == ToolErrorKind.TIMEOUT
    assert "fork refused" in error.value.message
    host = await asyncio.create_subprocess_exec("true")
    assert await host.wait() == 0


async def test_process_limit_is_named_when_the_code_fails_on_it():
    async with python_tool(max_processes=16) as tool:
        with pytest.raises(ToolCallError) as error:
            await run(
                tool,
                "import subprocess\nprocs = [subprocess.Popen(['sleep', '5']) for _ in range(40)]",
            )
    assert error.value.kind == ToolErrorKind.EXECUTION_FAILED
    assert "more than 16 processes" in error.value.message
    assert "BlockingIOError" in error.value.message


async def test_huge_output_is_truncated():
    async with python_tool(max_output_bytes=1000) as tool:
        result = await run(
            tool, "import sys\nprint('x' * 100_000)\n_ = sys.stderr.write('e' * 5000)"
        )
    assert result.text.startswith("x" * 1000 + "...[truncated 99001 bytes]")
    assert "e" * 1000 + "...[truncated 4000 bytes]" in result.text
    assert result.metrics["stdout_truncated_bytes"] == 99001
    assert result.metrics["stderr_truncated_bytes"] == 4000


async def test_parallel_calls_each_get_their_own_result():
    async with python_tool() as tool:
        results = await asyncio.gather(
            *(
                run(
                    tool, f"import os\nprint({i} * {i}, os.listdir('.'))\nopen('f{i}', 'w').close()"
                )
                for i in range(10)
            )
        )
    assert [r.text for r in results] == [f"{i * i} []\n" for i in range(10)]


async def test_stateful_sessions_keep_variables_and_are_isolated():
    async with python_tool(enable_stateful_sessions=True) as tool:
        first, second = await tool.create(), await tool.create()
        try:
            await run(tool, "x = 41\nopen('note.txt', 'w').write('kept')", first)
            kept = await run(tool, "x + 1, open('note.txt').read()", first)
            other = await run(
                tool, "'x' in globals(), os.listdir('.') if 'os' in globals() else []", second
            )
        finally:
            await tool.release(first)
            await tool.release(second)
        assert sandboxed_pids() == []
    assert "persist" in tool.schema["description"]
    assert kept.text == "(42, 'kept')\n" and kept.metrics["exit_code"] == 0
    assert other.text == "(False, [])\n"


async def test_stateful_session_loses_its_state_after_a_timeout():
    async with python_tool(enable_stateful_sessions=True, wall_timeout_seconds=1) as tool:
        session = await tool.create()
        try:
            await run(tool, "x = 1", session)
            with pytest.raises(ToolCallError) as error:
                await run(tool, "while True:\n    pass", session)
            fresh = await run(tool, "'x' in globals()", session)
        finally:
            await tool.release(session)
    assert error.value.kind == ToolErrorKind.TIMEOUT
    assert "state (variables, files) was lost" in error.value.message
    assert fresh.text == "False\n"


async def test_refuses_to_start_without_bwrap():
    with pytest.raises(SandboxUnavailableError) as error:
        await PythonTool.from_config("python", {"bwrap_executable": "/nonexistent/bwrap"}, None)
    assert "'/nonexistent/bwrap' not found" in str(error.value)
    assert "bubblewrap" in str(error.value)


async def test_start_up_removes_cgroups_a_dead_service_left():
    finished = await asyncio.create_subprocess_exec("true")
    await finished.wait()
    async with python_tool() as tool:
        parent = tool.sandbox.cgroup_parent
        stale = f"turnrl-sandbox-{finished.pid}"
        left = [parent.memory_dir.parent / stale, parent.pids_dir.parent / stale]
        for path in left:
            (path / "run-0").mkdir(parents=True, exist_ok=True)
        async with python_tool():
            assert not any(path.exists() for path in left)


async def test_a_relative_python_executable_is_the_one_the_sandbox_runs():
    """`.venv/bin/python` in a config names the venv beside the service, not one in the
    sandbox's /workspace."""
    assert not os.path.isabs(RELATIVE_PYTHON)
    async with python_tool(python_executable=RELATIVE_PYTHON, enable_site_packages=True) as tool:
        assert (await run(tool, "import sys; print(sys.prefix)")).text.strip() == sys.prefix


async def test_installed_packages_only_when_enabled():
    # The service's base interpreter has site-packages of its own (pip itself, at least).
    code = "import importlib.util; print(importlib.util.find_spec('pip') is not None)"
    async with python_tool() as tool:
        assert (await run(tool, code)).text.strip() == "False"
    async with python_tool(enable_site_packages=True) as tool:
        assert (await run(tool, code)).text.strip() == "True"
