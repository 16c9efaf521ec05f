"""Real tool, reward and rollout services in this event loop, on loopback: what the rollout
service, the code scorer and a judge served by turnrl call."""

import contextlib
from collections.abc import AsyncIterator, Callable

from reward_svc.config import RewardConfig
from reward_svc.server import RewardServicer
from reward_svc.service import RewardService
from rollout_svc.config import RolloutConfig
from rollout_svc.server import RolloutServicer
from rollout_svc.service import RolloutService
from tests.conftest import serve_in_process
from tool_svc.config import ToolConfig, ToolEntry
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from turnrl.config import ClientConfig, HttpJsonServerConfig, ServerConfig
from turnrl.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    tool_pb2,
    tool_pb2_grpc,
)


@contextlib.asynccontextmanager
async def tool_service_address(
    *tools: ToolEntry,
    port: int = 0,
    servicer: Callable[[ToolService], ToolServicer] = ToolServicer,
) -> AsyncIterator[str]:
    """A tool service serving `tools` (default: `calculator`) on loopback `port` (0: a free
    one), its RPCs answered by `servicer` (a test's may record them); yields its address."""
    entries = list(tools) or [ToolEntry(class_name="calculator")]
    config = ToolConfig(server=HttpJsonServerConfig(port=port), tools=entries)
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
    servicer: Callable[[RewardService], RewardServicer] = RewardServicer, **settings
) -> AsyncIterator[str]:
    """A reward service with one worker on loopback, configured with `settings` (plugins,
    ...), its RPCs answered by `servicer`; yields its address."""
    config = RewardConfig(server=HttpJsonServerConfig(port=0), workers=1, **settings)
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


@contextlib.asynccontextmanager
async def rollout_service_address(
    model_dir,
    servicer: Callable[[RolloutService], RolloutServicer] = RolloutServicer,
    **settings,
) -> AsyncIterator[str]:
    """A rollout service on the hf engine serving the model in `model_dir` on loopback, with
    its own tool and reward services and `settings` for the rest of its config, its RPCs
    answered by `servicer`; yields its address."""
    async with tool_service_address() as tools, reward_service_address() as rewards:
        config = RolloutConfig(
            server=ServerConfig(port=0),
            model_path=str(model_dir),
            tool_service=ClientConfig(address=tools),
            reward_service=ClientConfig(address=rewards),
            **settings,
        )
        service = await RolloutService.create(config)
        try:
            async with serve_in_process(
                config.server,
                rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
                lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                    servicer(service), s
                ),
            ) as address:
                yield address
        finally:
            await service.close()
