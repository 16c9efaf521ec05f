"""The fuzz suite's own check: which statuses count as the server's failure, per RPC."""

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.conftest import serve_in_process
from tool_svc.config import ToolConfig, ToolEntry, ToolLimits
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from turnrl.config import HttpJsonServerConfig
from turnrl.v1 import rollout_pb2, tool_pb2, tool_pb2_grpc

from .rpc_fuzzing import check_status, open_raw_channel, server_failed, serving_in_thread

TOOL_SERVICE = tool_pb2.DESCRIPTOR.services_by_name["ToolService"]
CALC_REWARD = TOOL_SERVICE.methods_by_name["CalcReward"]
INIT_WEIGHT_SYNC = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name[
    "InitWeightSync"
]


@contextlib.asynccontextmanager
async def hanging_calc_reward() -> AsyncIterator[tuple[str, str]]:
    """A tool service whose CalcReward of one open session never answers; yields its address
    and the session's id."""
    tool = ToolEntry(
        class_name="tests.tool_svc.probe_tools:HangingRewardTool",
        limits=ToolLimits(call_timeout_seconds=1),
    )
    config = ToolConfig(server=HttpJsonServerConfig(port=0), tools=[tool])
    service = await ToolService.create(config)
    try:
        session_id, _ = await service.create_session("hanging_reward", {}, None)
        async with serve_in_process(
            config.server,
            TOOL_SERVICE,
            lambda s: tool_pb2_grpc.add_ToolServiceServicer_to_server(ToolServicer(service), s),
        ) as address:
            yield address, session_id
    finally:
        await service.close()


def test_a_handler_that_runs_into_the_callers_deadline_fails_the_check():
    with serving_in_thread(hanging_calc_reward) as (address, session_id):
        channel = open_raw_channel(address)
        try:
            request = tool_pb2.CalcRewardRequest(session_id=session_id).SerializeToString()
            with pytest.raises(AssertionError, match="CalcReward: DEADLINE_EXCEEDED"):
                check_status(channel, CALC_REWARD, [request], timeout_seconds=0.5)
        finally:
            channel.close()


def test_deadline_exceeded_is_an_answer_only_where_the_proto_gives_it():
    assert not server_failed(INIT_WEIGHT_SYNC, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert server_failed(CALC_REWARD, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert not server_failed(CALC_REWARD, grpc.StatusCode.NOT_FOUND)
    assert server_failed(CALC_REWARD, grpc.StatusCode.INTERNAL)
