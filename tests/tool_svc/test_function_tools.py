"""Plain Python functions as tools (schema from transformers' get_json_schema), through a real
tool service on loopback."""

import asyncio
import json

import pytest

from tests.tool_svc.test_service import Kind, entry, execute, tool_server
from tool_svc.config import ToolConfig, ToolEntry
from tool_svc.service import ToolService
from turnrl.config import HttpJsonServerConfig
from turnrl.errors import ConfigError
from turnrl.v1 import tool_pb2

FUNCTIONS = "tests.tool_svc.probe_functions"


async def test_sync_and_async_functions_are_listed_with_their_schemas():
    async with tool_server(entry(f"{FUNCTIONS}:add"), entry(f"{FUNCTIONS}:repeat")) as stub:
        reply = await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
    add, repeat = reply.tools
    assert (add.schema.name, add.schema.description) == ("add", "Adds two integers.")
    assert json.loads(add.schema.parameters_json) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first addend."},
            "b": {"type": "integer", "description": "The second addend."},
        },
        "required": ["a", "b"],
    }
    assert json.loads(repeat.schema.parameters_json)["required"] == ["text"]


async def test_function_results_and_model_facing_errors():
    async with tool_server(
        entry(f"{FUNCTIONS}:add"), entry(f"{FUNCTIONS}:repeat"), entry(f"{FUNCTIONS}:divide")
    ) as stub:
        assert (await execute(stub, "add", {"a": 2, "b": 3})).text == "5"
        assert (await execute(stub, "repeat", {"text": "hi"})).text == '["hi", "hi"]'
        assert (await execute(stub, "divide", {"a": 1, "b": 4})).text == "0.25"
        cases = [
            ("add", {"a": 2}, Kind.KIND_INVALID_ARGUMENTS, "'b' is a required property"),
            ("add", {"a": 2, "b": "3"}, Kind.KIND_INVALID_ARGUMENTS, "'3' is not of type"),
            ("add", {"a": 2, "b": 3, "c": 4}, Kind.KIND_INVALID_ARGUMENTS, "argument 'c'"),
            ("divide", {"a": 1, "b": 0}, Kind.KIND_EXECUTION_FAILED, "ZeroDivisionError"),
        ]
        for tool, arguments, kind, message in cases:
            result = await execute(stub, tool, arguments)
            assert result.error.kind == kind, (tool, arguments, result)
            assert message in result.text and result.error.message == result.text


async def test_function_tools_obey_timeouts_and_concurrency_caps():
    async with tool_server(
        entry(f"{FUNCTIONS}:wait", call_timeout_seconds=0.2, max_concurrency=1)
    ) as stub:
        late = await execute(stub, "wait", {"seconds": 1.0})
        assert late.error.kind == Kind.KIND_TIMEOUT
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(
            *(execute(stub, "wait", {"seconds": 0.05}) for _ in range(3))
        )
        elapsed = asyncio.get_running_loop().time() - started
    assert [r.text for r in results] == ["done"] * 3
    assert elapsed >= 0.15  # one at a time


@pytest.mark.parametrize(
    ("class_name", "message"),
    [
        (f"{FUNCTIONS}:undocumented", "undocumented cannot be a tool: Cannot generate JSON schema"),
        ("json:loads", "loads cannot be a tool"),
    ],
)
async def test_function_without_docstring_or_type_hints_stops_start_up(class_name, message):
    config = ToolConfig(
        server=HttpJsonServerConfig(port=0), tools=[ToolEntry(class_name=class_name)]
    )
    with pytest.raises(ConfigError) as info:
        await ToolService.create(config)
    assert f"tool.tools[0] ({class_name}) cannot start" in str(info.value)
    assert message in str(info.value)
