"""The CPU-scale search (Search-R1), code (ReTool) and image (zoom) recipes, each run by `turnrl
run` through the four services for two steps on its shipped tiny model: the search tool over the
committed corpus, the sandboxed python tool or image_zoom on the prompt's image, Search-R1's
exact match, the math or the gsm8k scorer, and the run's summary.json and curves.png with
held-out accuracy and the share of trajectories that call the tool. Whether they learn is
measured in BENCHMARKS.md ("The CPU recipes") and, for zoom, by `make test-learning`."""

import json

import pytest

from turnrl.config import REPO_ROOT

from ..conftest import FREE_PORTS, run_turnrl

TOOL_OF_TASK = {"search": "search", "code": "python", "zoom": "image_zoom"}


@pytest.mark.parametrize("task", sorted(TOOL_OF_TASK))
async def test_the_recipe_runs_through_the_services(task, tmp_path):
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / task / "config.yaml"), *FREE_PORTS,
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={task}", "trainer.steps=2",
        "trainer.eval_every=2", "trainer.checkpoint.every=0", "trainer.rollout.prompts_per_step=4",
        "trainer.rollout.samples_per_prompt=4", "trainer.data.generated_eval_size=16",
        timeout_seconds=420,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    run_dir = tmp_path / task
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert len(steps) == 2 and [r["eval/step"] for r in evals] == [0.0, 2.0]
    # The warm start calls the tool on some of its sampled trajectories (30-60% of them), and
    # every call it writes runs: none comes back as a tool error.
    assert all(r["rollout/tool_call_share"] > 0 for r in steps)
    assert all(r["rollout/tool_errors"] == 0 for r in steps)
    assert summary["initial_eval_tool_call_share"] == evals[0]["eval/tool_call_share"]
    assert summary["final_eval_tool_call_share"] == evals[-1]["eval/tool_call_share"]
    assert 0 <= summary["final_eval_accuracy"] <= 1
    # Every trajectory reached the scorer: none lost to a tool or reward call that failed.
    assert all(r["rollout/infra_failed_trajectories"] == 0 for r in steps)
