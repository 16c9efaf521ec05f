"""The calc_chain scorer on the chained task's own solved conversations and on the ways a
policy falls short of them: the outcome, and the turn each chain value is credited to."""

import copy

import pytest
from google.protobuf import json_format

from reward_svc.scorers import SCORERS, calc_chain
from reward_svc.scorers.base import ScoringRequest
from tests.reward_svc.test_service import reward_server
from turnrl.calculator_data import ProblemSettings, generate_problems
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2, reward_pb2

CHAINED = ProblemSettings(min_operations=2, max_operations=3, one_call_per_operation=True)


def grade(messages, ground_truth, **extra_info):
    final = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    request = ScoringRequest(
        data_source="calc_chain",
        response_text=final,
        messages=messages,
        ground_truth=ground_truth,
        extra_info=extra_info,
    )
    return SCORERS["calc_chain"].ref.load()(request)


@pytest.fixture(scope="module")
def problems():
    return generate_problems(20, seed=3, split="test", settings=CHAINED)


def ground_truth(problem):
    # Numbers as the wire gives them back: a protobuf Value holds every number as a double.
    return {"answer": float(problem.answer), "chain": [float(v) for v in problem.call_results]}


def test_a_solved_chain_credits_every_call_turn(problems):
    for problem in problems:
        steps = len(problem.call_results)
        assert steps in (2, 3) and problem.call_results[-1] == problem.answer
        result = grade(problem.messages, ground_truth(problem))
        assert result.score == 1.0 and result.extras["acc"] is True
        # Turn k is the k-th assistant message: the k-th call; the answer turn earns nothing.
        assert result.turn_rewards == {turn: pytest.approx(1 / steps) for turn in range(steps)}
        assert result.extras["chain_steps_reached"] == steps


def test_the_warm_starts_one_call_earns_its_turn_and_no_outcome(problems):
    problem = problems[0]
    first = problem.call_results[0]
    # What a one-call warm start writes: the first step, then that result as the answer.
    messages = [*problem.messages[:4], {"role": "assistant", "content": f"#### {first}"}]
    result = grade(messages, ground_truth(problem))
    assert result.score == 0.0 and result.extras["acc"] is False
    assert result.turn_rewards == {0: pytest.approx(1 / len(problem.call_results))}


def test_a_wrong_step_breaks_the_chain_from_there(problems):
    problem = next(p for p in problems if len(p.call_results) == 3)
    messages = copy.deepcopy(problem.messages)
    messages[5]["content"] = str(problem.call_results[1] + 1)  # the second call's result
    result = grade(messages, ground_truth(problem))
    assert result.turn_rewards == {0: pytest.approx(1 / 3)}
    assert result.extras["chain_steps_reached"] == 1
    assert result.score == 1.0  # the final answer is still right


def test_a_repeated_call_is_credited_once(problems):
    problem = problems[0]
    call, response = problem.messages[2:4]
    messages = [*problem.messages[:4], call, response, *problem.messages[4:]]
    result = grade(messages, ground_truth(problem), step_reward=0.5)
    steps = len(problem.call_results)
    assert result.turn_rewards == {0: 0.5, **{turn + 1: 0.5 for turn in range(1, steps)}}


def test_error_observations_and_answers_without_a_call_earn_nothing(problems):
    problem = problems[0]
    messages = [
        *problem.prompt_messages,
        problem.messages[2],
        {"role": "tool", "content": "Error: '(1 + 2) * 3' has 2 operations"},
        {"role": "assistant", "content": f"#### {problem.answer}"},
    ]
    result = grade(messages, ground_truth(problem))
    assert result.turn_rewards == {} and result.score == 1.0
    assert grade(problem.guess_messages, ground_truth(problem)).turn_rewards == {}


async def test_turn_rewards_reach_the_wire_from_the_reward_service(problems):
    """Through a real reward service: the conversation and ground truth as the rollout service
    sends them (messages as protos, the ground truth a protobuf Value), the scorer in the
    service's worker pool."""
    problem = next(p for p in problems if len(p.call_results) == 3)
    item = reward_pb2.ScoringInput(
        data_source="calc_chain",
        response_text=problem.messages[-1]["content"],
        messages=[dict_to_message(m) for m in problem.messages],
    )
    truth = {"answer": problem.answer, "chain": problem.call_results}
    json_format.ParseDict(truth, item.ground_truth)
    async with reward_server() as stub:
        reply = await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)
    reward = reply.result.reward
    assert reward.score == 1.0 and not reward.error, reward.error_message
    assert [(r.turn, r.value, r.source, r.name) for r in reward.turn_rewards] == [
        (turn, pytest.approx(1 / 3), common_pb2.TURN_REWARD_SOURCE_SCORER, "calc_chain")
        for turn in range(3)
    ]


@pytest.mark.parametrize(
    "bad", [{"answer": 3}, {"chain": [1, 3]}, {"answer": "x", "chain": [3]}, [3, 4], "3"]
)
def test_bad_ground_truth_is_named(bad):
    with pytest.raises(ValueError, match="calc_chain ground_truth") as info:
        calc_chain.chain_ground_truth(bad)
    assert repr(bad) in str(info.value)
