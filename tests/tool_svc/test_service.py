"""The tool service through a real gRPC server on loopback: every RPC, every failure kind,
limits, sessions and their TTL."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from google.protobuf import duration_pb2, struct_pb2

from tests.conftest import serve_in_process
from tests.tool_svc.probe_tools import EchoTool, SleepTool
from tool_svc.config import ToolConfig, ToolEntry, ToolLimits
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from tool_svc.tools.base import ToolErrorKind
from turnrl import rpc
from turnrl.config import ClientConfig, HttpJsonServerConfig
from turnrl.errors import ConfigError, ResourceExhaustedError, RpcError
from turnrl.v1 import tool_pb2, tool_pb2_grpc

PROBES = "tests.tool_svc.probe_tools"
Kind = tool_pb2.ToolError.Kind


def entry(class_name: str, **limits) -> ToolEntry:
    return ToolEntry(class_name=class_name, limits=ToolLimits(**limits) if limits else None)


@contextlib.asynccontextmanager
async def tool_server(
    *entries: ToolEntry, **settings
) -> AsyncIterator[tool_pb2_grpc.ToolServiceStub]:
    """A real tool service on 127.0.0.1:0 serving `entries`; yields a stub connected to it."""
    config = ToolConfig(server=HttpJsonServerConfig(port=0), tools=list(entries), **settings)
    service = await ToolService.create(config)
    try:
        async with (
            serve_in_process(
                config.server,
                tool_pb2.DESCRIPTOR.services_by_name["ToolService"],
                lambda server: tool_pb2_grpc.add_ToolServiceServicer_to_server(
                    ToolServicer(service), server
                ),
            ) as address,
            rpc.open_channel(ClientConfig(address=address)) as channel,
        ):
            yield tool_pb2_grpc.ToolServiceStub(channel)
    finally:
        await service.close()


async def execute(stub, tool: str, arguments, session_id: str = "", deadline_seconds: float = 10):
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    request = tool_pb2.ExecuteRequest(tool_name=tool, arguments=text, session_id=session_id)
    return (await stub.Execute(request, timeout=deadline_seconds)).result


async def test_list_tools_reports_schemas_and_limits():
    async with tool_server(
        entry("calculator", max_concurrency=2, rate_limit_per_second=5, call_timeout_seconds=1.5),
        entry("gsm8k_answer"),
    ) as stub:
        reply = await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
    calculator, gsm8k = reply.tools
    assert [calculator.schema.name, gsm8k.schema.name] == ["calculator", "gsm8k_answer"]
    assert json.loads(calculator.schema.parameters_json)["required"] == ["expression"]
    assert calculator.max_concurrency == 2 and calculator.rate_limit_per_second == 5
    assert calculator.call_timeout.ToTimedelta().total_seconds() == 1.5
    assert gsm8k.requires_session and not calculator.requires_session


async def test_execute_and_every_model_facing_failure():
    async with tool_server(entry("calculator"), entry(f"{PROBES}:CrashTool")) as stub:
        ok = await execute(stub, "calculator", {"expression": "6*7"})
        assert ok.text == "42" and not ok.HasField("error")
        cases = [
            ("calculator", "{broken", Kind.KIND_INVALID_ARGUMENTS, "not valid JSON"),
            ("calculator", {"expression": 1}, Kind.KIND_INVALID_ARGUMENTS, "not of type"),
            ("calculator", {"expression": "1/0"}, Kind.KIND_EXECUTION_FAILED, "division by zero"),
            ("nope", {}, Kind.KIND_UNKNOWN_TOOL, "unknown tool 'nope'; available: ['calculator'"),
            ("crash", {}, Kind.KIND_INTERNAL, "failed internally"),
        ]
        for tool, arguments, kind, message in cases:
            result = await execute(stub, tool, arguments)
            assert result.error.kind == kind, (tool, arguments)
            assert message in result.text and result.error.message == result.text
        assert "secret" not in (await execute(stub, "crash", {})).text
        assert (await execute(stub, "calculator", {"expression": "1+1"})).text == "2"


async def test_oversized_arguments_and_results():
    async with tool_server(
        entry(f"{PROBES}:EchoTool"), max_argument_bytes=100, max_result_bytes=64
    ) as stub:
        too_large = await execute(stub, "echo", {"text": "x" * 200})
        assert too_large.error.kind == Kind.KIND_TOO_LARGE and "at most 100" in too_large.text
        long = await execute(stub, "echo", {"text": "é", "times": 1000})
    assert long.text.startswith("é" * 32) and long.text.endswith("[truncated 1936 bytes]")
    assert long.metrics["result_truncated_bytes"] == 1936
    assert not long.HasField("error")


async def test_timeout_stops_the_call_and_the_service_goes_on():
    async with tool_server(entry(f"{PROBES}:SleepTool", call_timeout_seconds=0.2)) as stub:
        result = await execute(stub, "sleep", {"seconds": 30})
        assert result.error.kind == Kind.KIND_TIMEOUT and "within 0.2s" in result.text
        assert (await execute(stub, "sleep", {"seconds": 0})).text == "slept 0s"


async def test_caller_deadline_bounds_the_call_and_is_not_the_models_timeout():
    async with tool_server(entry(f"{PROBES}:SleepTool", call_timeout_seconds=30)) as stub:
        result = await execute(stub, "sleep", {"seconds": 30}, deadline_seconds=0.5)
    # Answered before the caller gave up, as the system's failure: the tool's own 30 s were
    # never spent.
    assert result.error.kind == Kind.KIND_DEADLINE_EXCEEDED
    assert "caller's deadline" in result.text and "30s limit" in result.text


async def test_a_call_cut_short_after_waiting_in_the_queue_is_deadline_exceeded():
    """The tool's own limit is 1 s and the caller allows 1.2 s: alone, a hung call runs into
    the tool's limit (the model's TIMEOUT); after 0.6 s in the queue, into the deadline."""
    config = ToolConfig(
        tools=[entry(f"{PROBES}:SleepTool", max_concurrency=1, call_timeout_seconds=1.0)]
    )
    service = await ToolService.create(config)
    try:
        loop = asyncio.get_running_loop()
        alone = await service.execute("sleep", '{"seconds": 30}', "", loop.time() + 1.2)
        # Tasks start in order, and the first takes the only slot before it first waits.
        first = asyncio.create_task(service.execute("sleep", '{"seconds": 0.6}', "", None))
        queued = asyncio.create_task(
            service.execute("sleep", '{"seconds": 30}', "", loop.time() + 1.2)
        )
        assert (await first).text == "slept 0.6s"
        cut_short = await queued
    finally:
        await service.close()
    assert alone.error_kind is ToolErrorKind.TIMEOUT and "within 1s" in alone.text
    assert cut_short.error_kind is ToolErrorKind.DEADLINE_EXCEEDED


async def test_parallel_calls_never_exceed_the_concurrency_cap():
    SleepTool.max_running = 0
    async with tool_server(entry(f"{PROBES}:SleepTool", max_concurrency=3)) as stub:
        results = await asyncio.gather(
            *(execute(stub, "sleep", {"seconds": 0.05}) for _ in range(24))
        )
    assert all(r.text == "slept 0.05s" for r in results)
    assert SleepTool.max_running == 3


async def test_full_queue_is_resource_exhausted():
    async with tool_server(entry(f"{PROBES}:SleepTool", max_concurrency=1, max_queue=1)) as stub:
        calls = [asyncio.ensure_future(execute(stub, "sleep", {"seconds": 0.3})) for _ in range(3)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, RpcError)]
    assert len(refused) == 1
    assert isinstance(refused[0], ResourceExhaustedError)
    assert "max_queue 1" in refused[0].details


async def test_no_slot_before_the_deadline_is_resource_exhausted():
    async with tool_server(entry(f"{PROBES}:SleepTool", max_concurrency=1)) as stub:
        busy = asyncio.ensure_future(execute(stub, "sleep", {"seconds": 1}))
        await asyncio.sleep(0.1)  # let the first call take the only slot
        with pytest.raises(ResourceExhaustedError) as info:
            await execute(stub, "sleep", {"seconds": 0}, deadline_seconds=0.4)
        await busy
    assert "no free slot before the deadline" in info.value.details


async def test_rate_limit_is_a_tool_error():
    limits = {"rate_limit_per_second": 1, "rate_limit_burst": 2, "max_rate_wait_seconds": 0}
    async with tool_server(entry("calculator", **limits)) as stub:
        results = [await execute(stub, "calculator", {"expression": "1"}) for _ in range(3)]
    assert [r.HasField("error") for r in results] == [False, False, True]
    assert results[2].error.kind == Kind.KIND_RATE_LIMITED and "1 calls/s" in results[2].text


async def test_each_of_two_replicas_enforces_half_the_rate_limit():
    limits = {"rate_limit_per_second": 2, "rate_limit_burst": 4, "max_rate_wait_seconds": 0}
    async with tool_server(entry("calculator", **limits), replicas=2) as stub:
        results = [await execute(stub, "calculator", {"expression": "1"}) for _ in range(3)]
        (calculator,) = (await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)).tools
    assert [r.HasField("error") for r in results] == [False, False, True]  # a burst of 4 / 2
    assert results[2].error.kind == Kind.KIND_RATE_LIMITED and "1 calls/s" in results[2].text
    assert calculator.rate_limit_per_second == 2  # what the whole service allows


async def test_rate_limit_waits_for_a_token_within_the_allowed_wait():
    limits = {"rate_limit_per_second": 20, "max_rate_wait_seconds": 1}
    async with tool_server(entry("calculator", **limits)) as stub:
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(
            *(execute(stub, "calculator", {"expression": "1"}) for _ in range(6))
        )
        elapsed = loop.time() - started
    assert all(r.text == "1" for r in results)
    assert elapsed >= 5 / 20 * 0.9  # six calls at 20/s take at least five intervals


async def test_session_lifecycle():
    async with tool_server(entry("gsm8k_answer"), entry(f"{PROBES}:EchoTool")) as stub:
        kwargs = struct_pb2.Struct()
        kwargs.update({"ground_truth": "#### 72"})
        created = await stub.CreateSession(
            tool_pb2.CreateSessionRequest(tool_name="gsm8k_answer", session_kwargs=kwargs),
            timeout=5,
        )
        assert len(created.session_id) == 32 and created.expire_time.seconds > 0
        session = created.session_id
        result = await execute(stub, "gsm8k_answer", {"answer": "72"}, session)
        assert result.text == "Your answer 72 is correct." and result.step_reward == 0.0
        reward = await stub.CalcReward(tool_pb2.CalcRewardRequest(session_id=session), timeout=5)
        assert reward.reward == 1.0
        wrong_tool = await execute(stub, "echo", {"text": "x"}, session)
        assert wrong_tool.error.kind == Kind.KIND_UNKNOWN_SESSION
        release = tool_pb2.ReleaseSessionRequest(session_id=session)
        assert (await stub.ReleaseSession(release, timeout=5)).released
        assert not (await stub.ReleaseSession(release, timeout=5)).released
        gone = await execute(stub, "gsm8k_answer", {"answer": "72"}, session)
        assert gone.error.kind == Kind.KIND_UNKNOWN_SESSION
        no_session = await execute(stub, "gsm8k_answer", {"answer": "72"})
        assert (
            no_session.error.kind == Kind.KIND_UNKNOWN_SESSION
            and "needs a session" in no_session.text
        )


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (tool_pb2.CreateSessionRequest(tool_name="nope"), "NOT_FOUND", "unknown tool 'nope'"),
        (
            tool_pb2.CreateSessionRequest(tool_name="gsm8k_answer"),
            "INVALID_ARGUMENT",
            "needs ground_truth",
        ),
        (tool_pb2.CreateSessionRequest(), "INVALID_ARGUMENT", "tool_name is required"),
        (
            tool_pb2.CreateSessionRequest(tool_name="echo", ttl=duration_pb2.Duration(seconds=-1)),
            "INVALID_ARGUMENT",
            "ttl must be positive",
        ),
        (tool_pb2.CalcRewardRequest(session_id="abc"), "NOT_FOUND", "no open session 'abc'"),
    ],
)
async def test_bad_session_requests(request_, code, message):
    async with tool_server(entry("gsm8k_answer"), entry(f"{PROBES}:EchoTool")) as stub:
        method = (
            stub.CreateSession
            if isinstance(request_, tool_pb2.CreateSessionRequest)
            else stub.CalcReward
        )
        with pytest.raises(RpcError) as info:
            await method(request_, timeout=5)
    assert info.value.status == code
    assert message in info.value.details


async def test_idle_sessions_expire_and_are_released():
    EchoTool.released.clear()
    async with tool_server(entry(f"{PROBES}:EchoTool")) as stub:
        kwargs = struct_pb2.Struct()
        kwargs.update({"marker": "ttl-test"})
        created = await stub.CreateSession(
            tool_pb2.CreateSessionRequest(
                tool_name="echo",
                session_kwargs=kwargs,
                ttl=duration_pb2.Duration(nanos=200_000_000),
            ),
            timeout=5,
        )
        assert (await execute(stub, "echo", {"text": "a"}, created.session_id)).text == "a"
        await asyncio.sleep(0.6)  # past the 0.2 s TTL: the reaper runs on its own timer
        expired = await execute(stub, "echo", {"text": "a"}, created.session_id)
    assert expired.error.kind == Kind.KIND_UNKNOWN_SESSION
    assert {"marker": "ttl-test"} in EchoTool.released


async def test_session_cap_is_resource_exhausted():
    async with tool_server(entry(f"{PROBES}:EchoTool"), max_sessions=2) as stub:
        request = tool_pb2.CreateSessionRequest(tool_name="echo")
        for _ in range(2):
            await stub.CreateSession(request, timeout=5)
        with pytest.raises(ResourceExhaustedError):
            await stub.CreateSession(request, timeout=5)


async def test_close_releases_open_sessions():
    EchoTool.released.clear()
    async with tool_server(entry(f"{PROBES}:EchoTool")) as stub:
        kwargs = struct_pb2.Struct()
        kwargs.update({"marker": "close-test"})
        await stub.CreateSession(
            tool_pb2.CreateSessionRequest(tool_name="echo", session_kwargs=kwargs), timeout=5
        )
    assert {"marker": "close-test"} in EchoTool.released


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([ToolEntry(class_name="nope")], "unknown tool 'nope'; built-in: ['calculator'"),
        ([ToolEntry(class_name="no_such_module:Tool")], "cannot import 'no_such_module:Tool'"),
        ([ToolEntry(class_name="json:JSONDecoder")], "is neither a Tool subclass nor a function"),
        ([ToolEntry(class_name="calculator", config={"max_value_bit": 1})], "max_value_bit"),
        ([ToolEntry(class_name="calculator"), ToolEntry(class_name="calculator")], "duplicate"),
    ],
)
async def test_bad_tool_config_names_the_entry(tools, message):
    with pytest.raises(ConfigError) as info:
        await ToolService.create(ToolConfig(server=HttpJsonServerConfig(port=0), tools=tools))
    assert message in str(info.value) and "tool.tools[" in str(info.value)


async def test_tools_file_in_verl_shape_and_schema_override(tmp_path):
    tools_file = tmp_path / "tools.yaml"
    tools_file.write_text(
        "tools:\n"
        "  - class_name: calculator\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: Arithmetic.\n"
        "        parameters: {type: object, properties: {expression: {type: string}}, "
        "required: [expression]}\n"
    )
    async with tool_server(tools_file=tools_file) as stub:
        reply = await stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
        assert [t.schema.name for t in reply.tools] == ["calc"]
        assert (await execute(stub, "calc", {"expression": "2+3"})).text == "5"
