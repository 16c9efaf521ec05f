"""gRPC skin of the tool service: proto -> plain types, await ToolService, plain -> proto.

Errors are raised as `turnrl.errors` exceptions and mapped to status codes by `turnrl.rpc`.
"""

import asyncio
import contextlib
import datetime
import json
from collections.abc import Sequence

from google.protobuf import duration_pb2, timestamp_pb2

from tool_svc.config import ToolConfig
from tool_svc.service import ToolInfo, ToolService
from tool_svc.tools.base import ToolResult
from turnrl import rpc, service_main
from turnrl.errors import InvalidArgumentError
from turnrl.rpc.http_json import serve_http_json
from turnrl.v1 import common_pb2, tool_pb2, tool_pb2_grpc

# Kept back from the caller's deadline, so that a DEADLINE_EXCEEDED result or
# RESOURCE_EXHAUSTED reaches the caller before it gives up: a tenth of the time left, within
# [0.05 s, 1 s], since stopping a call (killing a sandbox, removing its cgroup) takes longer on
# a loaded machine.
RESPONSE_MARGIN_FRACTION = 0.1
RESPONSE_MARGIN_BOUNDS_SECONDS = (0.05, 1.0)
# A Timestamp, like a datetime, ends with the year 9999.
LAST_EXPIRE_TIME = datetime.datetime.max.replace(tzinfo=datetime.UTC)


class ToolServicer(tool_pb2_grpc.ToolServiceServicer):
    """Implements turnrl.v1.ToolService over a ToolService."""

    def __init__(self, service: ToolService) -> None:
        self._service = service

    async def ListTools(self, request, context):
        return tool_pb2.ListToolsResponse(
            tools=[_tool_info_proto(info) for info in self._service.list_tools()]
        )

    async def CreateSession(self, request, context):
        _require(request.tool_name, "tool_name")
        ttl = rpc.positive_seconds(request.ttl, "ttl") if request.HasField("ttl") else None
        now = datetime.datetime.now(datetime.UTC)
        if ttl is not None and ttl > (LAST_EXPIRE_TIME - now).total_seconds():
            raise InvalidArgumentError(
                f"ttl {ttl!r}s ends after {LAST_EXPIRE_TIME}, the last time expire_time holds"
            )
        session_id, ttl_seconds = await self._service.create_session(
            request.tool_name, rpc.json_value(request.session_kwargs, "session_kwargs"), ttl
        )
        expire_time = timestamp_pb2.Timestamp()
        expire_time.FromDatetime(now + datetime.timedelta(seconds=ttl_seconds))
        return tool_pb2.CreateSessionResponse(session_id=session_id, expire_time=expire_time)

    async def Execute(self, request, context):
        _require(request.tool_name, "tool_name")
        remaining = context.time_remaining()
        deadline = None
        if remaining is not None:
            low, high = RESPONSE_MARGIN_BOUNDS_SECONDS
            margin = min(max(remaining * RESPONSE_MARGIN_FRACTION, low), high)
            deadline = asyncio.get_running_loop().time() + remaining - margin
        result = await self._service.execute(
            request.tool_name, request.arguments, request.session_id, deadline
        )
        return tool_pb2.ExecuteResponse(result=_tool_result_proto(result))

    async def CalcReward(self, request, context):
        _require(request.session_id, "session_id")
        reward, metrics = await self._service.calc_reward(request.session_id)
        return tool_pb2.CalcRewardResponse(reward=reward, metrics=metrics)

    async def ReleaseSession(self, request, context):
        _require(request.session_id, "session_id")
        released = await self._service.release_session(request.session_id)
        return tool_pb2.ReleaseSessionResponse(released=released)


async def serve(config: ToolConfig) -> None:
    """Builds the tools, then serves the tool service until SIGTERM or SIGINT, and its methods
    as JSON over HTTP beside it with `server.http_port` (turnrl.rpc.http_json)."""
    service = await ToolService.create(config)
    servicer = ToolServicer(service)
    descriptor = tool_pb2.DESCRIPTOR.services_by_name["ToolService"]
    try:
        async with contextlib.AsyncExitStack() as http_json:
            if config.server.http_port is not None:
                await http_json.enter_async_context(
                    serve_http_json(config.server, descriptor, servicer)
                )
            await rpc.serve(
                config.server,
                descriptor,
                lambda server: tool_pb2_grpc.add_ToolServiceServicer_to_server(servicer, server),
                metrics=service.metrics.registry,
            )
    finally:
        await service.close()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tool_svc`: serves the `tool:` section of `--config F` with its overrides
    (turnrl.service_main); `turnrl serve tool` ends in `serve` too."""
    service_main.run("tool", serve, service_main.load_config("tool", ToolConfig, argv))


def _require(value: str, field: str) -> None:
    if not value:
        raise InvalidArgumentError(f"{field} is required")


def _tool_info_proto(info: ToolInfo) -> tool_pb2.ToolInfo:
    schema = info.schema
    return tool_pb2.ToolInfo(
        schema=common_pb2.ToolSchema(
            name=schema["name"],
            description=schema.get("description", ""),
            parameters_json=json.dumps(schema.get("parameters", {})),
            strict=bool(schema.get("strict", False)),
        ),
        max_concurrency=info.limits.max_concurrency,
        rate_limit_per_second=info.limits.rate_limit_per_second,
        call_timeout=duration_pb2.Duration(
            seconds=int(info.limits.call_timeout_seconds),
            nanos=int(info.limits.call_timeout_seconds % 1 * 1e9),
        ),
        requires_session=info.requires_session,
    )


def _tool_result_proto(result: ToolResult) -> tool_pb2.ToolResult:
    proto = tool_pb2.ToolResult(
        text=result.text,
        images=[common_pb2.Image(data=i.data, mime_type=i.mime_type) for i in result.images],
        metrics=result.metrics,
    )
    if result.step_reward is not None:
        proto.step_reward = result.step_reward
    if result.error_kind is not None:
        proto.error.kind = tool_pb2.ToolError.Kind.Value(f"KIND_{result.error_kind.value}")
        proto.error.message = result.text
    return proto
