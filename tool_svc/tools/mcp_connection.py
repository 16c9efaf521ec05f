"""The client end of one MCP server, a stdio command or a streamable-HTTP URL, that the `mcp`
tool (tool_svc/tools/mcp.py) proxies: its options and `McpConnection`, the session every tool
of that server shares. MCP's client contexts hold anyio task groups, which must be entered and
exited in one task, so the connection lives in a task of its own while calls go through its
session from any task.
"""

import asyncio
import contextlib
import logging
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client, types
from mcp.client.streamable_http import streamable_http_client
from pydantic import Field, model_validator

from tool_svc.tools.base import ToolCallError, ToolErrorKind
from turnrl.config import StrictModel

logger = logging.getLogger(__name__)

# The stdio transport's own shutdown takes up to ~6 s (exit after stdin closes, then SIGTERM,
# then SIGKILL, 2 s each); past this a connection task is cancelled.
SHUTDOWN_GRACE_SECONDS = 10.0
# How long a stdio server's stderr may stay open after the server stopped (a child of it can
# hold the pipe) before we stop reading it.
STDERR_DRAIN_SECONDS = 1.0
# The end of a stdio server's stderr kept for start-up errors, in bytes.
STDERR_TAIL_BYTES = 2000
# A paginated tools/list that never ends cannot hang start-up.
MAX_TOOL_LIST_PAGES = 100
# The HTTP read timeout of a long-lived server-sent-event stream; each request has its own
# bound (`call_timeout_seconds`, `connect_timeout_seconds`) on top. Same as the MCP SDK's default.
HTTP_STREAM_READ_TIMEOUT_SECONDS = 300.0


class McpOptions(StrictModel):
    """Options of an `mcp` entry: the server to proxy and its time limits."""

    command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Argv of a stdio MCP server started as a subprocess, e.g. "
        "['uvx', 'mcp-server-time']. Exactly one of `command` and `url`.",
    )
    env: dict[str, str] | None = Field(
        default=None,
        description="Environment of the stdio server, over a minimal inherited one (HOME, PATH, "
        "SHELL, TERM, USER, LOGNAME). Only with `command`.",
    )
    cwd: Path | None = Field(
        default=None, description="Working directory of the stdio server. Only with `command`."
    )
    url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="Streamable-HTTP endpoint of an MCP server, e.g. 'http://127.0.0.1:8000/mcp'. "
        "Exactly one of `command` and `url`.",
    )
    headers: dict[str, str] | None = Field(
        default=None,
        description="HTTP headers sent with every request (e.g. Authorization). Only with `url`.",
    )
    tool_name_prefix: str | None = Field(
        default=None,
        description="Prefix of the proxied tools' names; default: the entry's name and '_'. "
        "Names keep [a-zA-Z0-9_.-] (others become '_') and their first 64 characters.",
    )
    connect_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for the server to start and answer initialize, and for "
        "tools/list, in seconds.",
    )
    call_timeout_seconds: float = Field(
        default=60.0, gt=0, description="Longest wait for one tools/call answer, in seconds."
    )

    @model_validator(mode="after")
    def _one_server(self) -> "McpOptions":
        if (self.command is None) == (self.url is None):
            raise ValueError(
                f"set exactly one of `command` (stdio server) and `url` (streamable HTTP); "
                f"got command={self.command!r}, url={self.url!r}"
            )
        if self.command is None and (self.env is not None or self.cwd is not None):
            raise ValueError("`env` and `cwd` apply to a stdio server: set them with `command`")
        if self.url is None and self.headers is not None:
            raise ValueError("`headers` apply to an HTTP server: set them with `url`")
        return self


class McpConnection:
    """One MCP client session to a server, shared by every tool proxied from it.

    A task of its own enters the transport and the session, reports ready and waits for its
    stop event; calls use the session from their own tasks. A call that finds the connection
    lost reconnects once; `close` stops the task (and a stdio server) and may be called again.
    """

    def __init__(self, options: McpOptions):
        self._options = options
        self.target = shlex.join(options.command) if options.command else str(options.url)
        self._session: ClientSession | None = None  # None until connected, and once lost
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._stderr: _StderrTail | None = None
        self._lock = asyncio.Lock()  # one connect or close at a time
        self._closed = False

    async def open(self) -> None:
        """Connects and initializes. Raises RuntimeError naming the server (and its stderr)."""
        async with self._lock:
            await self._connect()

    async def list_tools(self) -> list[types.Tool]:
        """The server's tools, every page. Raises RuntimeError naming the server."""
        session = self._session
        if session is None:
            raise RuntimeError(f"MCP server {self.target} is not connected")
        tools: list[types.Tool] = []
        params = None
        try:
            async with asyncio.timeout(self._options.connect_timeout_seconds):
                for _ in range(MAX_TOOL_LIST_PAGES):
                    page = await session.list_tools(params=params)
                    tools += page.tools
                    if page.next_cursor is None:
                        return tools
                    params = types.PaginatedRequestParams(cursor=page.next_cursor)
        except (MCPError, TimeoutError) as e:
            raise RuntimeError(
                f"MCP server {self.target} failed to list its tools: {_describe(e)}"
            ) from e
        raise RuntimeError(
            f"MCP server {self.target} listed more than {MAX_TOOL_LIST_PAGES} pages of tools"
        )

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Calls remote tool `name`. Failures of the connection or the call raise ToolCallError."""
        session = await self._live_session()
        timeout_seconds = self._options.call_timeout_seconds
        try:
            async with asyncio.timeout(timeout_seconds):
                return await session.call_tool(
                    name, arguments, read_timeout_seconds=timeout_seconds
                )
        except TimeoutError:
            error = MCPError(types.REQUEST_TIMEOUT, "timed out")
        except MCPError as e:
            error = e
        if error.code == types.CONNECTION_CLOSED:
            self._mark_lost(session)
            raise ToolCallError(
                ToolErrorKind.UNAVAILABLE,
                f"MCP server {self.target} is not reachable: the connection closed",
            )
        if error.code == types.REQUEST_TIMEOUT:
            raise ToolCallError(
                ToolErrorKind.TIMEOUT,
                f"MCP server {self.target} did not answer a call of {name!r} within {timeout_seconds:g} s",
            )
        kind = (
            ToolErrorKind.INVALID_ARGUMENTS
            if error.code == types.INVALID_PARAMS
            else ToolErrorKind.EXECUTION_FAILED
        )
        raise ToolCallError(
            kind,
            f"MCP server {self.target} answered the call of {name!r} with error {error.code}: "
            f"{error.message}",
        )

    async def close(self) -> None:
        """Stops the connection and a stdio server; later calls are UNAVAILABLE. Idempotent."""
        async with self._lock:
            self._closed = True
            self._session = None
            await self._stop_runner()

    async def _live_session(self) -> ClientSession:
        if (session := self._session) is not None:
            return session
        async with self._lock:
            if self._closed:
                raise ToolCallError(
                    ToolErrorKind.UNAVAILABLE,
                    f"MCP server {self.target} is not reachable: its connection was closed",
                )
            if self._session is None:
                logger.warning("reconnecting to MCP server %s", self.target)
                await self._stop_runner()
                try:
                    await self._connect()
                except RuntimeError as e:
                    logger.warning("%s", e)
                    raise ToolCallError(
                        ToolErrorKind.UNAVAILABLE,
                        f"MCP server {self.target} is not reachable: reconnecting failed",
                    ) from None
            assert self._session is not None
            return self._session

    def _mark_lost(self, session: ClientSession) -> None:
        # Only the session that failed: a call still in flight on an old session must not
        # drop the one a reconnect already replaced it with.
        if self._session is session:
            logger.warning("lost the connection to MCP server %s", self.target)
            self._session = None

    async def _connect(self) -> None:
        """Starts a connection task and waits until its session is initialized."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[ClientSession] = loop.create_future()
        self._stop = asyncio.Event()
        self._stderr = _StderrTail(self.target) if self._options.command else None
        runner = asyncio.create_task(
            self._serve(ready, self._stop, self._stderr), name=f"mcp {self.target}"
        )
        self._runner = runner
        connect_seconds = self._options.connect_timeout_seconds
        try:
            # The session's own read timeout bounds initialize; the grace covers the
            # transport's shutdown after a failure.
            async with asyncio.timeout(connect_seconds + SHUTDOWN_GRACE_SECONDS):
                self._session = await asyncio.shield(ready)
            return
        except TimeoutError:
            reason = f"did not answer initialize within {connect_seconds:g} s"
        except Exception as e:
            timed_out = any(
                isinstance(leaf, MCPError) and leaf.code == types.REQUEST_TIMEOUT
                for leaf in _leaves(e)
            )
            reason = (
                f"did not answer initialize within {connect_seconds:g} s"
                if timed_out
                else f"failed to start: {_describe(e)}"
            )
        finally:
            if self._session is None:  # failed, timed out or cancelled: no task may outlive us
                if not ready.done():  # still connecting: its stop event is not awaited yet
                    runner.cancel()
                await self._stop_runner()
        stderr = self._stderr.text() if self._stderr else ""
        raise RuntimeError(
            f"MCP server {self.target} {reason}"
            + (f"; its stderr ends with:\n{stderr}" if stderr else "")
        )

    async def _serve(
        self,
        ready: asyncio.Future[ClientSession],
        stop: asyncio.Event,
        stderr: "_StderrTail | None",
    ) -> None:
        """The connection task: enters the transport and session, waits for `stop`, exits them."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                session = await self._enter_session(stack, stderr)
                ready.set_result(session)
                await stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            else:  # e.g. an HTTP session the server already ended cannot be deleted
                logger.info("connection to MCP server %s ended: %s", self.target, _describe(e))
        finally:
            if stderr is not None:
                await stderr.aclose()

    async def _enter_session(
        self, stack: contextlib.AsyncExitStack, stderr: "_StderrTail | None"
    ) -> ClientSession:
        options = self._options
        if options.command is not None:
            assert stderr is not None
            server = StdioServerParameters(
                command=options.command[0],
                args=options.command[1:],
                env=options.env,
                cwd=options.cwd,
            )
            try:
                read, write = await stack.enter_async_context(
                    stdio_client(server, errlog=stderr.writer)
                )
            finally:
                stderr.close_writer()  # the server holds its own copy; EOF comes when it exits
        else:
            assert options.url is not None
            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=options.headers,
                    timeout=httpx2.Timeout(
                        options.connect_timeout_seconds, read=HTTP_STREAM_READ_TIMEOUT_SECONDS
                    ),
                )
            )
            read, write = await stack.enter_async_context(
                streamable_http_client(options.url, http_client=http)
            )
        # The default read timeout bounds initialize and tools/list; tools/call passes its own.
        session = await stack.enter_async_context(
            ClientSession(read, write, read_timeout_seconds=options.connect_timeout_seconds)
        )
        await session.initialize()
        return session

    async def _stop_runner(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stop.set()
        done, _ = await asyncio.wait({runner}, timeout=SHUTDOWN_GRACE_SECONDS)
        if not done:
            logger.warning(
                "connection to MCP server %s did not stop within %g s; cancelling it",
                self.target,
                SHUTDOWN_GRACE_SECONDS,
            )
            runner.cancel()
            await asyncio.wait({runner}, timeout=SHUTDOWN_GRACE_SECONDS)


class _StderrTail:
    """A stdio server's stderr, read through a pipe: logged, and its end kept for errors."""

    def __init__(self, target: str):
        read_fd, write_fd = os.pipe()
        # stdio_client hands this to the subprocess as its stderr.
        self.writer = os.fdopen(write_fd, "w")
        self._target = target
        self._tail = bytearray()
        self._pump = asyncio.create_task(self._read(os.fdopen(read_fd, "rb", buffering=0)))

    def close_writer(self) -> None:
        """Closes our end of the pipe once the server has its copy (or failed to start)."""
        self.writer.close()

    def text(self) -> str:
        """The end of what the server wrote, decoded."""
        return self._tail.decode(errors="replace").strip()

    async def aclose(self) -> None:
        """Reads on until the server's stderr closes (bounded), then stops."""
        self.writer.close()
        done, _ = await asyncio.wait({self._pump}, timeout=STDERR_DRAIN_SECONDS)
        if not done:
            self._pump.cancel()
            await asyncio.wait({self._pump}, timeout=STDERR_DRAIN_SECONDS)

    async def _read(self, pipe: Any) -> None:
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            while chunk := await reader.read(4096):
                logger.debug(
                    "MCP server %s stderr: %s", self._target, chunk.decode(errors="replace")
                )
                self._tail += chunk
                del self._tail[:-STDERR_TAIL_BYTES]
        finally:
            transport.close()


def _leaves(error: BaseException) -> Iterator[BaseException]:
    """The exceptions inside an exception group (anyio task groups raise them), or the error."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _describe(error: BaseException) -> str:
    """An error as one line."""
    return "; ".join(
        leaf.message if isinstance(leaf, MCPError) else f"{type(leaf).__name__}: {leaf}"
        for leaf in _leaves(error)
    )
