"""Built-in rule scorers by `data_source` (verl's names). They run in the worker pool, so each
is named by module and function rather than imported here."""

from dataclasses import dataclass

from reward_svc.scorers import calc_chain, gsm8k, judge_agreement, math, search_qa
from reward_svc.scorers import format as tool_call_format
from reward_svc.scorers.base import ScorerRef


@dataclass(frozen=True)
class RuleScorer:
    """A pure scoring function and what it checks."""

    name: str
    description: str
    ref: ScorerRef


GSM8K = RuleScorer(
    "gsm8k",
    "GSM8K final answer: strict '#### N' or flexible last number (extra_info.method)",
    ScorerRef(function="score", module=gsm8k.__name__),
)
MATH = RuleScorer(
    "math",
    "math-verify equivalence of the boxed answer (LaTeX, fractions, intervals, sets)",
    ScorerRef(function="score", module=math.__name__),
)
SEARCH_EM = RuleScorer(
    "search_em",
    "exact match of the last <answer> with any gold answer, SQuAD-normalised",
    ScorerRef(function="score_em", module=search_qa.__name__),
)
SEARCH_F1 = RuleScorer(
    "search_f1",
    "token F1 of the last <answer> with the best gold answer, SQuAD-normalised",
    ScorerRef(function="score_f1", module=search_qa.__name__),
)
FORMAT = RuleScorer(
    "format",
    "well-formed <tool_call> JSON, with a penalty for tool calls inside <think>",
    ScorerRef(function="score", module=tool_call_format.__name__),
)
CALC_CHAIN = RuleScorer(
    "calc_chain",
    "chained calculator problems: strict '#### N', and a reward for each turn whose "
    "calculator result is the chain's next value",
    ScorerRef(function="score", module=calc_chain.__name__),
)

JUDGE_AGREEMENT = RuleScorer(
    "judge_agreement",
    "a judge's yes/no verdict on a trajectory against whether it was right (co-training)",
    ScorerRef(function="score", module=judge_agreement.__name__),
)

RULE_SCORERS: dict[str, RuleScorer] = {
    rule.name: rule
    for rule in (GSM8K, MATH, SEARCH_EM, SEARCH_F1, FORMAT, CALC_CHAIN, JUDGE_AGREEMENT)
}
SCORERS: dict[str, RuleScorer] = {
    **dict.fromkeys(gsm8k.DATA_SOURCES, GSM8K),
    **dict.fromkeys(math.DATA_SOURCES, MATH),
    **dict.fromkeys(search_qa.EM_DATA_SOURCES, SEARCH_EM),
    **dict.fromkeys(search_qa.F1_DATA_SOURCES, SEARCH_F1),
    "tool_call_format": FORMAT,
    **dict.fromkeys(calc_chain.DATA_SOURCES, CALC_CHAIN),
    **dict.fromkeys(judge_agreement.DATA_SOURCES, JUDGE_AGREEMENT),
}
