"""Word problems on large numbers, solved by running Python in the `python` sandbox tool: the
CPU-scale ReTool task's data.

A problem multiplies a three-digit by a two-digit number and adds or takes away a third of
three digits, which no tiny model does in its head. Its solved conversation interleaves code, its
result and the reasoning on it, as ReTool's do, in OpenAI message format:

    system     SYSTEM_PROMPT
    user       "A warehouse has 482 boxes of 93 items each. It ships 516 items. How many items
               are left?"
    assistant  "I will compute it." + tool call python {"code": "total = 482 * 93\nprint(total - 516)"}
    tool       "44310\n" (the sandbox's stdout)
    assistant  "So the answer is \\boxed{44310}."

graded by final-answer correctness (the reward service's `math` scorer, DATA_SOURCE), ReTool's
reward. The train and test splits never share a question (a hash of its text picks its split).
"""

import random
from dataclasses import dataclass
from typing import Any

from turnrl.messages import openai_tool_call
from turnrl.splits import Split, check_split, split_of

SYSTEM_PROMPT = (
    "Solve the problem. Compute with the python tool, then give the final answer as \\boxed{...}."
)
DATA_SOURCE = "turnrl_code"


@dataclass(frozen=True)
class _Story:
    """A problem's wording: {a} of {b} each, then {c} more (sign +1) or fewer (-1)."""

    question: str
    sign: int


_STORIES = (
    _Story(
        "A warehouse has {a} boxes of {b} items each. It ships {c} items. How many items are left?",
        -1,
    ),
    _Story(
        "A farm picks {a} kg of apples a day for {b} days and sells {c} kg. How many kg are left?",
        -1,
    ),
    _Story(
        "A printer prints {a} pages an hour for {b} hours, then {c} pages more. "
        "How many pages does it print?",
        1,
    ),
    _Story(
        "A library has {a} shelves of {b} books and receives {c} more books. "
        "How many books does it have?",
        1,
    ),
)


@dataclass
class CodeProblem:
    """One problem, its exact answer, and what a solver says."""

    question: str
    answer: int
    code: str
    first_number: int

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.question},
        ]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The solved conversation. The tool's answer is the code's stdout, as the `python`
        tool returns it (tests check it against the tool)."""
        return [
            *self.prompt_messages,
            {
                "role": "assistant",
                "content": "I will compute it.",
                "tool_calls": [openai_tool_call("call_0", "python", {"code": self.code})],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": f"{self.answer}\n"},
            {
                "role": "assistant",
                "content": f"So the answer is \\boxed{{{self.answer}}}.",
            },
        ]

    @property
    def guess_messages(self) -> list[dict[str, Any]]:
        """An answer at once, without code: the problem's first number, the one a model that
        cannot compute copies (wrong)."""
        return [
            *self.prompt_messages,
            {"role": "assistant", "content": f"\\boxed{{{self.first_number}}}"},
        ]


def generate_problems(count: int, *, seed: int = 0, split: Split = "train") -> list[CodeProblem]:
    """`count` distinct problems of `split`, the same for the same arguments on every run.
    Raises ValueError for an unknown split."""
    check_split(split)
    rng = random.Random(f"code:{split}:{seed}")
    problems: dict[str, CodeProblem] = {}
    while len(problems) < count:
        problem = _draw_problem(rng)
        if split_of(problem.question) == split:
            problems.setdefault(problem.question, problem)
    return list(problems.values())


def _draw_problem(rng: random.Random) -> CodeProblem:
    story = rng.choice(_STORIES)
    a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
    operator = "+" if story.sign > 0 else "-"
    return CodeProblem(
        question=story.question.format(a=a, b=b, c=c),
        answer=a * b + story.sign * c,
        code=f"total = {a} * {b}\nprint(total {operator} {c})",
        first_number=a,
    )
