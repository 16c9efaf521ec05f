"""GSM8K: the final number of a response against the reference answer (verl's `gsm8k`).

Extraction follows verl. "strict" takes the last `#### <number>`, the form GSM8K solutions
end with, so it also grades the format; "flexible" takes the last number anywhere. Only the
last SEARCHED_TAIL_CHARS characters are searched, as in verl: the answer belongs at the end.
Unlike verl's string equality, numbers compare by value: "72.0", "72." and "72" agree, and so
do "1,000" and "1000".

extra_info options (verl's `compute_score` arguments): `method` ("strict" or "flexible"),
`score` (reward of a right answer, 1.0), `format_score` (reward of a wrong one, 0.0). A
response with no answer at all scores 0.0.
"""

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from reward_svc.scorers.base import Score, ScoringRequest
from turnrl import zoom_digits

DATA_SOURCES = (
    "openai/gsm8k",
    "gsm8k",
    zoom_digits.DATA_SOURCE,  # the CPU image task's generated problems: "#### <digit>"
)
METHODS = ("strict", "flexible")
# verl's cut-off: a response that runs on this far past its answer is not credited.
SEARCHED_TAIL_CHARS = 300
_PATTERNS = {
    "strict": re.compile(r"#### (-?[0-9.,]+)"),
    "flexible": re.compile(r"-?[0-9.,]+"),
}


def extract_answer(text: str, method: str) -> str | None:
    """Returns the last number `method` finds near the end of `text`, without commas or a
    sentence's full stop, or None.

    Raises ValueError for a method other than "strict" and "flexible".
    """
    if method not in _PATTERNS:
        raise ValueError(f"unknown gsm8k method {method!r}; expected one of {list(METHODS)}")
    candidates = _PATTERNS[method].findall(text[-SEARCHED_TAIL_CHARS:])
    # The character class also matches lone "." and "," (ends of sentences): skip those.
    numbers = [c.replace(",", "").rstrip(".") for c in candidates if any(ch.isdigit() for ch in c)]
    return numbers[-1] if numbers else None


def to_number(text: str) -> Decimal | None:
    """The value of a decimal numeral such as "-1000.50", or None when `text` is not one."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def reference_answer(ground_truth: Any) -> tuple[str, Decimal]:
    """The reference number as text and value, from a GSM8K answer ending `#### <number>`, a
    numeral, or a number.

    Raises ValueError when `ground_truth` holds no such number.
    """
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise ValueError(
            f"gsm8k ground_truth {ground_truth!r} is a {type(ground_truth).__name__}; "
            "expected a number, a numeral, or a GSM8K answer ending '#### <number>'"
        )
    text = str(ground_truth).rpartition("####")[2].strip().replace(",", "").replace("$", "")
    value = to_number(text)
    if value is None:
        raise ValueError(
            f"gsm8k ground_truth {ground_truth!r} has no final number; "
            "expected a number, a numeral, or a GSM8K answer ending '#### <number>'"
        )
    return text, value


def score(request: ScoringRequest) -> Score:
    """Grades the response's final number against the reference (see the module docstring)."""
    method = request.extra_info.get("method", "strict")
    right_score = float(request.extra_info.get("score", 1.0))
    wrong_score = float(request.extra_info.get("format_score", 0.0))
    reference_text, reference_value = reference_answer(request.ground_truth)
    extracted = extract_answer(request.response_text, method)
    acc = extracted is not None and to_number(extracted) == reference_value
    extras = {"extracted": extracted, "ground_truth": reference_text, "method": method, "acc": acc}
    if extracted is None:
        return Score(score=0.0, extras=extras)
    return Score(score=right_score if acc else wrong_score, extras=extras)
