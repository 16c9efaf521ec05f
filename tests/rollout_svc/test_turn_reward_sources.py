"""Per-turn rewards from each source reach the streamed trajectory on the turn that earned
them: a tool's step reward, the interaction's score, the scorer's per-turn rewards. The tiny
calculator model (greedy) calls the calculator in its first turn, then answers; the tool,
reward and rollout services run for real on loopback, and Generate is called over gRPC."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from reward_svc.config import PluginEntry
from rollout_svc.config import InteractionEntry
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.test_rollout_service import generate, prompts, rollout_server
from tool_svc.config import ToolEntry
from tool_svc.tools.base import ToolResult
from tool_svc.tools.calculator import CalculatorTool
from trainer_svc.rl_step import infra_failed
from turnrl.answers import last_number
from turnrl.trajectory import FinishReason, SegmentSource, Trajectory, TurnRewardSource
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

PLUGINS = Path(__file__).parents[1] / "reward_svc" / "plugins" / "probe_scorers.py"
STEP_REWARD = 0.5


class StepRewardCalculator(CalculatorTool):
    """The calculator, with a step reward for every call it answers."""

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        result = await super().execute(session, args)
        result.step_reward = STEP_REWARD
        return result


@contextlib.asynccontextmanager
async def services(tiny_model_dir) -> AsyncIterator[rollout_pb2_grpc.RolloutServiceStub]:
    """The step-rewarding calculator, a reward service with per-turn plugin scorers
    ("per_turn": 0.1 * (k + 1) for turn k; "past_the_end": a turn after the last) and a
    rollout service with the gsm8k checker as "checker"."""
    calculator = ToolEntry(class_name=f"{__name__}:StepRewardCalculator", name="calculator")
    plugins = [
        PluginEntry(data_sources=["per_turn"], path=PLUGINS, function="rewards_each_turn"),
        PluginEntry(
            data_sources=["past_the_end"], path=PLUGINS, function="rewards_a_turn_past_the_end"
        ),
    ]
    checker = InteractionEntry(name="checker", class_name="gsm8k", config={"max_attempts": 2})
    async with (
        tool_service_address(calculator) as tools,
        reward_service_address(plugins=plugins) as rewards,
        rollout_server(tiny_model_dir, tools, rewards, interactions=[checker]) as stub,
    ):
        yield stub


def request(data_source: str, count: int = 3, **fields) -> rollout_pb2.GenerateRequest:
    request = rollout_pb2.GenerateRequest(
        prompts=prompts(count, **fields), n=1, enable_scoring=True,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        limits=common_pb2.LengthLimits(max_new_tokens=64),
    )  # fmt: skip
    for prompt in request.prompts:
        prompt.data_source = data_source
    return request


def followed_by(trajectory: Trajectory) -> list[SegmentSource | None]:
    """What comes after each model turn: the source of the next segment past the generation
    prompt, None for the last turn."""
    after: list[SegmentSource | None] = []
    sources = [s.source for s in trajectory.segments]
    for index, source in enumerate(sources):
        if source is SegmentSource.MODEL and (index == 0 or sources[index - 1] is not source):
            rest = [s for s in sources[index:] if s is not SegmentSource.MODEL]
            after.append(rest[0] if rest else None)
    return after


def of_source(trajectory: Trajectory, source: TurnRewardSource) -> list[tuple[int, float, str]]:
    return [(r.turn, r.value, r.name) for r in trajectory.turn_rewards if r.source is source]


async def test_step_rewards_and_the_scorers_turn_rewards_land_on_their_turns(tiny_model_dir):
    async with services(tiny_model_dir) as stub:
        streamed = await generate(stub, request("per_turn"))
    # The wire's check: every turn reward names a turn the trajectory has.
    trajectories = [Trajectory.from_proto(t) for t in streamed]
    assert any(of_source(t, TurnRewardSource.TOOL) for t in trajectories)
    for trajectory in trajectories:
        after = followed_by(trajectory)
        assert not trajectory.reward.error, trajectory.reward.error_message
        tool_turns = [i for i, source in enumerate(after) if source is SegmentSource.TOOL]
        calls = [
            len(m.get("tool_calls", [])) for m in trajectory.messages if m["role"] == "assistant"
        ]
        assert of_source(trajectory, TurnRewardSource.TOOL) == [
            (turn, STEP_REWARD, "calculator") for turn in tool_turns for _ in range(calls[turn])
        ]
        assert of_source(trajectory, TurnRewardSource.SCORER) == [
            (turn, pytest.approx(0.1 * (turn + 1)), "plugin:rewards_each_turn")
            for turn in range(len(after))
        ]
        assert trajectory.metrics["tool_step_reward_sum"] == STEP_REWARD * sum(
            calls[turn] for turn in tool_turns
        )
        assert trajectory.metrics["scorer_turn_reward_sum"] == pytest.approx(
            sum(0.1 * (turn + 1) for turn in range(len(after)))
        )
        assert trajectory.metrics["interaction_score_sum"] == 0.0


def checker_request(ground_truth: str) -> rollout_pb2.GenerateRequest:
    rollout = request("openai/gsm8k", count=1, interaction_name="checker")
    rollout.prompts[0].interaction_kwargs.update({"ground_truth": ground_truth})
    return rollout


def checked_turns(trajectory: Trajectory) -> list[int]:
    """The model turns the checker answered: each one that called no tool."""
    after = followed_by(trajectory)
    return [
        turn
        for turn, source in enumerate(after)
        if source is SegmentSource.USER
        or (source is None and trajectory.finish_reason is FinishReason.INTERACTION_TERMINATED)
    ]


async def test_the_interactions_score_lands_on_the_turn_it_answered(tiny_model_dir):
    """Told "wrong" every time (a ground truth it never writes), then, greedy, given its own
    first checked answer as the truth: the 1.0 lands on that turn."""
    async with services(tiny_model_dir) as stub:
        [wrong] = [Trajectory.from_proto(t) for t in await generate(stub, checker_request("-1"))]
        turns = checked_turns(wrong)
        assert turns, wrong.segments
        answers = [m.get("content") or "" for m in wrong.messages if m["role"] == "assistant"]
        first_answer = last_number(answers[turns[0]])
        assert first_answer is not None, answers[turns[0]]
        right_request = checker_request(str(first_answer))
        [right] = [Trajectory.from_proto(t) for t in await generate(stub, right_request)]
    assert of_source(wrong, TurnRewardSource.INTERACTION) == [(t, 0.0, "checker") for t in turns]
    assert of_source(right, TurnRewardSource.INTERACTION) == [(turns[0], 1.0, "checker")]
    assert right.finish_reason is FinishReason.INTERACTION_TERMINATED
    assert len(right.model_turn_spans()) == turns[0] + 1
    assert right.metrics["interaction_score_sum"] == 1.0


async def test_a_scorer_rewarding_a_turn_the_trajectory_lacks_is_its_failure(tiny_model_dir):
    async with services(tiny_model_dir) as stub:
        streamed = await generate(stub, request("past_the_end", count=2))
    for proto in streamed:
        trajectory = Trajectory.from_proto(proto)
        turns = len(trajectory.model_turn_spans())
        assert trajectory.reward.error
        assert trajectory.reward.error_message == (
            f"scorer 'plugin:rewards_a_turn_past_the_end' rewarded turn {turns}, but the "
            f"trajectory has {turns} model turns"
        )
        assert not of_source(trajectory, TurnRewardSource.SCORER)
        # The system's failure: the trainer keeps it out of the loss and counts it.
        assert infra_failed(trajectory)
