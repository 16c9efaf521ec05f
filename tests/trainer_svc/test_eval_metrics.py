"""The held-out evaluation's sampled metrics (trainer_svc/eval_metrics.py): the unbiased
pass@k, mean@n, per prompt and per data source, the `trainer.eval` settings and the Generate
request they make."""

from math import comb

import pytest
from pydantic import ValidationError

from trainer_svc.config import DataConfig, EvalConfig, TrainerConfig
from trainer_svc.controller import Controller
from trainer_svc.data import load_datasets
from trainer_svc.eval_metrics import pass_at_k, sampled_metrics
from trainer_svc.eval_run import EvalRun
from trainer_svc.ranks import Ranks
from turnrl.errors import ConfigError
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2

from .test_data import VERL_ROWS, parquet_and_jsonl


def sample(group_id: str, score: float, source: str = "gsm8k", acc: bool | None = None):
    trajectory = Trajectory(
        trajectory_id=f"{group_id}/{score}",
        group_id=group_id,
        sample_index=0,
        data_source=source,
        reward=common_pb2.Reward(score=score),
    )
    if acc is not None:
        trajectory.reward.extras.update({"acc": acc})
    return trajectory


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 4, 4, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 1 - comb(3, 3) / comb(5, 3)),
        (4, 3, 2, 1.0),  # every 2 of 4 holds a solved one when only one is unsolved
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_mean_and_pass_at_k_overall_and_per_data_source():
    config = EvalConfig(n=4, temperature=0.7, k=[1, 2, 4], success_threshold=1.0)
    trajectories = [
        # prompt a (gsm8k): 1 of 4 solved; prompt b (gsm8k): none; prompt c (math): all.
        *(sample("a", score) for score in (1.0, 0.0, 0.5, 0.0)),
        *(sample("b", 0.0) for _ in range(4)),
        *(sample("c", 1.0, "math") for _ in range(4)),
    ]
    metrics = sampled_metrics(trajectories, config)
    assert metrics["eval/mean@4"] == pytest.approx((0.375 + 0.0 + 1.0) / 3)
    assert metrics["eval/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert metrics["eval/pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["eval/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert metrics["eval/gsm8k/mean@4"] == pytest.approx(0.375 / 2)
    assert metrics["eval/gsm8k/pass@2"] == pytest.approx(0.25)
    assert metrics["eval/math/pass@1"] == 1.0


def test_without_a_threshold_the_scorer_verdict_counts():
    # acc says wrong although the reward is positive (a format bonus), and right once.
    trajectories = [sample("a", 0.1, acc=False), sample("a", 0.1, acc=True)]
    config = EvalConfig(n=2, temperature=1.0, k=[1, 2])
    assert sampled_metrics(trajectories, config)["eval/pass@1"] == 0.5
    threshold = EvalConfig(n=2, temperature=1.0, k=[1], success_threshold=0.5)
    assert sampled_metrics(trajectories, threshold)["eval/pass@1"] == 0.0


def test_a_prompt_short_of_k_samples_has_no_pass_at_k():
    # Prompt b lost two samples to a dead service (the caller left them out).
    trajectories = [sample("a", 1.0), sample("a", 0.0), sample("a", 0.0), sample("b", 0.0)]
    metrics = sampled_metrics(trajectories, EvalConfig(n=3, temperature=1.0, k=[1, 3]))
    assert metrics["eval/pass@3"] == 1.0  # prompt a's only
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 0) / 2)


def test_eval_settings_are_checked():
    assert EvalConfig(n=8, temperature=0.6, k=4).k == [4]
    assert TrainerConfig().eval == EvalConfig(n=1, temperature=0.0, k=[1])
    with pytest.raises(ValidationError, match=r"eval.k=\[1, 8\]: each k must be between 1"):
        EvalConfig(n=4, temperature=0.6, k=[1, 8])
    with pytest.raises(ValidationError, match="greedy samples are all alike"):
        EvalConfig(n=4, k=[1])
    with pytest.raises(ValidationError, match="extra"):
        TrainerConfig.model_validate({"eval": {"samples": 4}})


def test_the_evaluation_asks_for_its_own_samples_and_training_for_its_own(tmp_path):
    config = TrainerConfig.model_validate(
        {
            "rollout": {"samples_per_prompt": 8, "temperature": 1.0, "top_p": 1.0},
            "eval": {"n": 4, "temperature": 0.6, "top_p": 0.95, "k": [1, 4]},
        }
    )
    controller = Controller(config, tmp_path, lambda event: None, Ranks())
    prompts, _ = load_datasets(DataConfig(generated_train_size=1), seed=0)
    evaluation = controller._generate_request(prompts, ["a"], "eval0", training=False)
    training = controller._generate_request(prompts, ["a"], "step0", training=True)
    assert (evaluation.n, training.n) == (4, 8)
    assert evaluation.sampling.temperature == pytest.approx(0.6)
    assert evaluation.sampling.top_p == pytest.approx(0.95)
    assert training.sampling.temperature == 1.0 and training.sampling.top_p == 1.0
    assert evaluation.sampling.seed != training.sampling.seed
    greedy = Controller(TrainerConfig(), tmp_path, lambda event: None, Ranks())
    request = greedy._generate_request(prompts, ["a"], "eval0", training=False)
    assert request.n == 1 and request.sampling.temperature == 0.0


async def test_an_evaluation_run_without_held_out_prompts_is_refused(tmp_path):
    [train, _] = parquet_and_jsonl(tmp_path, "train", VERL_ROWS)
    config = TrainerConfig.model_validate({"mode": "eval", "data": {"train_files": [train]}})
    run = EvalRun(config, tmp_path / "run", lambda event: None, Ranks())
    assert run.total_steps == 0
    with pytest.raises(
        ConfigError, match=r"no held-out prompts: name them in trainer\.data\.eval_files"
    ):
        await run.run(resume=False)
