"""The four services as the fuzz tests run them: the real ones, in this process on loopback,
with a small message limit. Tool serves calculator and gsm8k_answer (two sessions of it are
open); reward has one worker; rollout runs the tiny model on the hf engine with small length
limits, so a Generate that passes validation takes a fraction of a second; the trainer's run
loops are to be replaced by `EndsAtOnce` (the `served` fixture does), so a StartRun that passes
validation trains nothing, and a run named RUN_NAME has run.
"""

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from reward_svc.config import RewardConfig
from reward_svc.scorers.code import CodeScorerOptions
from reward_svc.server import RewardServicer
from reward_svc.service import RewardService
from rollout_svc.config import RolloutConfig
from rollout_svc.server import RolloutServicer
from rollout_svc.service import RolloutService
from tests.conftest import serve_in_process
from tool_svc.config import ToolConfig, ToolEntry
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from trainer_svc.ranks import Ranks
from trainer_svc.run_loop import ProgressEvent, RunLoop
from trainer_svc.server import TrainerServicer
from trainer_svc.service import TrainerService
from turnrl.config import ClientConfig, HttpJsonServerConfig
from turnrl.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    tool_pb2,
    tool_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

SERVICES = [
    module.DESCRIPTOR.services_by_name[name]
    for module, name in (
        (tool_pb2, "ToolService"),
        (reward_pb2, "RewardService"),
        (rollout_pb2, "RolloutService"),
        (trainer_pb2, "TrainerService"),
    )
]
# Small, so that messages past it are cheap to send.
MAX_MESSAGE_BYTES = 256 * 1024
TOOLS = ("calculator", "gsm8k_answer")
RUN_NAME = "fuzzed"
# What a Generate that passes validation costs: at most 2 prompts (field_hints) x 2 samples x 2
# turns of at most 16 tokens.
ROLLOUT_LIMITS = {"max_model_len": 1024, "max_response_length": 32, "max_new_tokens": 16}


class EndsAtOnce(RunLoop):
    """A run loop that trains nothing and ends at once: a run the fuzzing starts costs nothing."""

    async def run(self, resume: bool) -> dict:
        self.emit(ProgressEvent(0, "setup", message="fuzzed"))
        return {}

    async def _train_step(self) -> None:
        raise AssertionError("a fuzzed run never trains")

    async def _evaluate(self) -> None:
        pass

    async def _checkpoint(self) -> None:
        pass

    def _summary(self, wall_seconds: float) -> dict:
        return {}


@dataclass(frozen=True)
class Served:
    """The four services' addresses by service name, and what the field hints need."""

    addresses: dict[str, str]
    session_ids: list[str]
    data_sources: list[str]


SERVER = HttpJsonServerConfig(port=0, max_message_bytes=MAX_MESSAGE_BYTES)


@contextlib.asynccontextmanager
async def four_services(model_dir: Path) -> AsyncIterator[Served]:
    async with contextlib.AsyncExitStack() as stack:
        tool = await ToolService.create(
            ToolConfig(server=SERVER, tools=[ToolEntry(class_name=name) for name in TOOLS])
        )
        stack.push_async_callback(tool.close)
        session_ids = [
            (await tool.create_session("gsm8k_answer", {"ground_truth": "42"}, None))[0]
            for _ in range(2)
        ]
        tool_address = await stack.enter_async_context(
            serve_in_process(
                SERVER,
                SERVICES[0],
                lambda s: tool_pb2_grpc.add_ToolServiceServicer_to_server(ToolServicer(tool), s),
            )
        )
        # The code scorer calls this tool service, which serves no python tool: an error result.
        code = CodeScorerOptions(tool_service=ClientConfig(address=tool_address))
        reward = await RewardService.create(
            RewardConfig(server=SERVER, workers=1, item_timeout_seconds=2.0, code=code)
        )
        stack.push_async_callback(reward.close)
        reward_address = await stack.enter_async_context(
            serve_in_process(
                SERVER,
                SERVICES[1],
                lambda s: reward_pb2_grpc.add_RewardServiceServicer_to_server(
                    RewardServicer(reward), s
                ),
            )
        )
        rollout_address = await stack.enter_async_context(
            rollout_service(model_dir, tool_address, reward_address)
        )
        trainer = TrainerService(Ranks(), model_path=str(model_dir))
        stack.push_async_callback(trainer.close)
        trainer_address = await stack.enter_async_context(
            serve_in_process(
                SERVER,
                SERVICES[3],
                lambda s: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                    TrainerServicer(trainer), s
                ),
            )
        )
        await trainer.start_run(yaml.safe_dump({"trainer": {"steps": 1}}), RUN_NAME, False)
        addresses = [tool_address, reward_address, rollout_address, trainer_address]
        yield Served(
            addresses={s.full_name: a for s, a in zip(SERVICES, addresses, strict=True)},
            session_ids=session_ids,
            data_sources=sorted(
                source for _, sources in reward.list_scorers() for source in sources
            ),
        )


@contextlib.asynccontextmanager
async def rollout_service(model_dir: Path, tool_address: str, reward_address: str):
    """The rollout service on the tiny model, with ROLLOUT_LIMITS; yields its address."""
    rollout = await RolloutService.create(
        RolloutConfig(
            server=SERVER,
            model_path=str(model_dir),
            tool_service=ClientConfig(address=tool_address),
            reward_service=ClientConfig(address=reward_address),
            max_turns=2,
            tool_call_timeout_seconds=5.0,
            **ROLLOUT_LIMITS,
        )
    )
    try:
        async with serve_in_process(
            SERVER,
            SERVICES[2],
            lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                RolloutServicer(rollout), s
            ),
        ) as address:
            yield address
    finally:
        await rollout.close()
