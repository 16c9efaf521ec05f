"""Co-training a judge with the policy (`trainer.judge_training`): one model in two roles, or
a judge that is a model of its own (`judge_training.model_path`).

Each step the policy's trajectories come back scored by the task's scorer. The judge then
judges each of them, `samples` times, from the rubric (`judge_records`): a judge's prompt names
the problem and the policy's turns, its ground truth is whether the policy was right by the task
(`accurate`), and the reward service's judge_agreement scorer rewards a verdict that agrees.
The policy's reward becomes the judges' mean verdict, mixed with the task's by `truth_weight`
(`judged_policy`). Each judge group is a GRPO group of its own. One model in two roles trains
the policy's groups and their judges' together, and every push carries both roles; a judge of
its own trains on its groups in an update of its own and is pushed to its own rollout replicas
(trainer_svc/controller.py).

A judge whose call failed (the reward service, an aborted generation) gives no verdict and is
left out; a policy trajectory none of whose judges could run has no reward and is left out of
the step, counted. A judge that wrote no verdict says "no": the model's doing, scored.
"""

import json
import statistics
from dataclasses import dataclass
from typing import Any

from trainer_svc.config import JudgeTrainingConfig, TrainerConfig
from trainer_svc.data import PromptRecord
from trainer_svc.ranks import Models
from trainer_svc.rl_step import RolloutBatch, accurate, infra_failed, rl_update
from turnrl.trajectory import Trajectory

# The reward service's scorer of verdicts (reward_svc/scorers/judge_agreement.py).
JUDGE_DATA_SOURCE = "judge_agreement"
# A judge group's prompt id: this, then the judged trajectory's id.
JUDGE_PREFIX = "judge/"


def judge_records(policy: list[Trajectory], settings: JudgeTrainingConfig) -> list[PromptRecord]:
    """One judge prompt for each of `policy`'s trajectories, in order, named
    JUDGE_PREFIX + its trajectory id."""
    return [
        PromptRecord(
            prompt_id=JUDGE_PREFIX + trajectory.trajectory_id,
            messages=[
                {"role": "user", "content": judge_prompt(trajectory.messages, settings.rubric)}
            ],
            data_source=JUDGE_DATA_SOURCE,
            ground_truth={"correct": accurate(trajectory)},
        )
        for trajectory in policy
    ]


def judge_prompt(messages: list[dict[str, Any]], rubric: str) -> str:
    """The rubric filled from a policy's `messages`: {question}, its first user message's text,
    and {transcript}, the messages after it, one per paragraph."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    transcript = "\n\n".join(_message_text(m) for m in messages[first_user + 1 :])
    return rubric.format(question=_content_text(messages[first_user]), transcript=transcript)


def _message_text(message: dict[str, Any]) -> str:
    lines = [f"{message['role']}: {_content_text(message)}".rstrip()]
    for call in message.get("tool_calls", []):
        function = call["function"]
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        lines.append(f"calls {function['name']}({arguments})")
    return "\n".join(lines)


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


@dataclass
class JudgedStep:
    """The policy's trajectories rewarded by their judges, the judges that ran, and how many
    were left out for the system's failures."""

    policy: list[Trajectory]
    judges: list[Trajectory]
    infra_failed_verdicts: int
    unjudged_policy: int

    def counts(self) -> dict[str, float]:
        """The metrics of what was left out."""
        return {
            "judge/infra_failed_verdicts": float(self.infra_failed_verdicts),
            "judge/unjudged_policy_trajectories": float(self.unjudged_policy),
        }


def judged_policy(
    policy: list[Trajectory], judges: list[Trajectory], settings: JudgeTrainingConfig
) -> JudgedStep:
    """Rewards each of `policy` by its judges' verdicts (`judges`: the trajectories of
    `judge_records(policy)`, any order): (1 - truth_weight) x the mean verdict + truth_weight x
    the task's reward. The task's reward stays in the extras as `task_score`, and its verdict as
    `acc`, so accuracy is still the task's. Leaves out the judges that failed for the system,
    and the policy trajectories none of whose judges ran."""
    ran = judges_by_policy(policy, [j for j in judges if ran_ok(j)])
    rewarded = []
    for trajectory in policy:
        verdicts = [verdict(j) for j in ran[trajectory.trajectory_id]]
        if not verdicts:
            continue
        task_score, judged = trajectory.reward.score, statistics.fmean(verdicts)
        trajectory.reward.extras.update(
            {"acc": accurate(trajectory), "task_score": task_score, "judge_verdict": judged}
        )
        weight = settings.truth_weight
        trajectory.reward.score = (1 - weight) * judged + weight * task_score
        rewarded.append(trajectory)
    return JudgedStep(
        rewarded,
        [j for t in rewarded for j in ran[t.trajectory_id]],
        infra_failed_verdicts=sum(not ran_ok(j) for j in judges),
        unjudged_policy=len(policy) - len(rewarded),
    )


def judges_by_policy(
    policy: list[Trajectory], judges: list[Trajectory]
) -> dict[str, list[Trajectory]]:
    """Each policy trajectory's judges among `judges`, by its trajectory id."""
    judged: dict[str, list[Trajectory]] = {t.trajectory_id: [] for t in policy}
    for judge in judges:
        trajectory_id = judge.group_id.removeprefix(JUDGE_PREFIX)
        if trajectory_id in judged:
            judged[trajectory_id].append(judge)
    return judged


def judge_metrics(policy: list[Trajectory], judges: list[Trajectory]) -> dict[str, float]:
    """How the judges that ran did on `policy`: agreement with the task's scorer, the share
    with no verdict, the share of right verdicts on trajectories the task scored right, and of
    "right" verdicts on ones it scored wrong (the judge fooled)."""
    on_right, on_wrong = [], []
    judged = judges_by_policy(policy, judges)
    for trajectory in policy:
        verdicts = (verdict(j) for j in judged[trajectory.trajectory_id])
        (on_right if accurate(trajectory) else on_wrong).extend(verdicts)
    count = max(len(judges), 1)
    return {
        "agreement": sum(map(accurate, judges)) / count,
        "no_verdict_share": sum(verdict_missing(j) for j in judges) / count,
        "right_share_on_right": statistics.fmean(on_right or [0.0]),
        "fooled_share": statistics.fmean(on_wrong or [0.0]),
    }


def is_judge(trajectory: Trajectory) -> bool:
    """Whether `trajectory` is a judge's verdict rather than the policy's."""
    return trajectory.group_id.startswith(JUDGE_PREFIX)


def ran_ok(judge: Trajectory) -> bool:
    """Whether a judge's verdict was read and scored: a reward no system failure set."""
    return judge.reward is not None and not infra_failed(judge)


def verdict(judge: Trajectory) -> float:
    """A judge's verdict, 1.0 (right) or 0.0 (wrong, or none written)."""
    extras = judge.reward.extras.fields
    return extras["verdict"].number_value if "verdict" in extras else 0.0


def verdict_missing(judge: Trajectory) -> bool:
    return "verdict" not in judge.reward.extras.fields


def judge_update(
    models: Models,
    rollouts: RolloutBatch,
    config: TrainerConfig,
    step: int,
    mini_batch_rows: list[list[int]],
) -> dict[str, float]:
    """One step's update of a co-trained judge of its own (`models.judge`) on its verdicts,
    as `rl_update` trains the policy, without a KL term (the judge has no reference model);
    its metrics under judge_train/ (train/loss is judge_train/loss)."""
    algorithm = config.algorithm.model_copy(update={"kl_coef": 0.0})
    settings = config.model_copy(update={"algorithm": algorithm})
    judge = Models(policy=models.trained("judge"))
    metrics = rl_update(judge, rollouts, settings, step, mini_batch_rows)
    return {f"judge_{name}": value for name, value in metrics.items()}
