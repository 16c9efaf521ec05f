"""The Search-R1 QA scorers on the NQ-open questions, and F1 partial credit by hand."""

import gzip
import json
import re
from pathlib import Path

import pytest

from reward_svc.scorers import search_qa
from reward_svc.scorers.base import ScoringRequest


@pytest.fixture(scope="module")
def nq_answers(fixtures: Path) -> list[list[str]]:
    """The gold answer lists of the 2,655 NQ-open questions."""
    with gzip.open(fixtures / "search" / "nq-open-oracle.jsonl.gz", "rt") as lines:
        answers = [json.loads(line)["answers"] for line in lines]
    assert len(answers) == 2655
    return answers


def grade(response: str, ground_truth, scorer=search_qa.score_em, **extra_info):
    return scorer(
        ScoringRequest(
            data_source="nq",
            response_text=response,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
    )


def restyled(answer: str) -> str:
    """`answer` as a sloppy model might write it: an article, capitals, punctuation, spaces."""
    return f'The  "{answer.upper().replace(" ", "  ")}"!'


def ground_truth_forms(answers: list[str]) -> list:
    """The three shapes a ground truth comes in: a string, a list, Search-R1's dict."""
    return [answers[0], answers, {"target": answers}]


def test_every_nq_question_scores_one_for_a_restyled_gold_answer(nq_answers):
    for answers in nq_answers:
        response = f"<think>Let me search.</think>\n<answer> {restyled(answers[0])} </answer>"
        for ground_truth in ground_truth_forms(answers):
            result = grade(response, ground_truth)
            assert (result.score, result.extras["em"], result.extras["f1"]) == (1.0, 1.0, 1.0), (
                answers
            )
            assert grade(response, ground_truth, search_qa.score_f1).score == 1.0


def test_every_nq_question_scores_zero_for_another_questions_answer(nq_answers):
    for index, answers in enumerate(nq_answers):
        golds = {search_qa.normalize_answer(a) for a in answers}
        others = (nq_answers[(index + step) % len(nq_answers)][0] for step in range(1, 10))
        wrong = next(o for o in others if search_qa.normalize_answer(o) not in golds)
        for ground_truth in ground_truth_forms(answers):
            result = grade(f"<answer>{wrong}</answer>", ground_truth)
            assert (result.score, result.extras["em"]) == (0.0, 0.0), (answers, wrong)
            assert result.extras["extracted"] == wrong
            assert grade(f"<answer>{wrong}</answer>", ground_truth, format_score=0.1).score == 0.1


@pytest.mark.parametrize(
    ("answer", "golds", "f1"),
    [
        # precision 1/1, recall 1/3: 2 * 1 * 1/3 / (1 + 1/3) = 1/2.
        ("Röntgen", ["Wilhelm Conrad Röntgen"], 0.5),
        # "the" is dropped first: precision 2/2, recall 2/3: 2 * 1 * 2/3 / (5/3) = 4/5.
        ("Raymond Unwin", ["the planner Raymond Unwin"], 0.8),
        # precision 2/5, recall 2/3: 2 * 2/5 * 2/3 / (16/15) = 1/2.
        ("Raymond Unwin and Barry Parker", ["the planner Raymond Unwin"], 0.5),
        # The best gold counts: "291" matches the second one exactly.
        ("291", ["291 episodes", "291"], 1.0),
        # A repeated token matches only as often as the gold has it: p 1/2, r 1, F1 2/3.
        ("Paris Paris", ["Paris"], 2 / 3),
        ("London", ["Paris"], 0.0),
    ],
)
def test_f1_gives_partial_credit_computed_by_hand(answer, golds, f1):
    result = grade(f"<answer>{answer}</answer>", golds, search_qa.score_f1)
    assert result.score == pytest.approx(f1)
    assert result.extras["f1"] == pytest.approx(f1)
    assert result.extras["em"] == float(f1 == 1.0)
    assert grade(f"<answer>{answer}</answer>", golds).score == float(f1 == 1.0)


def test_the_last_answer_tag_counts():
    response = "<answer>Paris</answer> Hmm, no. <answer>\nLondon\n</answer>"
    assert grade(response, "London").extras["extracted"] == "London"
    assert grade(response, "London").score == 1.0
    assert grade(response, "Paris").score == 0.0


@pytest.mark.parametrize(
    "response", ["London", "<answer>London", "London</answer>", "<answer London</answer>"]
)
def test_a_response_without_a_closed_answer_tag_scores_zero(response):
    result = grade(response, "London", format_score=0.1)
    assert result.score == 0.0
    assert result.extras == {"extracted": None, "em": 0.0, "f1": 0.0}


def test_answer_tag_spam_quarters_the_reward_as_in_verl():
    spam = "<answer>Paris</answer>" * (search_qa.MAX_ANSWER_TAGS + 1)
    assert grade(spam, "Paris").score == 0.25
    assert grade(spam, "Paris", score=2.0).score == 0.5
    assert grade(spam.replace("Paris", "Rome"), "Paris", format_score=0.1).score == 0.1
    assert grade("<answer>Paris</answer>" * search_qa.MAX_ANSWER_TAGS, "Paris").score == 1.0


def test_an_empty_answer_matches_nothing():
    result = grade("<answer></answer>", ["Paris"], search_qa.score_f1)
    assert (result.score, result.extras["extracted"]) == (0.0, "")


@pytest.mark.parametrize("ground_truth", [None, [], ["Paris", 3], {"answers": ["Paris"]}, 3])
def test_a_ground_truth_of_the_wrong_shape_is_rejected_by_value(ground_truth):
    with pytest.raises(ValueError, match=re.escape(repr(ground_truth))):
        grade("<answer>Paris</answer>", ground_truth)


def test_em_data_sources_cover_each_dataset_with_and_without_the_prefix():
    for name in ("nq", "hotpotqa", "bamboogle"):
        assert {name, f"searchR1_{name}"} <= set(search_qa.EM_DATA_SOURCES)
    assert not set(search_qa.EM_DATA_SOURCES) & set(search_qa.F1_DATA_SOURCES)
