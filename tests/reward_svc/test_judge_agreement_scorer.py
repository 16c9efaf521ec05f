"""The judge_agreement scorer: a judge's verdict against whether the judged trajectory was right."""

import re

import pytest

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest


def agreement(text: str, correct: object) -> tuple[float, dict]:
    request = ScoringRequest(
        data_source="judge_agreement", response_text=text, ground_truth={"correct": correct}
    )
    scored = SCORERS["judge_agreement"].ref.load()(request)
    return scored.score, scored.extras


@pytest.mark.parametrize(
    ("text", "correct", "score", "verdict"),
    [
        ("The tool says 42 and so does the answer.\nVerdict: yes", True, 1.0, 1.0),
        ("Verdict: yes", False, 0.0, 1.0),  # fooled
        ("The answer says 41, the tool 42.\nVerdict: no", False, 1.0, 0.0),
        ("**Incorrect**", True, 0.0, 0.0),
        ("Verdict: no ... on second thought, Verdict: yes", True, 1.0, 1.0),  # the last one
    ],
)
def test_a_verdict_earns_its_agreement(text, correct, score, verdict):
    scored, extras = agreement(text, correct)
    assert scored == score
    assert extras["verdict"] == verdict and extras["acc"] is bool(score)


def test_no_verdict_is_the_judges_failure_scored_zero():
    scored, extras = agreement("I am not sure what to say", False)
    assert scored == 0.0 and "verdict" not in extras and "no verdict" in extras["error"]


@pytest.mark.parametrize("correct", ["yes", 1, None])
def test_a_ground_truth_without_a_boolean_is_refused(correct):
    with pytest.raises(ValueError, match=re.escape('expected {"correct": true|false}')):
        agreement("Verdict: yes", correct)
