"""Open-domain QA (Search-R1): the last `<answer>...</answer>` against the gold answers.

Follows verl's `search_r1_like_qa_em`: answers are compared after SQuAD normalisation
(lower case, no punctuation, no articles a/an/the, single spaces), against every gold answer.
The metric is a property of the data source, so there are two scorers and the registry picks
one: `score_em` (exact match, Search-R1's reward) for EM_DATA_SOURCES and `score_f1` (best
token F1, partial credit) for F1_DATA_SOURCES. Both report em and f1 in extras.

Rewards, as in verl, with extra_info `score` (1.0) and `format_score` (0.0): no `<answer>`
tag scores 0.0; a correct answer scores `score`, a quarter of it when the response holds more
than MAX_ANSWER_TAGS opening or closing answer tags (tag spamming); a wrong one scores
`format_score`. Under F1, an answer sharing any token with a gold scores `score` * F1, and
one sharing none is wrong.
"""

import re
import string
from collections import Counter
from typing import Any

from reward_svc.scorers.base import Score, ScoringRequest
from turnrl import search_world

_QA_DATASETS = (
    "nq",
    "triviaqa",
    "popqa",
    "hotpotqa",
    "2wikimultihopqa",
    "musique",
    "bamboogle",
)
# With the CPU search task's generated questions (turnrl.search_world).
EM_DATA_SOURCES = (
    *_QA_DATASETS,
    *(f"searchR1_{name}" for name in _QA_DATASETS),
    search_world.DATA_SOURCE,
)
F1_DATA_SOURCES: tuple[str, ...] = ()
MAX_ANSWER_TAGS = 10
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, punctuation and articles removed, spaces collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(response: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in `response`, or None."""
    answers = _ANSWER.findall(response)
    return answers[-1].strip() if answers else None


def gold_answers(ground_truth: Any) -> list[str]:
    """The acceptable answers from a string, a list of strings or Search-R1's
    `{"target": [...]}`.

    Raises ValueError for any other shape or an empty list.
    """
    golds = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if isinstance(golds, str):
        return [golds]
    if isinstance(golds, list | tuple) and golds and all(isinstance(g, str) for g in golds):
        return list(golds)
    raise ValueError(
        f"search ground_truth {ground_truth!r} holds no gold answers; expected a string, "
        "a non-empty list of strings, or {'target': [strings]}"
    )


def exact_match(prediction: str, golds: list[str]) -> float:
    """1.0 when `prediction` normalises to the same text as any gold answer, else 0.0."""
    normalized = normalize_answer(prediction)
    return float(any(normalize_answer(gold) == normalized for gold in golds))


def token_f1(prediction: str, golds: list[str]) -> float:
    """The best SQuAD token F1 of `prediction` against any gold answer."""
    return max(
        _f1(normalize_answer(prediction).split(), normalize_answer(g).split()) for g in golds
    )


def _f1(predicted_tokens: list[str], gold_tokens: list[str]) -> float:
    if not predicted_tokens or not gold_tokens:
        # SQuAD 2.0's rule: an empty side matches only another empty side.
        return float(predicted_tokens == gold_tokens)
    common = sum((Counter(predicted_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(predicted_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def score_em(request: ScoringRequest) -> Score:
    """Exact-match reward of the last `<answer>` (see the module docstring)."""
    return _score(request, "em")


def score_f1(request: ScoringRequest) -> Score:
    """Token-F1 reward of the last `<answer>` (see the module docstring)."""
    return _score(request, "f1")


def _score(request: ScoringRequest, metric: str) -> Score:
    golds = gold_answers(request.ground_truth)
    right_score = float(request.extra_info.get("score", 1.0))
    wrong_score = float(request.extra_info.get("format_score", 0.0))
    extracted = extract_answer(request.response_text)
    if extracted is None:
        return Score(score=0.0, extras={"extracted": None, "em": 0.0, "f1": 0.0})
    grades = {"em": exact_match(extracted, golds), "f1": token_f1(extracted, golds)}
    response = request.response_text
    if max(response.count("<answer>"), response.count("</answer>")) > MAX_ANSWER_TAGS:
        right_score /= 4
    value = grades[metric]
    reward = right_score * value if value > 0 else wrong_score
    return Score(score=reward, extras={"extracted": extracted, **grades})
