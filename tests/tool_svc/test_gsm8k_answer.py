"""The GSM8K answer tool: feedback, verl-style step rewards, and the session reward."""

import pytest

from tool_svc.tools.base import ToolCallError
from tool_svc.tools.gsm8k_answer import Gsm8kAnswerOptions, Gsm8kAnswerTool
from turnrl.answers import last_number


@pytest.fixture
def tool() -> Gsm8kAnswerTool:
    return Gsm8kAnswerTool("gsm8k_answer", Gsm8kAnswerOptions())


async def test_wrong_then_right_then_repeat(tool):
    session = await tool.create(ground_truth="1234")
    wrong = await tool.execute(session, {"answer": "1200"})
    assert wrong.text == "Your answer 1200 is incorrect." and wrong.step_reward == -0.05
    assert await tool.calc_reward(session) == 0.0
    right = await tool.execute(session, {"answer": "So the total is $1,234.00"})
    assert right.text == "Your answer 1234 is correct." and right.step_reward == 0.0
    assert await tool.calc_reward(session) == 1.0
    again = await tool.execute(session, {"answer": "1234"})
    assert again.step_reward == -0.05  # no improvement on the best so far
    assert again.metrics["submissions"] == 3.0


async def test_ground_truth_in_gsm8k_format(tool, fixtures):
    import json

    row = json.loads((fixtures / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    session = await tool.create(ground_truth=row["answer"])  # "... #### 18"
    final = row["answer"].rsplit("####", 1)[1].strip()
    assert (await tool.execute(session, {"answer": final})).metrics["correct"] == 1.0


async def test_session_needs_a_numeric_ground_truth(tool):
    with pytest.raises(ValueError, match="needs ground_truth"):
        await tool.create(truth="1")
    with pytest.raises(ValueError, match="holds no number"):
        await tool.create(ground_truth="unknown")


async def test_answer_without_a_number_is_an_argument_error(tool):
    session = await tool.create(ground_truth="3")
    with pytest.raises(ToolCallError, match="no number in answer 'three'"):
        await tool.execute(session, {"answer": "three"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("#### 72", "72"), ("-3.5 degrees", "-3.5"), ("1,000,000 and 2", "2"), ("none", None)],
)
def test_last_number(text, expected):
    value = last_number(text)
    assert (str(value) if value is not None else None) == expected
