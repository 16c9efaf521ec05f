"""Whose fault a failed tool call is (turnrl/failures.py), as the agent loop counts it: the
trained tiny calculator model's greedy first turn calls the calculator, served here by tools
that fail in each way. The model reads an observation either way; only the system's failures
count in "tool_infra_errors", which keeps the trajectory out of the loss."""

import asyncio
import copy
import dataclasses
from typing import Any

import pytest

from tests.in_process_services import tool_service_address
from tests.rollout_svc.test_rollout_core import (
    agent_loop,
    assert_every_tool_call_failed,
    prompt_specs,
    run_one,
)
from tool_svc.config import ToolEntry
from tool_svc.tools.base import ToolCallError, ToolErrorKind, ToolResult
from tool_svc.tools.calculator import CalculatorTool
from turnrl.calculator_data import TOOLS
from turnrl.errors import FailedPreconditionError


class HangingCalculator(CalculatorTool):
    """Runs until something stops it: the tool's own limit, or the caller's deadline."""

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        await asyncio.Event().wait()
        raise AssertionError("never set")


class SandboxTimeoutCalculator(CalculatorTool):
    """Reports what a sandbox reports when the model's code runs past its wall time."""

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        raise ToolCallError(ToolErrorKind.TIMEOUT, "the code was killed after 1s wall time")


class UnstartableCalculator(CalculatorTool):
    """A tool whose per-call state cannot be set up (as a sandbox that cannot start)."""

    async def create(self, **session_kwargs: Any) -> Any:
        raise FailedPreconditionError("the sandbox cannot start on this machine")


class KwargsRefusingCalculator(CalculatorTool):
    """Refuses the session kwargs a dataset row gives it."""

    async def create(self, **session_kwargs: Any) -> Any:
        if session_kwargs:
            raise ValueError(f"calculator takes no session kwargs; got {sorted(session_kwargs)}")
        return {}


class SessionOnlyCalculator(CalculatorTool):
    """A calculator that needs a session, which only the prompt's tools_kwargs open."""

    requires_session = True


def served(tool: type[CalculatorTool]) -> ToolEntry:
    return ToolEntry(class_name=f"{__name__}:{tool.__name__}", name="calculator")


@pytest.mark.parametrize(
    ("tool", "tools_kwargs", "infra_failed"),
    [
        # The model's: its code ran past the tool's own limit.
        (SandboxTimeoutCalculator, None, False),
        # The system's: the caller's 1 s deadline stopped the call before the tool's own 30 s
        # limit (a deadline spent waiting in a queue looks the same).
        (HangingCalculator, None, True),
        (HangingCalculator, {}, True),
        # The system's: the tool could not start (FAILED_PRECONDITION from Execute, or from
        # CreateSession).
        (UnstartableCalculator, None, True),
        (UnstartableCalculator, {}, True),
        # The system's: the session kwargs come from the data, not from the model
        # (INVALID_ARGUMENT from CreateSession).
        (KwargsRefusingCalculator, {"create_kwargs": {"ground_truth": "4"}}, True),
        # The system's: no session was opened for a tool that needs one (the session id is
        # the rollout's to give, never the model's).
        (SessionOnlyCalculator, None, True),
    ],
    ids=["own-timeout", "deadline", "deadline-session", "cannot-start",
         "cannot-start-session", "data-kwargs-refused", "no-session"],
)  # fmt: skip
async def test_whose_fault_a_failed_tool_call_is(tiny_model_dir, tool, tools_kwargs, infra_failed):
    [prompt] = prompt_specs(1)
    if tools_kwargs is not None:
        prompt = dataclasses.replace(prompt, tools_kwargs={"calculator": tools_kwargs})
    async with (
        tool_service_address(served(tool)) as tools,
        agent_loop(tiny_model_dir, tools) as loop,
    ):
        loop.tool_call_timeout_seconds = 1.0
        trajectory = await run_one(loop, prompt, max_turns=1, request_id="call")
    assert_every_tool_call_failed(trajectory, infra_failed)


async def test_a_call_to_a_tool_the_prompt_did_not_offer_is_the_models_error(tiny_model_dir):
    """The tiny model calls the calculator it was trained on even when its prompt offers the
    same tool under another name; the tool service serves a calculator, but the model was not
    offered one, so the call is refused unrun."""
    renamed = copy.deepcopy(TOOLS)
    renamed[0]["function"]["name"] = "arithmetic"
    [prompt] = prompt_specs(1)
    async with (
        tool_service_address(served(CalculatorTool)) as tools,
        agent_loop(tiny_model_dir, tools) as loop,
    ):
        trajectory = await run_one(loop, prompt, max_turns=1, request_id="unoffered", tools=renamed)
    metrics = trajectory.metrics
    assert metrics["tool_calls"] >= 1 and metrics["tool_errors"] == metrics["tool_calls"]
    assert metrics["tool_infra_errors"] == 0
    replies = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert replies == ["Error: no tool 'calculator' here; tools: arithmetic"] * int(
        metrics["tool_calls"]
    )
