"""Tools for testing the service around them, loaded by import path like any user tool."""

import asyncio
from typing import Any, ClassVar

from tool_svc.tools.base import Tool, ToolResult


class SleepTool(Tool):
    """Sleeps for `seconds`, recording how many calls overlap."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "sleep",
        "description": "Sleep for a while.",
        "parameters": {
            "type": "object",
            "properties": {"seconds": {"type": "number", "minimum": 0}},
            "required": ["seconds"],
        },
    }
    running = 0
    max_running = 0

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        cls = type(self)
        cls.running += 1
        cls.max_running = max(cls.max_running, cls.running)
        try:
            await asyncio.sleep(args["seconds"])
        finally:
            cls.running -= 1
        return ToolResult(text=f"slept {args['seconds']}s")


class CrashTool(Tool):
    """Fails with a bug (not a ToolCallError) on every call."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "crash",
        "description": "Always crashes.",
        "parameters": {"type": "object", "properties": {}},
    }

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        raise RuntimeError("probe bug with a secret detail")


class EchoTool(Tool):
    """Returns `text` repeated `times` times, and counts sessions released."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "echo",
        "description": "Echo text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
            "required": ["text"],
        },
    }
    released: ClassVar[list[Any]] = []

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        return ToolResult(text=args["text"] * args.get("times", 1))

    async def release(self, session: Any) -> None:
        type(self).released.append(session)


class HangingRewardTool(Tool):
    """A session tool whose trajectory reward never comes: CalcReward hangs."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "hanging_reward",
        "description": "Never finishes computing its reward.",
        "parameters": {"type": "object", "properties": {}},
    }
    requires_session = True

    async def calc_reward(self, session: Any) -> float:
        await asyncio.Event().wait()
        raise AssertionError("the event is never set")
