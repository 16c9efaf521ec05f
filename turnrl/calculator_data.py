"""Arithmetic word problems solved with the `calculator` tool: the CPU example task's data.

Every problem is drawn deterministically from a seed and comes with its exact answer and a
full tool-use conversation in OpenAI message format (tool-call arguments as a dict, the form
chat templates render):

    system     SYSTEM_PROMPT
    user       "Tom has 12 apples. He buys 7 more. How many apples does he have now?"
    assistant  tool call calculator {"expression": "12 + 7"}
    tool       "19"
    assistant  "#### 19"

A problem has 1-3 operations (+, -, *, //) applied in order to a running count. One operation
takes one tool call; more take two, the second applying the last operation to the first
call's result, so the model has to carry a tool result into its next call. With
`one_call_per_operation` every operation is its own call on the previous call's result, so a
problem of k operations takes k tool rounds (the rollout benchmark's long trajectories). The final answer
is written `#### N`, the GSM8K form the reward service's `gsm8k` scorer grades strictly;
`final_answer` reads it back.

The train and test splits never share a question: a question belongs to the split its hash
picks, and each split draws from its own seeded stream.
"""

import random
import re
from dataclasses import dataclass
from typing import Any, Self

from pydantic import Field, model_validator

from turnrl.config import StrictModel
from turnrl.messages import openai_tool_call
from turnrl.splits import Split, check_split, split_of

SYSTEM_PROMPT = "Solve the problem with the calculator tool. End with '#### <answer>'."
# The calculator tool's schema, the one place it is written: tool_svc's `calculator` serves it
# and the problems' conversations render it, so the model learns the schema it is shown.
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and "
        "parentheses on integers and decimals, e.g. (3 + 4.5) * 2 / 5.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate."}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [CALCULATOR_TOOL]
MAX_DRAWS_PER_PROBLEM = 100

_NAMES = {
    "Tom": "he",
    "Ana": "she",
    "Ben": "he",
    "Mia": "she",
    "Sam": "he",
    "Lea": "she",
    "Omar": "he",
    "Zoe": "she",
}
_ITEMS = ("apples", "marbles", "stickers", "books", "cookies", "coins", "pencils", "shells")
# Sentences that apply one operation to the running count; {p}: pronoun, {n}: operand.
_STEP_SENTENCES = {
    "+": ("{p} buys {n} more.", "{p} finds {n} more.", "{p} gets {n} more from a friend."),
    "-": ("{p} gives away {n}.", "{p} loses {n}.", "{p} sells {n}."),
    "*": ("{p} then has {n} times as many.", "{p} makes the pile {n} times as big."),
    "//": (
        "{p} splits them equally into {n} groups and keeps one group.",
        "{p} shares them equally among {n} friends and keeps one share.",
    ),
}
_ANSWER_PATTERN = re.compile(r"####\s*(-?\d[\d,]*)")


class ProblemSettings(StrictModel):
    """The shape of generated problems."""

    min_operations: int = Field(default=1, ge=1, description="Fewest operations of a problem.")
    max_operations: int = Field(default=3, ge=1, description="Most operations of a problem.")
    min_number: int = Field(
        default=1, ge=0, description="Smallest starting count and amount added or taken away."
    )
    max_number: int = Field(
        default=99, ge=0, description="Largest starting count and amount added or taken away."
    )
    max_factor: int = Field(
        default=9, ge=2, description="Largest multiplier and divisor (the smallest is 2)."
    )
    one_call_per_operation: bool = Field(
        default=False,
        description="Each operation its own calculator call; else at most two calls (see the "
        "module doc).",
    )

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> Self:
        if self.min_operations > self.max_operations:
            raise ValueError(
                f"operations range [{self.min_operations}, {self.max_operations}] is invalid; "
                "need min_operations <= max_operations"
            )
        if self.min_number > self.max_number:
            raise ValueError(
                f"number range [{self.min_number}, {self.max_number}] is invalid; "
                "need min_number <= max_number"
            )
        return self


@dataclass
class CalculatorProblem:
    """One word problem, its exact answer, and a solved tool-use conversation."""

    question: str
    answer: int
    expressions: list[str]
    """The expression of each calculator call, in order."""
    messages: list[dict[str, Any]]
    """system, user, then per call an assistant tool call and its tool result, then the
    assistant's final answer."""

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        """The conversation before the model's first turn: system and user."""
        return self.messages[:2]

    @property
    def call_results(self) -> list[int]:
        """Each calculator call's result, in order: with `one_call_per_operation`, the running
        count after each operation (the chain `reward_svc.scorers.calc_chain` credits)."""
        return [int(m["content"]) for m in self.messages if m["role"] == "tool"]

    @property
    def guess_messages(self) -> list[dict[str, Any]]:
        """system, user, then a wrong answer at once, without the tool: the problem's starting
        count, the number a model that cannot compute copies from the question."""
        starting_count = self.expressions[0].lstrip("(").split(" ", 1)[0]
        return [*self.prompt_messages, {"role": "assistant", "content": f"#### {starting_count}"}]


def generate_problems(
    count: int, *, seed: int = 0, split: Split = "train", settings: ProblemSettings | None = None
) -> list[CalculatorProblem]:
    """`count` distinct problems of `split`, the same for the same arguments on every run.

    Raises ValueError for an unknown split, or when `settings` allow too few distinct questions
    to draw `count` of them.
    """
    check_split(split)
    settings = settings or ProblemSettings()
    rng = random.Random(f"{split}:{seed}")
    problems: dict[str, CalculatorProblem] = {}
    # Each draw lands in the split with probability >= 1/splits.BUCKETS; this many draws without
    # enough new questions means the settings leave too few distinct ones.
    for _ in range(MAX_DRAWS_PER_PROBLEM * count):
        if len(problems) == count:
            break
        problem = _draw_problem(rng, settings)
        if problem.question not in problems and split_of(problem.question) == split:
            problems[problem.question] = problem
    if len(problems) < count:
        raise ValueError(
            f"found {len(problems)} distinct {split} questions, not {count}; widen {settings}"
        )
    return list(problems.values())


def final_answer(text: str) -> str | None:
    """The number of the last `#### N` in `text`, without thousands separators, or None."""
    matches = _ANSWER_PATTERN.findall(text)
    return matches[-1].replace(",", "") if matches else None


def _draw_problem(rng: random.Random, settings: ProblemSettings) -> CalculatorProblem:
    name = rng.choice(sorted(_NAMES))
    pronoun = _NAMES[name]
    item = rng.choice(_ITEMS)
    start = rng.randint(settings.min_number, settings.max_number)
    sentences = [f"{name} has {start} {item}."]
    steps: list[tuple[str, int]] = []
    values = [start]
    for _ in range(rng.randint(settings.min_operations, settings.max_operations)):
        operator, operand = _draw_step(rng, values[-1], settings)
        steps.append((operator, operand))
        values.append(_apply(values[-1], operator, operand))
        template = rng.choice(_STEP_SENTENCES[operator])
        sentences.append(template.format(p=pronoun, n=operand).capitalize())
    sentences.append(f"How many {item} does {pronoun} have now?")
    question = " ".join(sentences)
    # One call per step when asked, or for one step; else the steps but the last, then the
    # last step applied to that.
    if settings.one_call_per_operation:
        calls = [
            (_chain(str(value), [step]), result)
            for value, step, result in zip(values[:-1], steps, values[1:], strict=True)
        ]
    elif len(steps) == 1:
        calls = [(_chain(str(start), steps), values[-1])]
    else:
        calls = [(_chain(str(start), steps[:-1]), values[-2])]
        calls.append((_chain(str(values[-2]), steps[-1:]), values[-1]))
    return CalculatorProblem(
        question=question,
        answer=values[-1],
        expressions=[expression for expression, _ in calls],
        messages=_conversation(question, calls),
    )


def _draw_step(rng: random.Random, value: int, settings: ProblemSettings) -> tuple[str, int]:
    # Counts stay whole and non-negative: take away at most what there is, divide only when
    # every group gets at least one.
    operators = ["+", "*"]
    if value >= settings.min_number:
        operators.append("-")
    if value >= 2:
        operators.append("//")
    operator = rng.choice(operators)
    if operator == "+":
        return operator, rng.randint(settings.min_number, settings.max_number)
    if operator == "-":
        return operator, rng.randint(settings.min_number, min(value, settings.max_number))
    if operator == "*":
        return operator, rng.randint(2, settings.max_factor)
    return operator, rng.randint(2, min(value, settings.max_factor))


def _apply(value: int, operator: str, operand: int) -> int:
    return {
        "+": value + operand,
        "-": value - operand,
        "*": value * operand,
        "//": value // operand,
    }[operator]


def _chain(expression: str, steps: list[tuple[str, int]]) -> str:
    """Steps applied left to right, with parentheses where Python's precedence differs."""
    for operator, operand in steps:
        if operator in ("*", "//") and (" + " in expression or " - " in expression):
            expression = f"({expression})"
        expression = f"{expression} {operator} {operand}"
    return expression


def _conversation(question: str, calls: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """The solved conversation, given each calculator call's expression and result."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    for index, (expression, result) in enumerate(calls):
        call_id = f"call_{index}"
        call = openai_tool_call(call_id, "calculator", {"expression": expression})
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": str(result)})
    messages.append({"role": "assistant", "content": f"#### {calls[-1][1]}"})
    return messages
