"""`gsm8k_answer`: the model submits its final answer; the tool checks it against the ground
truth given when the session was created, and says whether it is right.

Rewards follow verl's GSM8K multi-turn tool: each step's reward is 0 when the submission
improves on the best so far and -0.05 otherwise (a penalty for repeating wrong answers); the
session's reward (CalcReward) is 1.0 once a correct answer was submitted, else 0.0.
"""

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

from pydantic import Field

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from turnrl.answers import last_number
from turnrl.config import StrictModel


class Gsm8kAnswerOptions(StrictModel):
    """Step rewards of the GSM8K answer tool."""

    repeat_penalty: float = Field(
        default=-0.05,
        description="Step reward of a submission that does not improve on the best so far.",
    )


@dataclass
class Gsm8kSession:
    """The ground truth of one problem and the best result so far."""

    ground_truth: Decimal
    best_reward: float = 0.0
    submissions: int = 0


class Gsm8kAnswerTool(Tool):
    """Checks a submitted GSM8K answer against the session's ground truth."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "gsm8k_answer",
        "description": "Submit your final numeric answer to the math problem; you will be told "
        "whether it is correct.",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "The final answer, e.g. '72'."}
            },
            "required": ["answer"],
            "additionalProperties": False,
        },
    }
    Options = Gsm8kAnswerOptions
    requires_session: ClassVar[bool] = True

    async def create(self, **session_kwargs: Any) -> Gsm8kSession:
        if "ground_truth" not in session_kwargs:
            raise ValueError(f"gsm8k_answer needs ground_truth; got keys {sorted(session_kwargs)}")
        value = last_number(str(session_kwargs["ground_truth"]))
        if value is None:
            raise ValueError(f"ground_truth {session_kwargs['ground_truth']!r} holds no number")
        return Gsm8kSession(ground_truth=value)

    async def execute(self, session: Gsm8kSession, args: dict[str, Any]) -> ToolResult:
        submitted = last_number(args["answer"])
        if submitted is None:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS, f"no number in answer {args['answer']!r}"
            )
        session.submissions += 1
        reward = 1.0 if submitted == session.ground_truth else 0.0
        options: Gsm8kAnswerOptions = self.options
        step_reward = 0.0 if reward > session.best_reward else options.repeat_penalty
        session.best_reward = max(session.best_reward, reward)
        verdict = "correct" if reward == 1.0 else "incorrect"
        return ToolResult(
            text=f"Your answer {_plain(submitted)} is {verdict}.",
            step_reward=step_reward,
            metrics={"correct": reward, "submissions": float(session.submissions)},
        )

    async def calc_reward(self, session: Gsm8kSession) -> float:
        return session.best_reward


def _plain(value: Decimal) -> str:
    return format(value.normalize(), "f")
