"""The math scorer: math-verify equivalence, as verl's `math_verify` scorer applies it."""

import pickle
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from reward_svc.scorers import math as math_scorer
from reward_svc.scorers.base import ScoringRequest

# (ground truth, response) pairs that math-verify finds equivalent.
EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "The answer is $\\frac{1}{2}$."),
    ("0.75", "So the probability is \\boxed{\\frac{3}{4}}."),
    ("5/2", "$\\dfrac{10}{4}$"),
    ("\\frac{5}{2}", "\\boxed{2.5}"),
    ("[1, 3)", "The solution set is $[1,3)$."),
    ("\\left[1, 3\\right)", "\\boxed{[1, 3)}"),
    ("(-\\infty, 2]", "\\boxed{(-\\infty,2]}"),
    ("\\frac{\\sqrt{2}}{2}", "$\\sqrt{2}/2$"),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}"),
    ("5", "$x = 5$"),
    ("5", "\\boxed{x=5}"),
    # Percent: math-verify reads "10\%" as 10/100 yet accepts it against 10, both ways round.
    ("10", "$10\\%$"),
    ("10\\%", "\\boxed{10}"),
    ("\\{1,2\\}", "$\\{2,1\\}$"),
    ("\\{1,2\\}", "\\boxed{\\{1, 2\\}}"),
    ("2\\pi", "$\\pi \\cdot 2$"),
    ("90^\\circ", "\\boxed{90}"),
    ("90", "\\boxed{90^{\\circ}}"),
    ("123456789012345678901234567890", "\\boxed{123456789012345678901234567890}"),
    ("-3", "The answer is $-3$."),
    ("-\\frac{7}{3}", "\\boxed{-7/3}"),
    ("1000", "\\boxed{1,000}"),
    ("1000", "$1{,}000$"),
    ("1,000", "\\boxed{1000}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("\\text{(A)}", "\\boxed{A}"),
    ("3\\sqrt{3}", "\\boxed{\\sqrt{27}}"),
    ("2, 3", "\\boxed{3, 2}"),
    ("(1, 2)", "\\boxed{(1,2)}"),
    # Numbers agree to 6 decimal places.
    ("0.3333333", "\\boxed{\\frac{1}{3}}"),
    ("\\frac{1}{3}", "\\boxed{0.333333}"),
    ("\\log_2 8", "\\boxed{3}"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}"),
    ("2^{10}", "\\boxed{1024}"),
    ("\\$5", "\\boxed{5}"),
    ("5 \\text{ cm}", "\\boxed{5}"),
    ("y = 2x + 3", "\\boxed{y=2x+3}"),
    ("\\infty", "\\boxed{\\infty}"),
    (42, "#### the answer is 42"),
    (0.25, "\\boxed{\\frac14}"),
    ("\\boxed{7}", "The final answer is \\boxed{7}"),
]

NOT_EQUIVALENT = [
    ("\\frac{1}{2}", "0.51"),
    ("0.5", "\\boxed{\\frac{1}{3}}"),
    ("[1, 3)", "\\boxed{[1,3]}"),
    ("[1, 3)", "\\boxed{(1,3)}"),
    ("(-\\infty, 2]", "\\boxed{(-\\infty,2)}"),
    ("\\{1,2\\}", "\\boxed{\\{1,2,3\\}}"),
    ("\\{1,2\\}", "\\boxed{\\{1\\}}"),
    ("2\\pi", "\\boxed{\\pi}"),
    ("2\\pi", "\\boxed{6.28}"),
    ("\\sqrt{2}", "\\boxed{1.41}"),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{2}}"),
    ("5", "\\boxed{-5}"),
    ("-3", "\\boxed{3}"),
    ("5", "$x = 6$"),
    ("10", "\\boxed{100}"),
    ("1000", "\\boxed{1001}"),
    ("123456789012345678901234567890", "\\boxed{123456789012345678901234567891}"),
    ("x^2+2x+1", "\\boxed{(x-1)^2}"),
    ("x^2", "\\boxed{y^2}"),
    ("\\text{(A)}", "\\boxed{B}"),
    ("(1, 2)", "\\boxed{(2,1)}"),
    # A boxed answer outranks a later bare number.
    ("3", "the answer is \\boxed{4}, no wait 3"),
    ("90^\\circ", "\\boxed{45}"),
    ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}"),
    ("\\frac{1}{3}", "\\boxed{0.33}"),
    ("2^{10}", "\\boxed{1000}"),
    ("\\log_2 8", "\\boxed{2}"),
    ("\\infty", "\\boxed{-\\infty}"),
    ("y = 2x + 3", "\\boxed{y=3x+2}"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\boxed{\\begin{pmatrix}2\\\\1\\end{pmatrix}}"),
    ("7", "\\boxed{}"),
    ("7", "\\boxed{seven}"),
    ("2, 3", "\\boxed{2, 4}"),
    (42, "\\boxed{24}"),
    ("0", "\\boxed{1}"),
    # math-verify does not evaluate Euler's identity: a known limit, not a wish.
    ("e^{i\\pi}", "\\boxed{-1}"),
]


def grade(ground_truth, response: str):
    return math_scorer.score(
        ScoringRequest(data_source="math", response_text=response, ground_truth=ground_truth)
    )


def test_there_are_enough_pairs_of_each_kind():
    assert len(EQUIVALENT) >= 30
    assert len(NOT_EQUIVALENT) >= 30


@pytest.mark.parametrize(("ground_truth", "response"), EQUIVALENT)
def test_equivalent_answers_score_one(ground_truth, response):
    result = grade(ground_truth, response)
    assert (result.score, result.extras["acc"]) == (1.0, True), result.extras
    assert result.extras["ground_truth"] == str(ground_truth)


@pytest.mark.parametrize(("ground_truth", "response"), NOT_EQUIVALENT)
def test_different_answers_score_zero(ground_truth, response):
    result = grade(ground_truth, response)
    assert (result.score, result.extras["acc"]) == (0.0, False), result.extras


def test_the_extracted_answer_is_the_text_math_verify_found():
    assert grade("0.75", "So it is \\boxed{\\frac{3}{4}}.").extras["extracted"] == "\\frac{3}{4}"


def test_a_text_only_response_scores_zero_with_nothing_extracted():
    result = grade("\\frac{1}{2}", "I could not work this one out, sorry.")
    assert result.score == 0.0
    assert result.extras == {"extracted": "", "ground_truth": "\\frac{1}{2}", "acc": False}


def test_an_unboxed_final_answer_is_still_found():
    assert grade("3", "Adding them up, the answer is 3.").score == 1.0


def test_scoring_works_off_the_main_thread_where_sigalrm_timeouts_cannot():
    with ThreadPoolExecutor(max_workers=1) as executor:
        result = executor.submit(grade, "\\frac{1}{2}", "\\boxed{0.5}").result(timeout=60)
    assert result.score == 1.0


def test_the_scorer_pickles_for_the_process_pool():
    assert pickle.loads(pickle.dumps(math_scorer.score)) is math_scorer.score


@pytest.mark.parametrize("ground_truth", [None, ["1"], True, {"answer": "1"}, "", "}{"])
def test_an_ungradable_ground_truth_is_rejected_by_value(ground_truth):
    with pytest.raises(ValueError, match=re.escape(repr(ground_truth))):
        grade(ground_truth, "\\boxed{1}")


def test_data_sources_name_the_math_datasets():
    assert {"lighteval/MATH", "HuggingFaceH4/MATH-500", "aime2025"} <= set(math_scorer.DATA_SOURCES)
