"""Co-training a judge (trainer_svc/judge_training.py): the judges' prompts, the policy's
rewards from their verdicts, what is left out, and the figures; then runs through the real
services, in the sync and the async loop, in which the policy's model judges its own
trajectories and both roles train."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import serve_subprocess
from tests.trainer_svc.runs import read_dump, run_config, run_to_end
from tests.trainer_svc.test_rl_step import TWO_TURNS, trajectory
from tests.trainer_svc.test_rollout_router import rollout_settings
from trainer_svc.checkpoint import find_checkpoint, read_checkpoint_state
from trainer_svc.config import JudgeTrainingConfig
from trainer_svc.judge_training import (
    JUDGE_DATA_SOURCE,
    JUDGE_PREFIX,
    judge_metrics,
    judge_prompt,
    judge_records,
    judged_policy,
)
from turnrl import rpc
from turnrl.config import REPO_ROOT, ClientConfig
from turnrl.messages import openai_tool_call
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from turnrl_cli.project_config import load_project_config
from turnrl_demo.tiny_model import build_tiny_model

JUDGE_EXAMPLE = REPO_ROOT / "examples" / "calculator" / "judge.yaml"
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
        ({"model_path": "judge"}, "model_path and judge_training.rollout_service go together"),
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


async def test_a_judge_of_its_own_trains_and_is_pushed_apart_from_the_policy(
    tiny_model_dir, tmp_path
):
    # The policy is the tests' tiny model, the judge examples/calculator/judge.yaml's (which
    # learned the judge's role: its verdicts differ, so its groups teach), each served by a
    # rollout service of its own; the judge trains on its verdicts only.
    name = "own-judge"
    judge_dir = build_tiny_model(settings=load_project_config(JUDGE_EXAMPLE).tiny_model)
    async with (
        rollout_settings(tiny_model_dir) as settings,
        serve_subprocess("rollout", *settings) as policy_rollout,
        serve_subprocess("rollout", *settings, f"rollout.model_path={judge_dir}") as judge_rollout,
        serve_subprocess(
            "trainer", f"trainer.model_path={tiny_model_dir}", f"trainer.runs_root={tmp_path}"
        ) as trainer,
    ):
        judging = {
            "model_path": str(judge_dir),
            "rollout_service": {"address": judge_rollout.address},
            "samples": 4,
            "max_new_tokens": 16,
            "truth_weight": 0.5,
        }
        config = run_config(
            {"rollout": policy_rollout.address}, tmp_path, run_name=name, loggers=[],
            judge_training=judging, dumps={"rollouts_per_step": 64},
        )  # fmt: skip
        await run_to_end(trainer.address, config, name)
        policy_stats, judge_stats = [
            await rollout_stats(served.address) for served in (policy_rollout, judge_rollout)
        ]
    run_dir = tmp_path / name
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/loss" in r]
    assert len(train) == 2
    for record in train:
        assert math.isfinite(record["judge_train/loss"])
        assert record["judge_mismatch/mean_abs_diff"] < 1e-5  # the judge's replica's logprobs
        assert 0.0 <= record["judge/agreement"] <= 1.0
    # The policy's step trained its trajectories alone; the verdicts came from the judge's
    # replica, which took the judge's pushes: the start's and one a step.
    dumped = read_dump(run_dir / "rollouts" / "step_000001.jsonl")
    assert dumped and JUDGE_DATA_SOURCE not in {r["data_source"] for r in dumped}
    assert judge_stats.policy_version == policy_stats.policy_version == 3
    assert judge_stats.finished_trajectories > policy_stats.finished_trajectories
    state = read_checkpoint_state(find_checkpoint(run_dir))
    assert state["step"] == 2 and "judge" in state
    exported = run_dir / "final_model"
    weights = {
        label: torch.cat([p.detach().flatten() for p in model.parameters()])
        for label, model in (
            ("start", AutoModelForCausalLM.from_pretrained(judge_dir)),
            ("policy", AutoModelForCausalLM.from_pretrained(exported)),
            ("judge", AutoModelForCausalLM.from_pretrained(exported / "judge")),
        )
    }
    assert not torch.equal(weights["judge"], weights["start"])  # it trained
    assert weights["judge"].shape != weights["policy"].shape  # a model of its own


async def rollout_stats(address: str) -> rollout_pb2.GetStatsResponse:
    async with rpc.open_channel(ClientConfig(address=address)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
