"""User scorer plugins for tests, loaded by file path as verl's custom_reward_function is."""

import os
import time

from reward_svc.scorers.base import Score, ScoringRequest


def compute_score(request: ScoringRequest) -> Score:
    """1.0 when the response equals the ground truth, with the length in extras."""
    return Score(
        float(request.response_text == request.ground_truth), {"length": len(request.response_text)}
    )


def raises(request: ScoringRequest) -> Score:
    raise ValueError(f"cannot grade {request.response_text!r}")


def sleeps_forever(request: ScoringRequest) -> Score:
    while True:
        time.sleep(1)


def kills_its_process(request: ScoringRequest) -> Score:
    os._exit(3)


def fails_on_some_responses(request: ScoringRequest) -> Score:
    """`compute_score`, except that it raises, hangs or kills its process on the responses
    "raise", "hang" and "die": as math-verify may on an expression the model wrote."""
    if request.response_text == "raise":
        raise RecursionError("maximum recursion depth exceeded")
    if request.response_text == "hang":
        sleeps_forever(request)
    if request.response_text == "die":
        kills_its_process(request)
    return compute_score(request)


def returns_a_float(request: ScoringRequest) -> Score:
    return 1.0  # type: ignore[return-value]


def verl_breakdown(data_source, solution_str, ground_truth, extra_info=None):
    """A verl reward function returning a dict: its keys besides "score" are what verl logs."""
    right = solution_str == ground_truth
    return {"score": float(right), "acc": right, "difficulty": extra_info["difficulty"]}


def verl_fails_on_some_responses(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError(f"cannot parse {solution_str!r}")
    return 1.0


def verl_returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"


def _model_turns(request: ScoringRequest) -> int:
    return sum(message["role"] == "assistant" for message in request.messages)


def rewards_each_turn(request: ScoringRequest) -> Score:
    """`compute_score` as the outcome, and 0.1 * (k + 1) for model turn k."""
    turns = {turn: 0.1 * (turn + 1) for turn in range(_model_turns(request))}
    return Score(compute_score(request).score, turn_rewards=turns)


def rewards_a_turn_past_the_end(request: ScoringRequest) -> Score:
    """A per-turn reward for the turn after the last: a turn the conversation does not have."""
    return Score(1.0, turn_rewards={_model_turns(request): 1.0})


def rewards_a_named_turn(request: ScoringRequest) -> Score:
    return Score(1.0, turn_rewards={"first": 1.0})  # type: ignore[dict-item]


def verl_turn_rewards(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "acc": True, "turn_rewards": {0: -0.5, 2: 0.25}}
