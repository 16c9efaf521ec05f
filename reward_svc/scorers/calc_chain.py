"""Chained calculator problems: the final `#### N` as the outcome, and a reward for each turn
whose calculator call computes the next value of the chain.

A chained problem applies its operations one after another to a running count
(`turnrl.calculator_data` with `one_call_per_operation`), so a solution calls the calculator
once per operation, each call on the previous call's result. The ground truth is
{"answer": N, "chain": [v1, ..., vk]}: the final answer and the running count after each
operation (vk == N).

Outcome (`score`): `right_score` (extra_info `score`, 1.0) when the last `#### N` of the final
assistant text equals the answer (gsm8k's strict extraction), else `format_score`
(extra_info `format_score`, 0.0).

Turn rewards: the assistant messages are the model's turns, indexed from 0 in order. Walking
them in order, a turn earns `step_reward` (extra_info `step_reward`, default 1/k) for each
calculator result among the tool messages answering it that equals the chain's next value not
yet reached; each value is credited once and in order, so repeating a call earns nothing and a
chain computed out of order earns only its in-order prefix. The tool's own answer is read, not
the model's arguments: the scorer trusts the calculator, not the policy.
"""

from decimal import Decimal
from typing import Any

from reward_svc.scorers.base import Score, ScoringRequest
from reward_svc.scorers.gsm8k import extract_answer, to_number

DATA_SOURCES = ("calc_chain",)


def chain_ground_truth(ground_truth: Any) -> tuple[Decimal, list[Decimal]]:
    """The answer and the chain's values from {"answer": N, "chain": [v1, ..., vk]}.

    Raises ValueError naming what is missing or not a number.
    """
    expected = 'expected {"answer": <number>, "chain": [<number>, ...]}'
    if not isinstance(ground_truth, dict) or not isinstance(ground_truth.get("chain"), list):
        raise ValueError(f"calc_chain ground_truth {ground_truth!r}: {expected}")
    values = [_number(value) for value in [ground_truth.get("answer"), *ground_truth["chain"]]]
    if any(value is None for value in values) or len(values) < 2:
        raise ValueError(f"calc_chain ground_truth {ground_truth!r}: {expected}")
    return values[0], values[1:]


def score(request: ScoringRequest) -> Score:
    """Grades the final answer and credits each turn's calls (see the module docstring)."""
    answer, chain = chain_ground_truth(request.ground_truth)
    right_score = float(request.extra_info.get("score", 1.0))
    wrong_score = float(request.extra_info.get("format_score", 0.0))
    step_reward = float(request.extra_info.get("step_reward", 1.0 / len(chain)))
    extracted = extract_answer(request.response_text, "strict")
    acc = extracted is not None and to_number(extracted) == answer
    turn_rewards: dict[int, float] = {}
    reached = 0
    for turn, results in enumerate(_results_by_turn(request.messages)):
        for result in results:
            if reached < len(chain) and result == chain[reached]:
                reached += 1
                turn_rewards[turn] = turn_rewards.get(turn, 0.0) + step_reward
    extras = {
        "extracted": extracted,
        "acc": acc,
        "chain_steps": len(chain),
        "chain_steps_reached": reached,
        "tool_results": sum(map(len, _results_by_turn(request.messages))),
    }
    return Score(right_score if acc else wrong_score, extras, turn_rewards)


def _results_by_turn(messages: list[dict[str, Any]]) -> list[list[Decimal | None]]:
    """For each assistant message in order, the values of the tool messages that follow it
    (None for a result that is no number: an error, a fraction)."""
    turns: list[list[Decimal | None]] = []
    for message in messages:
        if message.get("role") == "assistant":
            turns.append([])
        elif message.get("role") == "tool" and turns:
            content = message.get("content")
            turns[-1].append(to_number(content.strip()) if isinstance(content, str) else None)
    return turns


def _number(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    return to_number(str(value))
