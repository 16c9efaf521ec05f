"""Competition math: the response's answer against the reference, by math-verify equivalence.

Follows verl's `math_verify` scorer: the reference is parsed as LaTeX inside `\\boxed{}` (added
when it has none), the response with both plain-expression and LaTeX extraction, and the two
compared symbolically ("\\frac{1}{2}" = "0.5", "[1,3)" = "\\left[1, 3\\right)", "\\{1,2\\}" =
"\\{2,1\\}"). math-verify's own timeouts use SIGALRM, which fails outside the main thread and
would fight the service's: they are turned off, and the process pool's per-item timeout bounds
a slow comparison instead.
"""

import logging
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from reward_svc.scorers.base import Score, ScoringRequest
from turnrl import code_problems

DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math",
    "aime2024",
    "aime2025",
    code_problems.DATA_SOURCE,  # the CPU code task's generated problems
)
# math-verify warns once per process that its timeouts are off; that is deliberate here.
for _module in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_module).setLevel(logging.ERROR)
_REFERENCE_EXTRACTION = (LatexExtractionConfig(),)
_RESPONSE_EXTRACTION = (ExprExtractionConfig(), LatexExtractionConfig())


def boxed_reference(ground_truth: Any) -> str:
    """The reference as LaTeX with a `\\boxed{}` answer, as verl gives it to math-verify.

    Raises ValueError for a ground truth that is neither a string nor a number.
    """
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise ValueError(
            f"math ground_truth {ground_truth!r} is a {type(ground_truth).__name__}; "
            "expected a LaTeX string or a number"
        )
    text = str(ground_truth)
    return text if "\\boxed" in text else f"\\boxed{{{text}}}"


def score(request: ScoringRequest) -> Score:
    """Scores 1.0 when the response's answer is equivalent to the reference, else 0.0.

    Raises ValueError when math-verify finds no answer in the ground truth.
    """
    reference = parse(
        boxed_reference(request.ground_truth), _REFERENCE_EXTRACTION, parsing_timeout=None
    )
    if not reference:
        raise ValueError(
            f"math ground_truth {request.ground_truth!r} holds no answer math-verify can parse; "
            "expected LaTeX such as '\\frac{1}{2}' or a number"
        )
    answer = parse(request.response_text, _RESPONSE_EXTRACTION, parsing_timeout=None)
    acc = verify(reference, answer, timeout_seconds=None)
    return Score(
        score=1.0 if acc else 0.0,
        extras={
            # parse returns [sympy value, the text it came from], or [] when nothing was found.
            "extracted": str(answer[-1]) if answer else "",
            "ground_truth": str(request.ground_truth),
            "acc": acc,
        },
    )
