"""Judge agreement: the reward of a judge's verdict on another trajectory, when the task knows
whether that trajectory was right (co-training a judge with the policy,
trainer_svc/judge_training.py).

The response is the judge's text; its verdict is the last yes/no (correct/incorrect), read as
the LLM judge scorer reads one (`reward_svc.scorers.judge.parse_yes_no`). The ground truth is
{"correct": true | false}: whether the judged trajectory was right by the task's own scorer.
A verdict that agrees earns 1.0, one that disagrees 0.0, and a text with no verdict 0.0: the
judge failed at its task, the model's doing (`extras["error"]` says so). The extras carry
`verdict` (1.0 yes, 0.0 no, absent when none was found) and `acc` (agreement), which the
trainer reads back as the judge's verdict on the policy.
"""

from typing import Any

from reward_svc.scorers.base import Score, ScoringRequest
from reward_svc.scorers.judge import parse_yes_no

DATA_SOURCES = ("judge_agreement",)


def judged_correct(ground_truth: Any) -> bool:
    """Whether the judged trajectory was right, from {"correct": bool}.

    Raises ValueError for any other ground truth.
    """
    if not isinstance(ground_truth, dict) or not isinstance(ground_truth.get("correct"), bool):
        raise ValueError(
            f'judge_agreement ground_truth {ground_truth!r}: expected {{"correct": true|false}}'
        )
    return ground_truth["correct"]


def score(request: ScoringRequest) -> Score:
    correct = judged_correct(request.ground_truth)
    verdict = parse_yes_no(request.response_text, 1.0)
    if verdict is None:
        return Score(0.0, {"acc": False, "error": "no verdict (yes/no, correct/incorrect)"})
    agrees = (verdict == 1.0) == correct
    return Score(float(agrees), {"acc": agrees, "verdict": verdict})
