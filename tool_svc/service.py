"""ToolService: the tool registry, sessions with a TTL, per-tool limits, timeouts and metrics.

A plain async class (no gRPC): `server.py` converts protos to these calls and back. Every
failure of a call on the model's behalf comes back as an error `ToolResult` the model reads,
whose kind says whose fault it is (turnrl/failures.py): a call that ran past the tool's own
`call_timeout_seconds` is the model's TIMEOUT; one the caller's deadline stopped first (it
waited in the queue, or the deadline was shorter) is the system's DEADLINE_EXCEEDED. Only a
call the service cannot take on (queue full, no slot before the deadline, too many sessions)
raises, as ResourceExhaustedError.
"""

import asyncio
import contextlib
import importlib
import inspect
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from tool_svc.config import ToolConfig, ToolEntry, ToolLimits
from tool_svc.limits import RateLimitedError, ToolLimiter, replica_share
from tool_svc.metrics import ToolMetrics
from tool_svc.tools import TOOLS
from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from tool_svc.tools.function import FunctionTool
from turnrl.errors import (
    ConfigError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

log = logging.getLogger(__name__)
TRUNCATION_NOTE = "\n...[truncated {} bytes]"


@dataclass(frozen=True)
class ToolInfo:
    """A served tool as ListTools reports it."""

    schema: dict[str, Any]
    limits: ToolLimits
    requires_session: bool


@dataclass
class Session:
    """One open session: the tool, its state, and when it expires unless used."""

    session_id: str
    tool: Tool
    state: Any
    ttl_seconds: float
    expires_at: float  # time.monotonic()
    # One call at a time per session: stateful tools (an interpreter) are not reentrant.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def touch(self) -> None:
        self.expires_at = time.monotonic() + self.ttl_seconds


class ToolService:
    """Serves the configured tools. Build with `await ToolService.create(config)`."""

    def __init__(
        self, config: ToolConfig, tools: dict[str, Tool], limits: dict[str, ToolLimits]
    ) -> None:
        self._config = config
        self._tools = tools
        self._limits = limits
        self._limiters = {
            name: ToolLimiter(name, replica_share(limits, config.replicas))
            for name, limits in self._limits.items()
        }
        self._sessions: dict[str, Session] = {}
        self._expiry_changed = asyncio.Event()  # wakes the reaper to recompute its next expiry
        self.metrics = ToolMetrics()
        for name, limiter in self._limiters.items():
            self.metrics.queue_depth.labels(tool=name).set_function(lambda lim=limiter: lim.waiting)
            self.metrics.in_flight.labels(tool=name).set_function(lambda lim=limiter: lim.running)
            self.metrics.live_sessions.labels(tool=name).set(0)
        self._reaper = asyncio.create_task(self._expire_sessions(), name="tool-session-reaper")

    @classmethod
    async def create(cls, config: ToolConfig) -> "ToolService":
        """Builds every configured tool. Raises ConfigError naming the entry that fails."""
        entries = list(config.tools) + _entries_from_file(config)
        tools: dict[str, Tool] = {}
        limits: dict[str, ToolLimits] = {}
        try:
            for index, entry in enumerate(entries):
                for tool in await _build(entry, index):
                    if tool.name in tools:
                        raise ConfigError(f"tool.tools[{index}]: duplicate tool name {tool.name!r}")
                    tools[tool.name] = tool
                    limits[tool.name] = entry.limits or config.default_limits
        except BaseException:
            await asyncio.gather(*(tool.close() for tool in tools.values()))
            raise
        return cls(config, tools, limits)

    def list_tools(self) -> list[ToolInfo]:
        """Every served tool, sorted by name."""
        return [
            ToolInfo(tool.schema, self._limits[name], tool.requires_session)
            for name, tool in sorted(self._tools.items())
        ]

    async def create_session(
        self, tool_name: str, session_kwargs: dict[str, Any], ttl_seconds: float | None
    ) -> tuple[str, float]:
        """Opens a session of `tool_name`; returns its id and TTL in seconds.

        Raises NotFoundError for an unknown tool, InvalidArgumentError when the tool rejects
        the kwargs, ResourceExhaustedError at `max_sessions`.
        """
        tool = self._tool(tool_name)
        if len(self._sessions) >= self._config.max_sessions:
            raise ResourceExhaustedError(
                f"{len(self._sessions)} sessions are open (max_sessions "
                f"{self._config.max_sessions}); release some first"
            )
        try:
            state = await tool.create(**session_kwargs)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"tool {tool_name!r} rejected session kwargs: {e}") from e
        ttl = ttl_seconds or self._config.session_ttl_seconds
        session_id = secrets.token_hex(16)
        session = Session(session_id, tool, state, ttl, time.monotonic() + ttl)
        self._sessions[session_id] = session
        self._expiry_changed.set()
        self.metrics.live_sessions.labels(tool=tool.name).inc()
        return session_id, ttl

    async def execute(
        self, tool_name: str, arguments: str, session_id: str, deadline: float | None
    ) -> ToolResult:
        """Runs one call; failures on the model's behalf come back as error results.

        `deadline` is the `loop.time()` by which the caller needs the answer (None: none).
        Raises ResourceExhaustedError when the call cannot start before it.
        """
        started = time.monotonic()
        self.metrics.calls.labels(tool=tool_name).inc()
        try:
            result = await self._execute(tool_name, arguments, session_id, deadline)
        except ResourceExhaustedError:
            self.metrics.errors.labels(tool=tool_name, kind="QUEUE_FULL").inc()
            raise
        if result.error_kind is not None:
            self.metrics.errors.labels(tool=tool_name, kind=result.error_kind.value).inc()
        self.metrics.latency.labels(tool=tool_name).observe(time.monotonic() - started)
        return result

    async def calc_reward(self, session_id: str) -> tuple[float, dict[str, float]]:
        """The session's trajectory-level reward. NotFoundError for an unknown session."""
        session = self._session(session_id)
        async with self._in_use(session):
            return await session.tool.calc_reward(session.state), {}

    async def release_session(self, session_id: str) -> bool:
        """Releases a session; False when it was already gone (idempotent)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        await self._release(session)
        return True

    async def close(self) -> None:
        """Stops the reaper, releases every session and closes every tool."""
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(self._release(s) for s in sessions))
        await asyncio.gather(*(tool.close() for tool in self._tools.values()))

    async def _execute(
        self, tool_name: str, arguments: str, session_id: str, deadline: float | None
    ) -> ToolResult:
        tool = self._tools.get(tool_name)
        if tool is None:
            return ToolResult.failure(
                ToolErrorKind.UNKNOWN_TOOL,
                f"unknown tool {tool_name!r}; available: {sorted(self._tools)}",
            )
        size = len(arguments.encode())
        if size > self._config.max_argument_bytes:
            return ToolResult.failure(
                ToolErrorKind.TOO_LARGE,
                f"arguments are {size} bytes; at most {self._config.max_argument_bytes} allowed",
            )
        try:
            args = tool.parse_args(arguments)
        except ToolCallError as e:
            return ToolResult.failure(e.kind, e.message)
        if session_id:
            session = self._sessions.get(session_id)
            if session is None or session.tool is not tool:
                return ToolResult.failure(
                    ToolErrorKind.UNKNOWN_SESSION,
                    f"no open session {session_id!r} of tool {tool_name!r}",
                )
            async with self._in_use(session):
                return await self._run(tool, session.state, args, deadline)
        if tool.requires_session:
            return ToolResult.failure(
                ToolErrorKind.UNKNOWN_SESSION, f"tool {tool_name!r} needs a session; none given"
            )
        state = await tool.create()
        try:
            return await self._run(tool, state, args, deadline)
        finally:
            await tool.release(state)

    async def _run(
        self, tool: Tool, state: Any, args: dict[str, Any], deadline: float | None
    ) -> ToolResult:
        limit = self._limits[tool.name].call_timeout_seconds
        caller_deadline_first = False
        try:
            async with self._limiters[tool.name].slot(deadline):
                timeout = limit
                if deadline is not None:
                    left = deadline - asyncio.get_running_loop().time()
                    caller_deadline_first = left < limit
                    timeout = min(limit, left)
                async with asyncio.timeout(max(timeout, 0.0)):
                    result = await tool.execute(state, args)
        except RateLimitedError as e:
            return ToolResult.failure(ToolErrorKind.RATE_LIMITED, str(e))
        except TimeoutError:
            if caller_deadline_first:  # the call never had the tool's own limit to spend
                return ToolResult.failure(
                    ToolErrorKind.DEADLINE_EXCEEDED,
                    f"tool {tool.name!r} was stopped after {max(timeout, 0.0):.3g}s: the "
                    f"caller's deadline came before the tool's own {limit:g}s limit",
                )
            return ToolResult.failure(
                ToolErrorKind.TIMEOUT,
                f"tool {tool.name!r} did not finish within {timeout:.3g}s and was stopped",
            )
        except ToolCallError as e:
            return ToolResult.failure(e.kind, e.message)
        except (ResourceExhaustedError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("tool %r failed on %r", tool.name, args)
            return ToolResult.failure(
                ToolErrorKind.INTERNAL, f"tool {tool.name!r} failed internally; see the service log"
            )
        return self._truncated(result)

    def _truncated(self, result: ToolResult) -> ToolResult:
        encoded = result.text.encode()
        limit = self._config.max_result_bytes
        if len(encoded) <= limit:
            return result
        kept = encoded[:limit].decode(errors="ignore")
        result.text = kept + TRUNCATION_NOTE.format(len(encoded) - len(kept.encode()))
        result.metrics["result_truncated_bytes"] = float(len(encoded) - len(kept.encode()))
        return result

    @contextlib.asynccontextmanager
    async def _in_use(self, session: Session) -> AsyncIterator[None]:
        """Holds the session for one call; its idle time counts from the end of the call."""
        async with session.lock:
            try:
                yield
            finally:
                session.touch()
                self._expiry_changed.set()

    def _tool(self, tool_name: str) -> Tool:
        tool = self._tools.get(tool_name)
        if tool is None:
            raise NotFoundError(f"unknown tool {tool_name!r}; available: {sorted(self._tools)}")
        return tool

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(
                f"no open session {session_id!r} (never created, released or expired)"
            )
        return session

    async def _release(self, session: Session) -> None:
        self.metrics.live_sessions.labels(tool=session.tool.name).dec()
        try:
            async with asyncio.timeout(self._limits[session.tool.name].call_timeout_seconds):
                async with session.lock:
                    await session.tool.release(session.state)
        except Exception:
            log.exception(
                "releasing session %s of %r failed", session.session_id, session.tool.name
            )

    async def _expire_sessions(self) -> None:
        """Releases sessions idle past their TTL. Sleeps until the next expiry, or until a
        session opens or ends a call; sessions in a call are not idle and do not count."""
        while True:
            now = time.monotonic()
            expired = [
                s for s in self._sessions.values() if s.expires_at <= now and not s.lock.locked()
            ]
            for session in expired:
                del self._sessions[session.session_id]
                log.info("session %s of %r expired", session.session_id, session.tool.name)
                await self._release(session)
            idle = [s for s in self._sessions.values() if not s.lock.locked()]
            next_expiry = min((s.expires_at for s in idle), default=None)
            delay = None if next_expiry is None else max(next_expiry - time.monotonic(), 0.01)
            self._expiry_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._expiry_changed.wait()


async def _build(entry: ToolEntry, index: int) -> list[Tool]:
    tool_class_or_function = _resolve(entry.class_name, index)
    schema = entry.tool_schema
    if schema is not None and "function" in schema:
        schema = schema["function"]
    try:
        if not isinstance(tool_class_or_function, type):
            return [
                FunctionTool.from_function(tool_class_or_function, entry.name, entry.config, schema)
            ]
        name = entry.name or (schema or tool_class_or_function.schema)["name"]
        return await tool_class_or_function.from_config(name, entry.config, schema)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(
            f"tool.tools[{index}] ({entry.class_name}): bad config: {problems}"
        ) from None
    except (ValueError, RuntimeError, OSError) as e:
        # A tool that cannot start (no sandbox, an MCP server that fails, a function with no
        # schema) stops the service.
        raise ConfigError(f"tool.tools[{index}] ({entry.class_name}) cannot start: {e}") from e


def _resolve(class_name: str, index: int) -> type[Tool] | Callable[..., Any]:
    """The built-in tool class, or what the import path names: a Tool subclass or a function."""
    if class_name in TOOLS:
        return TOOLS[class_name]
    module_name, sep, attribute = class_name.rpartition(":" if ":" in class_name else ".")
    if not sep or not module_name:
        raise ConfigError(
            f"tool.tools[{index}].class_name: unknown tool {class_name!r}; built-in: "
            f"{sorted(TOOLS)}, or an import path like 'my_pkg.tools:MyTool' or "
            "'my_pkg.tools:my_function'"
        )
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"tool.tools[{index}].class_name: cannot import {class_name!r}: {e}"
        ) from e
    if (isinstance(target, type) and issubclass(target, Tool)) or inspect.isfunction(target):
        return target
    raise ConfigError(
        f"tool.tools[{index}].class_name: {class_name!r} is neither a Tool subclass nor a function"
    )


def _entries_from_file(config: ToolConfig) -> list[ToolEntry]:
    if config.tools_file is None:
        return []
    try:
        data = yaml.safe_load(config.tools_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"tool.tools_file {str(config.tools_file)!r}: {e}") from e
    try:
        return [ToolEntry.model_validate(item) for item in data.get("tools", [])]
    except ValidationError as e:
        raise ConfigError(f"{config.tools_file}: bad tool entry: {e}") from None
