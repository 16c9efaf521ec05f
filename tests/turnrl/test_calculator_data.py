"""The generated calculator problems (turnrl.calculator_data): deterministic per seed, split
without overlap, solved exactly by the calculator tool, and the final-answer parser."""

import pytest

from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool, format_value
from turnrl.calculator_data import ProblemSettings, final_answer, generate_problems
from turnrl.splits import split_of


def test_problems_are_deterministic_per_seed():
    first = generate_problems(50, seed=3)
    again = generate_problems(50, seed=3)
    assert [(p.question, p.answer, p.messages) for p in first] == [
        (p.question, p.answer, p.messages) for p in again
    ]
    assert [p.question for p in generate_problems(50, seed=4)] != [p.question for p in first]


def test_splits_share_no_question():
    train = {p.question for p in generate_problems(500, seed=0, split="train")}
    test = {p.question for p in generate_problems(500, seed=0, split="test")}
    assert not train & test
    assert {split_of(question) for question in test} == {"test"}


def test_conversations_are_solved_exactly():
    for problem in generate_problems(200, seed=1):
        calls = [m for m in problem.messages if m["role"] == "assistant" and m.get("tool_calls")]
        results = [m["content"] for m in problem.messages if m["role"] == "tool"]
        assert 1 <= len(calls) <= 2 and len(results) == len(calls)
        calculator = CalculatorTool("calculator", CalculatorOptions())
        for call, result, expression in zip(calls, results, problem.expressions, strict=True):
            arguments = call["tool_calls"][0]["function"]["arguments"]
            assert arguments == {"expression": expression}
            assert format_value(calculator.evaluate(expression)) == result
        assert results[-1] == str(problem.answer)
        assert final_answer(problem.messages[-1]["content"]) == str(problem.answer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 19", "19"),
        ("The answer is\n#### 1,234.", "1234"),
        ("#### 3 then #### -4", "-4"),
        ("####19", "19"),
        ("the answer is 19", None),
        ("#### x", None),
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_one_call_per_operation_chains_each_result_into_the_next_call():
    settings = ProblemSettings(min_operations=4, max_operations=4, one_call_per_operation=True)
    for problem in generate_problems(20, settings=settings):
        assert len(problem.expressions) == 4
        results = [m["content"] for m in problem.messages if m["role"] == "tool"]
        for result, next_expression in zip(results, problem.expressions[1:], strict=False):
            assert next_expression.startswith(f"{result} ")
        assert results[-1] == str(problem.answer)
