"""`make test-learning`: the demo, the two CPU recipes and the two agents written elsewhere
(examples/openai_agent, examples/langgraph_agent), each run by `turnrl run` for its
configured steps through the four services, must end within 0.05 of the held-out accuracy the
README states for it; the demo with LoRA (examples/calculator/lora.yaml) must gain at least
0.3 of held-out accuracy, every step within 1e-5 of the engine's logprobs. Left out of `make
test` (marked `learning`); `.ci/run` runs it after."""

import json

import pytest

from trainer_svc.report import METRICS_FILE
from turnrl.config import REPO_ROOT

from ..conftest import FREE_PORTS, run_turnrl

README = (REPO_ROOT / "README.md").read_text()
# The final held-out accuracy README states for each task, and the words it states it in.
STATED_FINAL_ACCURACY = {
    "calculator": (1.0, "after 5 GRPO steps it calls the calculator on every one\n(1.000"),
    "search": (0.898, "0.000 to\n0.898 for search"),
    "code": (0.945, "held-out accuracy 0.000 to 0.945 for code"),
    "openai_agent": (1.0, "0.000 to 1.000 in 5 steps for the `openai` SDK agent"),
    "langgraph_agent": (1.0, "0.000 to 1.000 in 5 steps for the LangGraph agent"),
}
TOLERANCE = 0.05
# The held-out accuracy examples/calculator/lora.yaml gains at the least (issue 32).
LORA_GAIN = 0.3


@pytest.mark.parametrize("task", sorted(STATED_FINAL_ACCURACY))
def test_readme_states_the_figure_checked_here(task):
    _, words = STATED_FINAL_ACCURACY[task]
    assert " ".join(words.split()) in " ".join(README.split())


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", sorted(STATED_FINAL_ACCURACY))
async def test_the_task_learns_as_readme_says(task, tmp_path):
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / task / "config.yaml"), *FREE_PORTS,
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={task}",
        timeout_seconds=840,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    summary = json.loads((tmp_path / task / "summary.json").read_text())
    stated, _ = STATED_FINAL_ACCURACY[task]
    assert summary["initial_eval_accuracy"] < stated - TOLERANCE, summary
    assert summary["final_eval_accuracy"] >= stated - TOLERANCE, summary
    assert summary["final_eval_tool_call_share"] > 0.9, summary
    assert summary["logprob_mismatch_mean_abs"] < 1e-5, summary


@pytest.mark.learning
@pytest.mark.timeout(900)
async def test_lora_learns_with_adapter_pushes(tmp_path):
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / "calculator" / "lora.yaml"), *FREE_PORTS,
        f"trainer.output_dir={tmp_path}", "trainer.run_name=lora",
        timeout_seconds=840,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    summary = json.loads((tmp_path / "lora" / "summary.json").read_text())
    gain = summary["final_eval_accuracy"] - summary["initial_eval_accuracy"]
    assert gain >= LORA_GAIN, summary
    steps = [json.loads(line) for line in (tmp_path / "lora" / METRICS_FILE).open()]
    mismatches = [
        step["mismatch/mean_abs_diff"] for step in steps if "mismatch/mean_abs_diff" in step
    ]
    assert len(mismatches) == summary["steps"], summary
    assert max(mismatches) < 1e-5, mismatches
    assert (tmp_path / "lora" / "final_model" / "adapter_model.safetensors").is_file()
