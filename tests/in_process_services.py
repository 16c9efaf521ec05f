"""Real tool and reward services in this event loop, on loopback: what the rollout service and
the code scorer call."""

import contextlib
from collections.abc import AsyncIterator, Callable

from reward_svc.config import RewardConfig
from reward_svc.server import RewardServicer
from reward_svc.service import RewardService
from tests.conftest import serve_in_process
from tool_svc.config import ToolConfig, ToolEntry
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from turnrl.config import ServerConfig
from turnrl.v1 import reward_pb2, reward_pb2_grpc, tool_pb2, tool_pb2_grpc


@contextlib.asynccontextmanager
async def tool_service_address(
    *tools: ToolEntry,
    port: int = 0,
    servicer: Callable[[ToolService], ToolServicer] = ToolServicer,
) -> AsyncIterator[str]:
    """A tool service serving `tools` (default: `calculator`) on loopback `port` (0: a free
    one), its RPCs answered by `servicer` (a test's may record them); yields its address."""
    entries = list(tools) or [ToolEntry(class_name="calculator")]
    config = ToolConfig(server=ServerConfig(port=port), tools=entries)
    service = await ToolService.create(config)
    try:
        async with serve_in_process(
            config.server,
            tool_pb2.DESCRIPTOR.services_by_name["ToolService"],
            lambda s: tool_pb2_grpc.add_ToolServiceServicer_to_server(servicer(service), s),
        ) as address:
            yield address
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def reward_service_address(
    servicer: Callable[[RewardService], RewardServicer] = RewardServicer,
) -> AsyncIterator[str]:
    """A reward service with one worker on loopback, its RPCs answered by `servicer`; yields
    its address."""
    config = RewardConfig(server=ServerConfig(port=0), workers=1)
    service = await RewardService.create(config)
    try:
        async with serve_in_process(
            config.server,
            reward_pb2.DESCRIPTOR.services_by_name["RewardService"],
            lambda s: reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer(service), s),
        ) as address:
            yield address
    finally:
        await service.close()
