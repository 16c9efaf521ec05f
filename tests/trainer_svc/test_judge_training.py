"""Co-training a judge (trainer_svc/judge_training.py): the judges' prompts, the policy's
rewards from their verdicts, what is left out, and the figures; then runs through the real
services, in the sync and the async loop, in which the policy's model judges its own
trajectories and both roles train."""

import json
import math

import pytest

from tests.trainer_svc.runs import read_dump, run_config, run_to_end
from tests.trainer_svc.test_rl_step import TWO_TURNS, trajectory
from trainer_svc.config import JudgeTrainingConfig
from trainer_svc.judge_training import (
    JUDGE_DATA_SOURCE,
    JUDGE_PREFIX,
    judge_metrics,
    judge_prompt,
    judge_records,
    judged_policy,
)
from turnrl.messages import openai_tool_call
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2

CONVERSATION = [
    {"role": "system", "content": "You can call a calculator."},
    {"role": "user", "content": "What is 6 times 7?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [openai_tool_call("c0", "calculator", {"expression": "6*7"})],
    },
    {"role": "tool", "content": "42", "tool_call_id": "c0", "name": "calculator"},
    {"role": "assistant", "content": "#### 42"},
]


def policy_trajectory(name: str, task_score: float) -> Trajectory:
    result = trajectory(name, task_score, TWO_TURNS, acc=task_score == 1.0)
    result.trajectory_id = name
    result.messages = CONVERSATION
    return result


def judge(policy: Trajectory, sample: int, verdict: float | None, *, failed=False) -> Trajectory:
    """A judge's trajectory as the rollout service returns it, scored by judge_agreement."""
    result = trajectory(JUDGE_PREFIX + policy.trajectory_id, 0.0, TWO_TURNS)
    result.trajectory_id = f"{result.group_id}/{sample}"
    right = policy.reward.extras.fields["acc"].bool_value
    if failed:
        result.reward = common_pb2.Reward(score=0.0, error=True, error_message="reward down")
    elif verdict is None:
        result.reward.extras.update({"acc": False, "error": "no verdict"})
    else:
        agrees = (verdict == 1.0) == right
        result.reward = common_pb2.Reward(score=float(agrees))
        result.reward.extras.update({"acc": agrees, "verdict": verdict})
    return result


def test_a_judges_prompt_names_the_problem_and_every_turn_after_it():
    prompt = judge_prompt(policy_trajectory("p", 1.0).messages, JudgeTrainingConfig().rubric)
    assert "Problem: What is 6 times 7?" in prompt
    assert 'assistant:\ncalls calculator({"expression": "6*7"})' in prompt
    assert "tool: 42\n\nassistant: #### 42" in prompt
    assert "You can call a calculator" not in prompt  # the system prompt is the policy's own
    assert prompt.endswith("or 'Verdict: no'.")


def test_judge_records_carry_whether_the_policy_was_right():
    records = judge_records(
        [policy_trajectory("right", 1.0), policy_trajectory("wrong", 0.0)], JudgeTrainingConfig()
    )
    assert [r.prompt_id for r in records] == [JUDGE_PREFIX + "right", JUDGE_PREFIX + "wrong"]
    assert [r.ground_truth for r in records] == [{"correct": True}, {"correct": False}]
    assert {r.data_source for r in records} == {JUDGE_DATA_SOURCE}
    assert [m["role"] for m in records[0].messages] == ["user"]


def test_the_policy_is_rewarded_by_its_judges_and_the_task_by_truth_weight():
    right, wrong = policy_trajectory("right", 1.0), policy_trajectory("wrong", 0.0)
    judges = [
        judge(right, 0, 1.0), judge(right, 1, 0.0), judge(right, 2, None),
        judge(wrong, 0, 1.0), judge(wrong, 1, 1.0),
    ]  # fmt: skip
    judged = judged_policy([right, wrong], judges, JudgeTrainingConfig(truth_weight=0.25))
    # right: verdicts 1, 0 and none (no), mean 1/3; wrong: fooled twice, mean 1.
    assert judged.policy == [right, wrong]
    assert math.isclose(right.reward.score, 0.75 / 3 + 0.25)
    assert wrong.reward.score == 0.75
    extras = {t.trajectory_id: t.reward.extras.fields for t in (right, wrong)}
    assert extras["right"]["task_score"].number_value == 1.0
    assert extras["wrong"]["judge_verdict"].number_value == 1.0
    # Accuracy stays the task's, though the wrong one now earns more than the right one.
    assert extras["right"]["acc"].bool_value and not extras["wrong"]["acc"].bool_value
    assert judged.judges == judges
    assert judge_metrics(judged.policy, judged.judges) == {
        "agreement": 1 / 5,
        "no_verdict_share": 1 / 5,
        "right_share_on_right": 1 / 3,
        "fooled_share": 1.0,
    }


def test_judges_the_system_failed_are_left_out_and_a_policy_left_unjudged_with_them():
    judged_twice, unjudged = policy_trajectory("a", 1.0), policy_trajectory("b", 0.0)
    judges = [
        judge(judged_twice, 0, 1.0),
        judge(judged_twice, 1, None, failed=True),
        judge(unjudged, 0, None, failed=True),
    ]
    judged = judged_policy([judged_twice, unjudged], judges, JudgeTrainingConfig())
    assert judged.policy == [judged_twice] and judged_twice.reward.score == 1.0
    assert judged.judges == judges[:1]
    assert judged.counts() == {
        "judge/infra_failed_verdicts": 2.0,
        "judge/unjudged_policy_trajectories": 1.0,
    }


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rubric": "Is {question} answered?"}, "must hold {transcript}"),
        ({"rubric": "{transcript} {reference}"}, "placeholders ['reference', 'transcript']"),
        ({"rubric": "{transcript"}, "judge_training.rubric is not a valid template"),
        ({"truth_weight": 1.5}, "less than or equal to 1"),
    ],
)
def test_bad_judge_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        JudgeTrainingConfig(**settings)


@pytest.mark.parametrize("loop", ["sync", "async"])
async def test_a_run_trains_the_policy_and_its_judge_in_one_model(services, tmp_path, loop):
    name = f"judge-{loop}"
    judging = {
        "loop": loop,
        "judge_training": {"samples": 2, "max_new_tokens": 16, "truth_weight": 0.5},
        "dumps": {"rollouts_per_step": 64},
    }
    config = run_config(services, tmp_path, run_name=name, **judging)
    await run_to_end(services["trainer"], config, name)
    run_dir = tmp_path / name
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/loss" in r]
    evals = [r for r in logged if "eval/accuracy" in r]
    assert len(train) == 2 and len(evals) == 3
    for record in train:
        assert 0.0 <= record["judge/agreement"] <= 1.0
        assert record["judge/infra_failed_verdicts"] == 0.0
    for record in evals:
        assert 0.0 <= record["eval/judge_agreement"] <= 1.0
        assert record["eval/judge_infra_failed_verdicts"] == 0.0
    dumped = read_dump(run_dir / "rollouts" / "step_000001.jsonl")
    check_step_dump(dumped, samples=2)
    # The rollout figures are the policy's alone, by the task's scorer.
    policy = [r for r in dumped if r["data_source"] != JUDGE_DATA_SOURCE]
    task_accuracy = sum(r["reward_extras"]["acc"] for r in policy) / len(policy)
    assert train[0]["rollout/accuracy"] == task_accuracy


def check_step_dump(dumped: list[dict], samples: int) -> None:
    """The step trained its policy's trajectories, rewarded half by the judges and half by the
    task, and (when their verdicts differed) their judges' verdicts."""
    policy = [r for r in dumped if r["data_source"] != JUDGE_DATA_SOURCE]
    judges = [r for r in dumped if r["data_source"] == JUDGE_DATA_SOURCE]
    assert len(policy) == 8
    for record in policy:
        extras = record["reward_extras"]
        expected = 0.5 * extras["judge_verdict"] + 0.5 * extras["task_score"]
        assert math.isclose(record["reward"], expected)
    judged = {r["trajectory_id"]: r for r in policy}
    for record in judges:
        policy_record = judged[record["group_id"].removeprefix(JUDGE_PREFIX)]
        question = policy_record["messages"][1]["content"]
        assert question in record["messages"][0]["content"]
        assert record["messages"][1]["role"] == "assistant"
        assert record["reward"] == float(record["reward_extras"]["acc"])
    assert len(judges) <= samples * len(policy)
