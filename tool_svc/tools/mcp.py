"""The `mcp` tool: serves the tools of one MCP server, a stdio command or a streamable-HTTP URL.

One config entry becomes one `McpTool` per remote tool, named `<prefix><remote name>` and
described by the remote tool's own schema; all of them share one `McpConnection`
(tool_svc/tools/mcp_connection.py, with the entry's options).
"""

import base64
import binascii
import json
import re
from typing import Any, ClassVar

from mcp import types

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolImage, ToolResult
from tool_svc.tools.mcp_connection import McpConnection, McpOptions

TOOL_NAME_MAX_CHARS = 64


class McpTool(Tool):
    """One tool of an MCP server, forwarded through the connection its server's tools share."""

    # Only the name is used: an entry without a `name` is called 'mcp', so its prefix is 'mcp_'.
    # Each proxied tool is built with the remote tool's schema.
    schema: ClassVar[dict[str, Any]] = {
        "name": "mcp",
        "description": "The tools of an MCP server.",
        "parameters": {"type": "object"},
    }
    Options = McpOptions

    def __init__(
        self,
        name: str,
        options: McpOptions,
        schema: dict[str, Any],
        connection: McpConnection,
        remote_name: str,
    ):
        super().__init__(name, options, schema)
        self.connection = connection
        self.remote_name = remote_name

    @classmethod
    async def from_config(
        cls, name: str, options: dict[str, Any], schema: dict[str, Any] | None
    ) -> list[Tool]:
        """Connects to the server and returns one tool per remote tool, sharing the connection.

        Raises pydantic.ValidationError for bad options, ValueError for a `tool_schema` or
        names that collide, RuntimeError when the server does not start, answer or list tools.
        """
        if schema is not None:
            raise ValueError(
                f"mcp entry {name!r}: `tool_schema` is not supported; each proxied tool "
                "brings its server's schema"
            )
        parsed = McpOptions.model_validate(options)
        prefix = f"{name}_" if parsed.tool_name_prefix is None else parsed.tool_name_prefix
        connection = McpConnection(parsed)
        await connection.open()
        try:
            remote_tools = await connection.list_tools()
            if not remote_tools:
                raise RuntimeError(f"MCP server {connection.target} lists no tools")
            tools: dict[str, McpTool] = {}
            for remote in remote_tools:
                tool_name = _tool_name(prefix, remote.name)
                if tool_name in tools:
                    raise ValueError(
                        f"MCP tools {tools[tool_name].remote_name!r} and {remote.name!r} of "
                        f"{connection.target} both become {tool_name!r}; names keep "
                        f"[a-zA-Z0-9_.-] and {TOOL_NAME_MAX_CHARS} characters"
                    )
                remote_schema = {
                    "name": tool_name,
                    "description": remote.description or remote.title or remote.name,
                    "parameters": remote.input_schema,
                }
                tools[tool_name] = cls(tool_name, parsed, remote_schema, connection, remote.name)
        except BaseException:
            await connection.close()
            raise
        return list(tools.values())

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        """Forwards `args` to the remote tool; an `isError` result is EXECUTION_FAILED."""
        result = await self.connection.call_tool(self.remote_name, args)
        texts: list[str] = []
        images: list[ToolImage] = []
        for block in result.content:
            if isinstance(block, types.ImageContent):
                images.append(_image(block))
            else:
                texts.append(_render(block))
        if not result.content and result.structured_content is not None:
            texts.append(json.dumps(result.structured_content))
        text = "\n".join(texts)
        if result.is_error:
            raise ToolCallError(
                ToolErrorKind.EXECUTION_FAILED,
                text or f"{self.remote_name} failed without a message",
            )
        return ToolResult(text=text, images=images)

    async def close(self) -> None:
        """Closes the shared connection; the first of its tools to close does it."""
        await self.connection.close()


def _tool_name(prefix: str, remote_name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", prefix + remote_name)[:TOOL_NAME_MAX_CHARS]


def _image(block: types.ImageContent) -> ToolImage:
    try:
        data = base64.b64decode(block.data, validate=True)
    except binascii.Error:
        raise ToolCallError(
            ToolErrorKind.EXECUTION_FAILED,
            f"the MCP server returned a {block.mime_type} image whose data is not base64",
        ) from None
    return ToolImage(data=data, mime_type=block.mime_type)


def _render(block: types.ContentBlock) -> str:
    """A non-image content block as text: text as is, anything else as a short note."""
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, types.TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        return (
            f"[binary resource {resource.uri} ({resource.mime_type or 'unknown type'}) not shown]"
        )
    if isinstance(block, types.ResourceLink):
        return f"[resource link {block.uri}: {block.name}]"
    if isinstance(block, types.AudioContent):
        return f"[audio ({block.mime_type}) not shown]"
    return f"[{block.type} content not shown]"
