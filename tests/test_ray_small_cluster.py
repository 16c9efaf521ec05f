"""`turnrl run --launcher ray` of the demo on a Ray cluster of 2 CPUs, with the default
resources (`launcher.ray`): it fits, runs and learns as it does locally; a launch that cannot
fit fails at once, naming the settings to change."""

import json

import pytest

from tests.conftest import EXAMPLE_CONFIG, run_turnrl
from tests.ray_clusters import ray_cluster as start_ray_cluster
from turnrl.config import REPO_ROOT

NAMESPACE = "turnrl-test-small"
# The demo's first 5 of its 30 steps, its learning rate on the 30 steps' schedule (30 steps x
# 2 mini-batches: trainer.optim.total_steps), for time: README says "after 5 GRPO steps it
# calls the calculator on every one (1.000...)", and the local learning test
# (tests/learning/test_learning.py) allows 0.05 below the figure it states.
STEPS = 5
DEMO_OPTIMIZER_STEPS = 30 * 2
LEARNED_ACCURACY = 0.95


@pytest.fixture(scope="module")
def two_cpu_cluster():
    """One Ray node of 2 CPUs, as on a small machine; yields its address."""
    with start_ray_cluster([["--num-cpus=2"]]) as address:
        yield address


async def test_a_launch_that_cannot_fit_fails_before_placing_anything(two_cpu_cluster):
    code, _, stderr = await run_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), "--launcher", "ray", "--check",
        f"launcher.ray.address={two_cpu_cluster}", f"launcher.ray.namespace={NAMESPACE}",
        "rollout.replicas=4",
        timeout_seconds=90,
    )  # fmt: skip
    assert code != 0
    message = " ".join(stderr.split())  # as the terminal wrapped it, unwrapped
    assert "the Ray cluster has 2 CPU in all, and this launch needs 2.7" in message, stderr
    assert "rollout 4 x 0.5 (launcher.ray.rollout)" in message
    assert "Lower launcher.ray.<service>.num_cpus" in message


async def test_up_with_replicas_fits_two_cpus_with_default_resources(two_cpu_cluster):
    code, stdout, stderr = await run_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), "--launcher", "ray", "--check",
        f"launcher.ray.address={two_cpu_cluster}", f"launcher.ray.namespace={NAMESPACE}",
        "rollout.replicas=2", "tool.replicas=2",
        timeout_seconds=300,
    )  # fmt: skip
    assert code == 0, stderr[-4000:]
    assert "check passed" in stdout


@pytest.mark.timeout(1200)
async def test_the_demo_runs_and_learns_on_two_cpus_with_default_resources(
    two_cpu_cluster, tmp_path
):
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / "calculator" / "config.yaml"),
        "--launcher", "ray", f"launcher.ray.address={two_cpu_cluster}",
        f"launcher.ray.namespace={NAMESPACE}", f"trainer.output_dir={tmp_path}",
        f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}",
        f"trainer.optim.total_steps={DEMO_OPTIMIZER_STEPS}",
        timeout_seconds=1100,
    )  # fmt: skip
    assert code == 0, stderr[-4000:]
    summary = json.loads((tmp_path / "calculator" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["initial_eval_accuracy"] < LEARNED_ACCURACY, summary
    assert summary["final_eval_accuracy"] >= LEARNED_ACCURACY, summary
