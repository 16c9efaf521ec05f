"""verl's GSM8K reward function as a user's `custom_reward_function` file holds it, for the test
that verl functions run unchanged in the reward service.

Written for turnrl after verl's `verl/utils/reward_score/gsm8k.py` (extract_solution and
compute_score) and the data_source dispatch of `default_compute_score` in
`verl/utils/reward_score/__init__.py`, volcengine/verl, Copyright 2024 Bytedance Ltd. and/or
its affiliates, Apache License 2.0 (http://www.apache.org/licenses/LICENSE-2.0). verl's
`gsm8k.compute_score` is named `gsm8k_compute_score` here only because this file's
`compute_score` is the entry point verl's trainer calls.
"""

import re

# verl searches only the end of a response: regular expressions on long strings are slow.
_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        # The '#### N' form also checks the model's formatting.
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if not solutions:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    numbers = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
    for number in reversed(numbers):
        if number not in ("", "."):
            return number
    return None


def gsm8k_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """1.0 for the right final answer, format_score for a wrong one, 0 for none (verl's)."""
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source in ["openai/gsm8k", "gsm8k"]:
        return gsm8k_compute_score(solution_str, ground_truth)
    raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
