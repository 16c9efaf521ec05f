"""The rollout service on two replicas of the tool service and two of the reward service, all
real servers on loopback: calls spread over the replicas, and every call naming a tool
session reaches the replica that opened it."""

import contextlib
from typing import TypeVar

from google.protobuf import struct_pb2

from reward_svc.server import RewardServicer
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.test_rollout_service import generate, prompts, rollout_server
from tool_svc.server import ToolServicer
from turnrl.v1 import common_pb2, rollout_pb2

T = TypeVar("T")


class RecordingToolServicer(ToolServicer):
    """The tool servicer, recording the sessions it opened and those its calls named."""

    def __init__(self, service) -> None:
        super().__init__(service)
        self.opened: set[str] = set()
        self.executed: list[str] = []  # the session id of each Execute
        self.released: set[str] = set()

    async def CreateSession(self, request, context):
        reply = await super().CreateSession(request, context)
        self.opened.add(reply.session_id)
        return reply

    async def Execute(self, request, context):
        self.executed.append(request.session_id)
        return await super().Execute(request, context)

    async def ReleaseSession(self, request, context):
        self.released.add(request.session_id)
        return await super().ReleaseSession(request, context)


class CountingRewardServicer(RewardServicer):
    """The reward servicer, counting the Score calls it answers."""

    def __init__(self, service) -> None:
        super().__init__(service)
        self.scored = 0

    async def Score(self, request, context):
        self.scored += 1
        return await super().Score(request, context)


def kept(servicers: list[T], servicer: T) -> T:
    """`servicer`, appended to `servicers`, where the test reads it after the run."""
    servicers.append(servicer)
    return servicer


async def test_calls_spread_over_the_replicas_and_sessions_stay_on_theirs(tiny_model_dir):
    tools: list[RecordingToolServicer] = []
    rewards: list[CountingRewardServicer] = []
    calculator_session = struct_pb2.Struct()
    calculator_session.update({"calculator": {}})  # every calculator call runs in a session
    request = rollout_pb2.GenerateRequest(
            prompts=prompts(4, tools_kwargs=calculator_session), n=2, enable_scoring=True,
            sampling=common_pb2.SamplingParams(temperature=0.0),
            limits=common_pb2.LengthLimits(max_new_tokens=64), max_turns=3,
        )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        tool_addresses = [
            await stack.enter_async_context(
                tool_service_address(servicer=lambda s: kept(tools, RecordingToolServicer(s)))
            )
            for _ in range(2)
        ]
        reward_addresses = [
            await stack.enter_async_context(
                reward_service_address(servicer=lambda s: kept(rewards, CountingRewardServicer(s)))
            )
            for _ in range(2)
        ]
        stub = await stack.enter_async_context(
            rollout_server(tiny_model_dir, ",".join(tool_addresses), ",".join(reward_addresses))
        )
        trajectories = await generate(stub, request)
    assert len(trajectories) == 8
    # The tiny model's greedy first turn calls the calculator; a call on a replica without its
    # session would come back as an UNKNOWN_SESSION tool error.
    assert all(t.metrics["tool_calls"] >= 1 for t in trajectories), [
        t.metrics for t in trajectories
    ]
    assert all(t.metrics["tool_errors"] == 0 for t in trajectories), [
        t.messages for t in trajectories
    ]
    for replica in tools:
        assert replica.opened, "both tool replicas opened sessions"
        assert set(replica.executed) <= replica.opened  # every call on its session's replica
        assert replica.released == replica.opened  # and every release too
    assert sum(len(replica.opened) for replica in tools) == 8  # one session per trajectory
    assert sum(len(replica.executed) for replica in tools) == sum(
        t.metrics["tool_calls"] for t in trajectories
    )
    assert all(t.HasField("reward") and not t.reward.error for t in trajectories)
    assert all(replica.scored >= 1 for replica in rewards), [r.scored for r in rewards]
    assert sum(replica.scored for replica in rewards) == 8
