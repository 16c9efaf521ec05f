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
