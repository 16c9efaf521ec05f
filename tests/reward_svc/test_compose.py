"""Weighted sums of real scorer results: format plus GSM8K accuracy."""

import pytest

from reward_svc.scorers import format as format_scorer
from reward_svc.scorers import gsm8k
from reward_svc.scorers.base import Score, ScoringRequest
from reward_svc.scorers.compose import weighted_sum

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "16-3-4"}}\n</tool_call>'


def parts_for(final_text: str) -> list[tuple[str, float, Score]]:
    """Format (weight 0.2) and accuracy (weight 0.8) of a calculator conversation."""
    request = ScoringRequest(
        data_source="openai/gsm8k",
        response_text=final_text,
        messages=[
            {"role": "user", "content": "Janet's ducks lay 16 eggs ..."},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "9"},
            {"role": "assistant", "content": final_text},
        ],
        ground_truth="... #### 18",
    )
    return [("format", 0.2, format_scorer.score(request)), ("gsm8k", 0.8, gsm8k.score(request))]


def test_weights_scale_each_part_and_extras_stay_under_its_name():
    combined = weighted_sum(parts_for("9 eggs at $2 each.\n#### 18"))
    assert combined.score == pytest.approx(1.0)
    assert combined.extras["format"] == {
        "score": 1.0,
        "weight": 0.2,
        "extras": {"tool_calls": 1, "malformed": 0, "calls_in_think": 0},
    }
    assert combined.extras["gsm8k"]["extras"]["extracted"] == "18"
    wrong = weighted_sum(parts_for("#### 17"))
    assert wrong.score == pytest.approx(0.2)
    assert wrong.extras["gsm8k"]["score"] == 0.0


def test_negative_weights_subtract():
    combined = weighted_sum([("a", 1.0, Score(1.0)), ("penalty", -0.5, Score(0.4))])
    assert combined.score == pytest.approx(0.8)


def test_turn_rewards_are_weighted_like_the_scores():
    combined = weighted_sum(
        [
            ("a", 2.0, Score(1.0, turn_rewards={0: 0.5, 1: 1.0})),
            ("b", -0.5, Score(0.0, turn_rewards={1: 2.0, 3: 4.0})),
        ]
    )
    assert combined.turn_rewards == {0: 1.0, 1: 1.0, 3: -2.0}


def test_no_parts_or_a_repeated_name_is_rejected():
    with pytest.raises(ValueError, match="got none"):
        weighted_sum([])
    with pytest.raises(ValueError, match=r"\['a', 'a'\]"):
        weighted_sum([("a", 1.0, Score(1.0)), ("a", 1.0, Score(0.0))])
