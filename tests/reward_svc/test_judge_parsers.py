"""The LLM judge's verdict parsers on realistic judge answers, and its options checked when a
judge is built. `LlmJudge` against a chat-completions server is in test_judge.py."""

from typing import Any

import pydantic
import pytest

from reward_svc.scorers.judge import (
    LlmJudge,
    parse_boxed,
    parse_pairwise_verdict,
    parse_score_out_of,
    parse_yes_no,
)
from turnrl.errors import ConfigError

from .judge_stand_in import PAIRWISE_RUBRIC, RUBRIC, NoVerdictCount, judge_options


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The response is correct but terse.\n\nScore: 7/10", 0.7),
        ("Correctness is fine, clarity could improve.\nRating: 7 / 10", 0.7),
        ("Accuracy 4/5, clarity 3/5.\nOverall: 8/10", 0.8),
        ("At first I would give 3/10, but the final number is right.\nScore: 9/10.", 0.9),
        ("**Score:** 6 out of 10", 0.6),
        ("Score: 8.5/10", 0.85),
        ("The answer is right.\nScore: 7", 0.7),
        ("Well explained. Rating: [[5]]", 0.5),
        ("Released 2023/10/05; the final answer is wrong. Score: 2", 0.2),
        ("Score: 4/5 for accuracy", 0.8),
        ("The response is helpful and correct.", None),
        ("Score: 12/10", None),
        ("Score: 3/0", None),
    ],
)
def test_parse_score_out_of(text: str, expected: float | None):
    assert parse_score_out_of(text, max_score=10.0) == pytest.approx(expected)


def test_parse_score_out_of_divides_a_bare_score_by_max_score():
    assert parse_score_out_of("Score: 4", max_score=5.0) == pytest.approx(0.8)
    assert parse_score_out_of("Score: 6", max_score=5.0) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48 + 24 = 72 matches the reference, so the grade is \\boxed{8}.", 0.8),
        ("Step scores \\boxed{3} and \\boxed{5}; overall \\boxed{9}", 0.9),
        ("Final grade: \\boxed{ 7.5 }", 0.75),
        ("Final grade: \\boxed{7/10}", 0.7),
        ("The better answer is \\boxed{A}", None),
        ("\\boxed{11}", None),
        ("Grade: 8", None),
    ],
)
def test_parse_boxed(text: str, expected: float | None):
    assert parse_boxed(text, max_score=10.0) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The response computes 72, as the reference does.\nVerdict: YES", 1.0),
        ("The response says 96; the reference says 72.\nverdict: no", 0.0),
        ("There is no error in any step.\n\nVerdict: Yes", 1.0),
        ("Verdict: NO\nOn reflection, 24 is half of 48.\nVerdict: YES", 1.0),
        ("The final number matches.\n\n**Correct**", 1.0),
        ("Answer: Incorrect", 0.0),
        ("The answer is correct.", 1.0),
        ("The answer is not correct.", None),
        ("I see no issue with the reasoning.", None),
        ("Maybe.", None),
    ],
)
def test_parse_yes_no(text: str, expected: float | None):
    assert parse_yes_no(text, max_score=10.0) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Assistant A is right and concise. [[A]]", "A"),
        ("A is shorter, but B is right.\nFinal verdict: [[B]]", "B"),
        ("Both are equally good. [[C]]", "tie"),
        ("I lean to [[A]] at first, yet after checking the sums: [[B]]", "B"),
        ("Assistant A is better.", None),
    ],
)
def test_parse_pairwise_verdict(text: str, expected: str | None):
    assert parse_pairwise_verdict(text) == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rubric": "Q: {question}\nA: {answer}"}, r"unknown placeholders \['answer'\]"),
        ({"rubric": "{response} {0}"}, r"unknown placeholders \['0'\]"),
        ({"rubric": "{response.upper}"}, r"unknown placeholders \['response.upper'\]"),
        ({"rubric": 'Reply {"score": {response}}'}, r"unknown placeholders \['\"score\"'\]"),
        ({"rubric": "Rate {response} from 1 to 10 {"}, "not a valid template"),
        ({"rubric": "Rate the answer to {question}"}, r"must contain \['response'\]"),
        ({"rubric": RUBRIC, "pairwise": True}, r"unknown placeholders \['reference', 'response'\]"),
        ({"rubric": PAIRWISE_RUBRIC}, r"unknown placeholders \['response_a', 'response_b'\]"),
        ({"rubric": PAIRWISE_RUBRIC, "pairwise": True, "parse": "boxed"}, "pointwise grading"),
        ({"swap_positions": True}, "swap_positions needs pairwise"),
        ({"samples": 4}, "samples=4 at temperature 0"),
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url"),
        ({"rubrik": RUBRIC}, "rubrik"),
        # One server: an OpenAI-compatible URL or a turnrl rollout service, never both or none.
        (
            {"rollout": {"address": "127.0.0.1:50053"}},
            "judge 'gsm8k-judge' sets both of base_url and rollout; set exactly one",
        ),
        ({"base_url": None}, "judge 'gsm8k-judge' sets neither of base_url and rollout"),
        ({"model": None}, "base_url needs model"),
        (
            {"base_url": None, "rollout": {"address": "127.0.0.1:50053"}, "max_retries": 1},
            r"\['model', 'max_retries'\] apply to base_url, not to a rollout service",
        ),
        ({"base_url": None, "model": None, "rollout": {"address": ""}}, "empty entry"),
        ({"base_url": None, "model": None, "rollout": {"adress": "h:1"}}, "adress"),
    ],
)
def test_bad_options_are_rejected_at_construction(changes: dict[str, Any], message: str):
    with pytest.raises(pydantic.ValidationError, match=message):
        judge_options(**changes)


def test_unset_api_key_env_is_rejected_at_construction(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError, match="'TEST_JUDGE_KEY' is unset"):
        LlmJudge(judge_options(api_key_env="TEST_JUDGE_KEY"), NoVerdictCount())
