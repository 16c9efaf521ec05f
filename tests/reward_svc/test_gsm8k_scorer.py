"""The GSM8K scorer on every gold solution of the GSM8K test split."""

import json
import re
from pathlib import Path

import pytest

from reward_svc.scorers import gsm8k
from reward_svc.scorers.base import ScoringRequest


@pytest.fixture(scope="module")
def gold_solutions(fixtures: Path) -> list[dict[str, str]]:
    """The 1,319 GSM8K test rows: `question` and `answer` (a solution ending `#### N`)."""
    lines = (fixtures / "gsm8k" / "test.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 1319
    return rows


def final_number(answer: str) -> str:
    """The text after the solution's `####`, e.g. "1,450,000" or "-3"."""
    return answer.rpartition("####")[2].strip()


def off_by_one(number: str) -> str:
    """`number` + 1, written with thousands commas when `number` has them."""
    value = int(number.replace(",", "")) + 1
    return f"{value:,}" if "," in number else str(value)


def grade(response: str, ground_truth, **extra_info):
    return gsm8k.score(
        ScoringRequest(
            data_source="openai/gsm8k",
            response_text=response,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
    )


def test_every_gold_solution_scores_one_strict_and_flexible(gold_solutions):
    for row in gold_solutions:
        answer, number = row["answer"], final_number(row["answer"])
        strict = grade(answer, answer)
        assert (strict.score, strict.extras["acc"]) == (1.0, True), row
        assert strict.extras["extracted"] == number.replace(",", "")
        reasoning = answer.rpartition("####")[0]
        flexible = grade(f"{reasoning}The answer is {number}.", number, method="flexible")
        assert (flexible.score, flexible.extras["acc"]) == (1.0, True), row
        assert flexible.extras["method"] == "flexible"


def test_every_wrong_final_number_scores_zero_or_format_score(gold_solutions):
    for row in gold_solutions:
        answer, number = row["answer"], final_number(row["answer"])
        wrong = answer.rpartition("####")[0] + f"#### {off_by_one(number)}"
        assert grade(wrong, answer).score == 0.0, row
        assert grade(wrong, answer, format_score=0.1).score == 0.1, row
        flexible = f"{answer.rpartition('####')[0]}The answer is {off_by_one(number)}."
        result = grade(flexible, number, method="flexible")
        assert (result.score, result.extras["acc"]) == (0.0, False), row
        assert grade(flexible, number, method="flexible", format_score=0.1).score == 0.1


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_a_response_without_a_number_scores_zero_even_with_format_score(method):
    result = grade(
        "I am not sure. Could you repeat the question?", "72", method=method, format_score=0.1
    )
    assert result.score == 0.0
    assert result.extras == {
        "extracted": None,
        "ground_truth": "72",
        "method": method,
        "acc": False,
    }


def test_strict_needs_the_hash_marks_that_flexible_does_not():
    assert grade("So she has 72 clips.", "72").extras["extracted"] is None
    assert grade("So she has 72 clips.", "72", method="flexible").score == 1.0


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("#### 72.0", "72"),
        ("#### 72", 72),
        ("#### 72", 72.0),
        ("#### 1,000", "1000"),
        ("#### 1000", "... so #### 1,000"),
        ("#### -3", "-3"),
        ("#### 0.50", "0.5"),
    ],
)
def test_numbers_compare_by_value(response, ground_truth):
    assert grade(response, ground_truth).score == 1.0


def test_the_last_answer_counts_and_custom_scores_apply():
    assert grade("#### 5 no wait #### 7", "7").score == 1.0
    assert grade("#### 7 no wait #### 5", "7", score=2.0, format_score=-1.0).score == -1.0
    assert grade("#### 7", "7", score=2.0).score == 2.0


def test_flexible_skips_trailing_punctuation_that_is_not_a_number():
    result = grade("It costs $1,250. Done, right.", "1250", method="flexible")
    assert (result.score, result.extras["extracted"]) == (1.0, "1250")


def test_an_answer_far_before_the_end_is_not_found_as_in_verl():
    response = "#### 72\n" + "Let me double-check that. " * 20
    assert len(response) > gsm8k.SEARCHED_TAIL_CHARS
    assert grade(response, "72").extras["extracted"] is None


@pytest.mark.parametrize("ground_truth", [None, ["72"], True, "no number here", "#### "])
def test_a_ground_truth_without_a_number_is_rejected_by_value(ground_truth):
    with pytest.raises(ValueError, match=re.escape(repr(ground_truth))):
        grade("#### 72", ground_truth)


def test_an_unknown_method_is_rejected_by_value():
    with pytest.raises(ValueError, match=r"'fuzzy'.*'strict', 'flexible'"):
        grade("#### 72", "72", method="fuzzy")
