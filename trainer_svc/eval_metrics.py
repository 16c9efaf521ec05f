"""What a held-out evaluation measures of its trajectories (`trainer.eval`): mean@n, the mean
reward of a prompt's samples, and pass@k, the chance that k of them drawn at random hold a
solved one (Chen et al. 2021, "Evaluating Large Language Models Trained on Code": the unbiased
estimator 1 - C(n-c, k) / C(n, k) of a prompt's n samples, c of them solved), averaged over the
prompts, overall and per data source."""

from math import comb

from trainer_svc.config import EvalConfig
from trainer_svc.rl_step import accurate
from turnrl.trajectory import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `n` samples, `c` of them solved (k <= n)."""
    assert 0 <= c <= n and 0 < k <= n, (n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def solved(trajectory: Trajectory, config: EvalConfig) -> bool:
    """Whether a sample counts as solved for pass@k: its reward reaches
    `success_threshold`, or, without one, the scorer's verdict (`accurate`)."""
    if config.success_threshold is None:
        return accurate(trajectory)
    return trajectory.reward.score >= config.success_threshold


def sampled_metrics(trajectories: list[Trajectory], config: EvalConfig) -> dict[str, float]:
    """eval/mean@n and eval/pass@k (each k of `config.k`), and eval/<data_source>/mean@n and
    eval/<data_source>/pass@k, of usable trajectories (the caller leaves the infra-failed
    out: they count for no prompt). A prompt with fewer than k usable samples left has no
    pass@k; the figure averages the others'."""
    metrics = _of_prompts(trajectories, config, "eval")
    for source in sorted({t.data_source for t in trajectories}):
        of_source = [t for t in trajectories if t.data_source == source]
        metrics |= _of_prompts(of_source, config, f"eval/{source}")
    return metrics


def _of_prompts(
    trajectories: list[Trajectory], config: EvalConfig, prefix: str
) -> dict[str, float]:
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    means = [sum(t.reward.score for t in group) / len(group) for group in groups.values()]
    metrics = {f"{prefix}/mean@{config.n}": sum(means) / len(means)}
    for k in config.k:
        estimates = [
            pass_at_k(len(group), sum(solved(t, config) for t in group), k)
            for group in groups.values()
            if len(group) >= k
        ]
        if estimates:
            metrics[f"{prefix}/pass@{k}"] = sum(estimates) / len(estimates)
    return metrics
