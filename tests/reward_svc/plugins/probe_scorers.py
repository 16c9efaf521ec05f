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


def returns_a_float(request: ScoringRequest) -> Score:
    return 1.0  # type: ignore[return-value]
