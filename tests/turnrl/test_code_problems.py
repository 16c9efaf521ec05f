"""The CPU code task's problems: their answers, the tool answer their conversations hold (the
real sandboxed `python` tool's), and the real math scorer's grading."""

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from tool_svc.tools.python import PythonTool
from turnrl import code_problems


def test_problems_are_the_same_every_time_and_splits_share_no_question():
    train = code_problems.generate_problems(300, seed=0, split="train")
    assert code_problems.generate_problems(300, seed=0, split="train") == train
    test = code_problems.generate_problems(100, seed=0, split="test")
    assert not {p.question for p in train} & {p.question for p in test}
    for problem in test:
        numbers = [int(word) for word in problem.question.split() if word.isdigit()]
        a, b, c = numbers
        assert problem.answer in (a * b + c, a * b - c) and problem.answer > 0
        assert problem.first_number == a != problem.answer


async def test_the_conversations_tool_answer_is_what_the_sandbox_prints():
    [tool] = await PythonTool.from_config("python", {}, None)
    try:
        for problem in code_problems.generate_problems(5, seed=0, split="test"):
            call = problem.messages[2]["tool_calls"][0]["function"]
            assert call["name"] == "python"
            result = await tool.execute(None, call["arguments"])
            assert result.text == problem.messages[3]["content"] == f"{problem.answer}\n"
    finally:
        await tool.close()


def test_the_math_scorer_credits_the_boxed_answer_and_not_the_guess():
    score = SCORERS[code_problems.DATA_SOURCE].ref.load()
    problem = code_problems.generate_problems(1, seed=0, split="test")[0]

    def graded(text: str) -> float:
        request = ScoringRequest(
            data_source=code_problems.DATA_SOURCE,
            response_text=text,
            ground_truth=str(problem.answer),
            extra_info={},
        )
        return score(request).score

    assert graded(problem.messages[-1]["content"]) == 1.0
    assert graded(problem.guess_messages[-1]["content"]) == 0.0
