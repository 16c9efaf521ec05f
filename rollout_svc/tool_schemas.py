"""The schemas of the tools a prompt names, from the tool service that runs them.

A prompt names its tools; their schemas (what the chat template renders into the prompt) come
from the tool service's ListTools, so the model is shown exactly the tools the service will run.
Schemas are cached by name; a name not in the cache asks the service again, since MCP servers
behind it can add tools while it runs.
"""

import asyncio
import json
from typing import Any

from rollout_svc.tool_client import ToolClient
from turnrl.errors import InvalidArgumentError
from turnrl.v1 import common_pb2, tool_pb2


class ToolSchemas:
    """OpenAI tool schemas by tool name, as the tool service serves them."""

    def __init__(self, tool_client: ToolClient) -> None:
        self._tool_client = tool_client
        self._schemas: dict[str, dict[str, Any]] = {}
        self._refresh_lock = asyncio.Lock()

    async def resolve(self, names: list[str]) -> list[dict[str, Any]]:
        """The schemas of `names`, in their order. Raises InvalidArgumentError for a name the
        tool service does not serve; a failed ListTools raises its own error."""
        missing = [name for name in names if name not in self._schemas]
        if missing:
            async with self._refresh_lock:
                if any(name not in self._schemas for name in missing):
                    await self._refresh()
        unknown = [name for name in names if name not in self._schemas]
        if unknown:
            raise InvalidArgumentError(
                f"tools {unknown} are not served by the tool service; it serves "
                f"{sorted(self._schemas)}"
            )
        return [self._schemas[name] for name in names]

    async def _refresh(self) -> None:
        reply = await self._tool_client.list_tools(
            tool_pb2.ListToolsRequest(), timeout_seconds=self._tool_client.timeout_seconds
        )
        self._schemas = {info.schema.name: _openai_schema(info.schema) for info in reply.tools}


def _openai_schema(schema: common_pb2.ToolSchema) -> dict[str, Any]:
    function: dict[str, Any] = {
        "name": schema.name,
        "description": schema.description,
        "parameters": json.loads(schema.parameters_json or "{}"),
    }
    return {"type": "function", "function": function}
