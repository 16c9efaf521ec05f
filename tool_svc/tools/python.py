"""`python`: runs the model's Python code in a bubblewrap sandbox (see `tool_svc/sandbox.py`).

Each call runs in a fresh interpreter with no network, a read-only system, a private work dir
(`/workspace`, deleted after) and wall-time, CPU-time, memory, process and file-size limits.
Code runs like a notebook cell: the value of a trailing expression is printed. With
`enable_stateful_sessions`, a session keeps one sandboxed interpreter whose variables and
files live from call to call; a call that hits a limit ends it, and the next call of the
session starts a fresh one.

A non-zero exit (an exception, `sys.exit(3)`) is an observation, not an error: the model
reads the traceback, and `metrics["exit_code"]` holds the status. Hitting the wall-time limit
is a TIMEOUT error; being killed for CPU time or memory, or failing after hitting the process
limit, is EXECUTION_FAILED; both messages name the limit and carry the output so far.
"""

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator

from tool_svc.cgroups import LimitCounters, SandboxLimits, SandboxUnavailableError
from tool_svc.sandbox import (
    WORKSPACE,
    Captured,
    RunOutcome,
    Sandbox,
    SandboxProcess,
    read_capped,
)
from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from tool_svc.tools.workspace_images import Stamps, WorkspaceImages, image_stamps, new_images
from turnrl.config import StrictModel
from turnrl.images import ImageSettings

MIB = 1024 * 1024
# The interpreter this service runs on, outside any venv: the sandbox sees the standard
# library, not the service's own packages.
BASE_EXECUTABLE = getattr(sys, "_base_executable", sys.executable)
PROBE_TIMEOUT_SECONDS = 30.0
# bwrap exits with 128 + the signal that killed the command; RLIMIT_CPU's soft limit sends SIGXCPU.
CPU_KILL_EXIT_CODE = 128 + signal.SIGXCPU
# Appended to the description the model reads when sessions keep their interpreter.
STATEFUL_NOTE = "Variables, imports and files persist from call to call."
STATUS_DIGITS = 3  # the driver writes a cell's exit status as three digits after its marker

# Runs in the sandboxed interpreter, with `-c`. `run` executes one cell read from stdin and
# exits with its status; `serve MARKER CPU_SECONDS` executes one cell per JSON line on stdin,
# keeping globals, and after each writes MARKER to stderr and MARKER + status to stdout.
DRIVER = r"""
import ast, linecache, os, sys, traceback, types


def run_cell(code, namespace, filename):
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename)
    except (SyntaxError, ValueError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(e)))
        return 1
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    try:
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) % 256
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def fresh_main():
    # Code runs in a real __main__ module, so pickle finds the classes it defines.
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module
    return module.__dict__


def detach_stdin():
    requests = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return requests


def serve(marker, cpu_seconds):
    import json, math, resource

    requests = detach_stdin()
    namespace = fresh_main()
    server_pid = os.getpid()
    for number, line in enumerate(requests, 1):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        spent = math.ceil(usage.ru_utime + usage.ru_stime)
        resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_seconds, resource.RLIM_INFINITY))
        status = run_cell(json.loads(line)["code"], namespace, f"<cell {number}>")
        if os.getpid() != server_pid:  # a child the cell forked: it must not serve requests
            os._exit(status)
        os.write(2, marker)
        os.write(1, marker + b"%03d" % status)


if sys.argv[1] == "run":
    code = detach_stdin().read().decode("utf-8", "replace")
    sys.exit(run_cell(code, fresh_main(), "<cell>"))
serve(sys.argv[2].encode(), int(sys.argv[3]))
"""


class PythonOptions(StrictModel):
    """Limits and interpreter of the Python sandbox."""

    wall_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Wall-clock time one call may take, in seconds."
    )
    cpu_time_limit_seconds: int = Field(
        default=10, gt=0, description="CPU time one call's interpreter may use, in seconds."
    )
    memory_limit_bytes: int = Field(
        default=512 * MIB,
        ge=16 * MIB,
        description="Memory of all the call's processes together, in bytes (a cgroup limit).",
    )
    max_processes: int = Field(
        default=64,
        ge=4,
        description="Processes and threads alive at once in the sandbox, its own two included.",
    )
    max_output_bytes: int = Field(
        default=16384, gt=0, description="Bytes of stdout, and of stderr, kept per call."
    )
    max_file_size_bytes: int = Field(
        default=64 * MIB, gt=0, description="Largest file the code may write, in bytes."
    )
    max_images: int = Field(
        default=4,
        ge=0,
        description="Images (PNG, JPEG, WebP files) a call writes under /workspace that come "
        "back with its result, shown to vision-language models; 0: none.",
    )
    max_image_bytes: int = Field(
        default=4 * MIB, gt=0, description="Largest image file a call's result carries, in bytes."
    )
    enable_stateful_sessions: bool = Field(
        default=False,
        description="Keep one interpreter per session, so variables and files persist from "
        "call to call; otherwise every call starts a fresh one.",
    )
    python_executable: str | None = Field(
        default=None,
        description="Interpreter to run the code with (a venv's python brings its packages); "
        "a relative path is taken from the service's working directory. None: the base "
        "interpreter of the service.",
    )
    enable_site_packages: bool = Field(
        default=False,
        description="Let the code import the interpreter's installed packages (numpy, ...). "
        "Off: the standard library only, which also starts about 20 ms faster.",
    )
    extra_readonly_paths: list[str] = Field(
        default_factory=list,
        description="Host paths the code may read, mounted read-only at the same path.",
    )
    bwrap_executable: str = Field(
        default="bwrap", description="The bubblewrap executable: a name on PATH or a path."
    )

    @field_validator("python_executable")
    @classmethod
    def _path_from_the_services_directory(cls, value: str | None) -> str | None:
        """A relative path made absolute here: in the sandbox the working directory is
        /workspace, where `.venv/bin/python` is not. The path's links are kept, so a venv's
        python still finds its venv."""
        return os.path.abspath(value) if value and os.sep in value else value


@dataclass(eq=False)  # sessions are kept in a set, by identity
class ReplSession:
    """A session of the stateful mode: one sandboxed interpreter, started on the first call."""

    marker: bytes = field(default_factory=lambda: f"<<cell-end-{secrets.token_hex(16)}>>".encode())
    sandbox: SandboxProcess | None = None
    # Output that followed a marker (a background process's), shown with the next call.
    stdout_rest: bytes = b""
    stderr_rest: bytes = b""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PythonTool(Tool):
    """Runs Python code in a sandbox."""

    # The shipped code model was trained with this schema in its prompts (turnrl_demo's
    # task_tools): a change to its text changes what that model reads.
    schema: ClassVar[dict[str, Any]] = {
        "name": "python",
        "description": "Run Python 3 code in a sandbox and see its stdout and stderr. The value "
        "of a trailing expression is printed. No network; /workspace is the writable "
        "working directory.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
            "additionalProperties": False,
        },
    }
    Options = PythonOptions

    def __init__(
        self, name: str, options: PythonOptions, schema: dict[str, Any] | None, sandbox: Sandbox
    ) -> None:
        super().__init__(name, options, schema)
        self.sandbox = sandbox  # where every call runs
        self._executable = options.python_executable or BASE_EXECUTABLE
        self._sessions: set[ReplSession] = set()

    @classmethod
    async def from_config(
        cls, name: str, options: dict[str, Any], schema: dict[str, Any] | None
    ) -> list[Tool]:
        """Builds the tool once the sandbox works here; raises SandboxUnavailableError naming
        what is missing (bwrap, namespaces, cgroups, the interpreter) and how to fix it."""
        parsed = PythonOptions.model_validate(options)
        executable = parsed.python_executable or BASE_EXECUTABLE
        prefixes = await _interpreter_prefixes(executable)
        sandbox = await Sandbox.create(
            parsed.bwrap_executable,
            readonly_paths=[*prefixes, *parsed.extra_readonly_paths],
            env={
                "PATH": f"{os.path.dirname(executable)}:/usr/local/bin:/usr/bin:/bin",
                "HOME": WORKSPACE,
                "TMPDIR": "/tmp",
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1",
            },
            probe_command=[*_python_command(executable, parsed.enable_site_packages), "run"],
            limits=_limits(parsed, per_call=True),
        )
        if schema is None and parsed.enable_stateful_sessions:
            description = f"{cls.schema['description']} {STATEFUL_NOTE}"
            schema = {**cls.schema, "description": description}
        return [cls(name, parsed, schema, sandbox)]

    async def create(self, **session_kwargs: Any) -> Any:
        if session_kwargs:
            raise ValueError(f"python takes no session kwargs; got {sorted(session_kwargs)}")
        return ReplSession() if self.options.enable_stateful_sessions else None

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        code: str = args["code"]
        if isinstance(session, ReplSession):
            return await self._execute_in_session(session, code)
        options: PythonOptions = self.options
        written = WorkspaceImages()

        def read_images(workdir: Path) -> None:
            nonlocal written
            written = self._new_images(workdir, {})

        outcome = await self.sandbox.run(
            [*_python_command(self._executable, options.enable_site_packages), "run"],
            code.encode(errors="replace"),
            options.wall_timeout_seconds,
            _limits(options, per_call=True),
            options.max_output_bytes,
            read_workdir=read_images,
        )
        return self._result(outcome, written, state_lost=False)

    async def release(self, session: Any) -> None:
        if isinstance(session, ReplSession):
            await self._stop_session(session)

    async def close(self) -> None:
        await asyncio.gather(*(self._stop_session(s) for s in list(self._sessions)))
        await self.sandbox.close()

    async def _execute_in_session(self, session: ReplSession, code: str) -> ToolResult:
        options: PythonOptions = self.options
        async with session.lock:
            if session.sandbox is None:
                session.sandbox = await self.sandbox.start(
                    [
                        *_python_command(self._executable, options.enable_site_packages),
                        "serve",
                        session.marker.decode(),
                        str(options.cpu_time_limit_seconds),
                    ],
                    _limits(options, per_call=False),
                )
                self._sessions.add(session)
            sandbox = session.sandbox
            before = await sandbox.counters()
            images_before = await asyncio.to_thread(image_stamps, sandbox.workdir)
            started = time.monotonic()
            try:
                async with asyncio.timeout(options.wall_timeout_seconds):
                    exit_code, stdout, stderr = await self._run_cell(session, sandbox, code)
                if exit_code is None:  # the interpreter died mid-cell
                    async with asyncio.timeout(options.wall_timeout_seconds):
                        exit_code = await sandbox.process.wait()
            except TimeoutError:
                exit_code, stdout, stderr = None, Captured(b"", 0), Captured(b"", 0)
            except BaseException:
                await self._stop_session(session)  # cancelled mid-cell: its state is unknown
                raise
            outcome = RunOutcome(
                exit_code,
                stdout,
                stderr,
                time.monotonic() - started,
                await sandbox.counters() - before,
            )
            alive = exit_code is not None and sandbox.process.returncode is None
            written = await asyncio.to_thread(self._new_images, sandbox.workdir, images_before)
            if not alive:
                await self._stop_session(session)
            return self._result(outcome, written, state_lost=not alive)

    async def _run_cell(
        self, session: ReplSession, sandbox: SandboxProcess, code: str
    ) -> tuple[int | None, Captured, Captured]:
        """Sends one cell and reads its output up to the markers; exit code None: the
        interpreter died before finishing the cell."""
        process = sandbox.process
        assert process.stdin and process.stdout and process.stderr
        limit = self.options.max_output_bytes
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            process.stdin.write(json.dumps({"code": code}).encode() + b"\n")
            await process.stdin.drain()
        async with asyncio.TaskGroup() as group:
            stdout_read = group.create_task(
                read_capped(process.stdout, limit, session.marker, session.stdout_rest)
            )
            stderr_read = group.create_task(
                read_capped(process.stderr, limit, session.marker, session.stderr_rest)
            )
        stdout, stderr = stdout_read.result(), stderr_read.result()
        if stdout.rest is None or stderr.rest is None:
            return None, stdout, stderr
        status = stdout.rest
        with contextlib.suppress(asyncio.IncompleteReadError):
            status += await process.stdout.readexactly(max(STATUS_DIGITS - len(status), 0))
        if len(status) < STATUS_DIGITS:
            return None, stdout, stderr
        session.stdout_rest, session.stderr_rest = status[STATUS_DIGITS:], stderr.rest
        return int(status[:STATUS_DIGITS]), stdout, stderr

    async def _stop_session(self, session: ReplSession) -> None:
        sandbox, session.sandbox = session.sandbox, None
        session.stdout_rest = session.stderr_rest = b""
        self._sessions.discard(session)
        if sandbox is not None:
            await sandbox.stop()

    def _new_images(self, workdir: Path, before: Stamps) -> WorkspaceImages:
        options: PythonOptions = self.options
        if options.max_images == 0:
            return WorkspaceImages()
        settings = ImageSettings(max_image_bytes=options.max_image_bytes)
        return new_images(workdir, before, options.max_images, settings)

    def _result(
        self, outcome: RunOutcome, written: WorkspaceImages, state_lost: bool
    ) -> ToolResult:
        """The observation of a finished run with the images it wrote, or the ToolCallError
        naming the limit it hit."""
        options: PythonOptions = self.options
        text = _format_output(outcome, written.notes)
        lost = (
            "; the session's state (variables, files) was lost and the next call starts a "
            "fresh interpreter"
            if state_lost
            else ""
        )
        if outcome.exit_code is None:
            raise ToolCallError(
                ToolErrorKind.TIMEOUT,
                f"the code was killed after {options.wall_timeout_seconds:g}s wall time "
                f"(wall_timeout_seconds){lost}. Output so far:\n{text}",
            )
        limit = _limit_hit(outcome, options)
        if limit is not None:
            raise ToolCallError(
                ToolErrorKind.EXECUTION_FAILED, f"{limit}{lost}. Output so far:\n{text}"
            )
        if state_lost:
            raise ToolCallError(
                ToolErrorKind.EXECUTION_FAILED,
                f"the interpreter exited with code {outcome.exit_code}{lost}. Output:\n{text}",
            )
        return ToolResult(
            text=text,
            images=written.images,
            metrics={
                "exit_code": float(outcome.exit_code),
                "runtime_seconds": outcome.runtime_seconds,
                "stdout_truncated_bytes": float(outcome.stdout.dropped_bytes),
                "stderr_truncated_bytes": float(outcome.stderr.dropped_bytes),
                "oom_killed": float(outcome.counters.oom_kills > 0),
            },
        )


def _limit_hit(outcome: RunOutcome, options: PythonOptions) -> str | None:
    """Which limit made a run fail, in words; None when it succeeded or failed on its own."""
    counters: LimitCounters = outcome.counters
    if outcome.exit_code == 0:
        return None
    if counters.oom_kills:
        return (
            f"the code was killed for using more than its memory limit of "
            f"{options.memory_limit_bytes / MIB:g} MiB (memory_limit_bytes)"
        )
    if outcome.exit_code == CPU_KILL_EXIT_CODE:
        return (
            f"the code was killed after using its CPU time limit of "
            f"{options.cpu_time_limit_seconds}s (cpu_time_limit_seconds)"
        )
    if counters.process_limit_hits:
        return (
            f"the code failed after trying to run more than {options.max_processes} processes "
            "and threads at once (max_processes)"
        )
    return None


def _format_output(outcome: RunOutcome, image_notes: list[str]) -> str:
    stdout, stderr = outcome.stdout.text(), outcome.stderr.text()
    parts = [stdout] if stdout else []
    if stderr:
        parts.append(f"[stderr]\n{stderr}")
    if outcome.exit_code:
        parts.append(f"[exit code {outcome.exit_code}]")
    if image_notes:
        parts.append("\n".join(image_notes))
    return "\n".join(part if part.endswith("\n") else part + "\n" for part in parts) or (
        "(no output)"
    )


def _python_command(executable: str, site_packages: bool) -> list[str]:
    # -I: no user site-packages, no PYTHON* variables, no script dir on sys.path;
    # -B: no .pyc files; -u: unbuffered, so output written before a kill is not lost;
    # -S: no site module, so no installed packages and no .pth files run at start-up.
    flags = ["-I", "-B", "-u"] if site_packages else ["-I", "-S", "-B", "-u"]
    return [executable, *flags, "-c", DRIVER]


def _limits(options: PythonOptions, per_call: bool) -> SandboxLimits:
    """The sandbox's limits; a session's interpreter sets its CPU limit per call itself."""
    return SandboxLimits(
        memory_bytes=options.memory_limit_bytes,
        max_processes=options.max_processes,
        max_file_size_bytes=options.max_file_size_bytes,
        cpu_time_seconds=options.cpu_time_limit_seconds if per_call else None,
    )


async def _interpreter_prefixes(executable: str) -> list[str]:
    """The install prefixes the interpreter needs (a venv and its base), asked of itself."""
    try:
        process = await asyncio.create_subprocess_exec(
            executable,
            "-I",
            "-c",
            "import sys; print(sys.prefix); print(sys.base_prefix)",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        raise SandboxUnavailableError(
            f"python_executable {executable!r} cannot be run: {e.strerror}"
        ) from e
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if process.returncode != 0:
        raise SandboxUnavailableError(
            f"python_executable {executable!r} failed to start: {stderr.decode().strip()!r}"
        )
    return list(dict.fromkeys(stdout.decode().split("\n")[:2]))
