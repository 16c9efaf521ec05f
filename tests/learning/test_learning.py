"""`make test-learning`: the demo, the three CPU recipes and the two agents written elsewhere
(examples/openai_agent, examples/langgraph_agent), each run by `turnrl run` for its
configured steps through the four services, must end within 0.05 of the held-out accuracy the
README states for it; the demo with LoRA (examples/calculator/lora.yaml) must gain at least
0.3 of held-out accuracy, every step within 1e-5 of the engine's logprobs; the demo with a
co-trained judge (examples/calculator/judge.yaml) must end within 0.05 of the held-out
accuracy README states, by the task's answers, while its judge agrees with them more; turn-level
credit on the chained calculator task (benchmarks/turn_credit.py) must make the chain its warm
start rarely shows the rule on the held-out problems. Left out of `make test` (marked
`learning`); `.ci/run` runs it after."""

import json
import subprocess
import sys

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
    # examples/zoom (issue 35): a tiny vision-language model learns to zoom in on an image.
    "zoom": (1.0, "held-out accuracy 0.109 to 1.000 in 15 steps"),
    "openai_agent": (1.0, "0.000 to 1.000 in 5 steps for the `openai` SDK agent"),
    "langgraph_agent": (1.0, "0.000 to 1.000 in 5 steps for the LangGraph agent"),
}
TOLERANCE = 0.05
# The held-out accuracy examples/calculator/lora.yaml gains at the least (issue 32).
LORA_GAIN = 0.3
# examples/calculator/judge.yaml (issue 34): the final held-out accuracy README states, the
# words it states it and the judge's sampled agreement in, and the least the agreement rises.
JUDGED_FINAL_ACCURACY = 0.930
JUDGED_WORDS = "held-out accuracy 0.000 to 0.930 in 10 steps, rewarded by its judge alone"
JUDGE_AGREEMENT_WORDS = "agreement with the task's answers 0.771 to 0.877"
JUDGE_AGREEMENT_GAIN = 0.05
# benchmarks/turn_credit.py (issue 34): the steps of turn-level credit after which at least
# CHAINED_SHARE of the held-out problems get two or more calls (from none), and README's words.
TURN_CREDIT_STEPS = 24
CHAINED_SHARE = 0.9
TURN_CREDIT_WORDS = "held-out multi-call rate 0.000 to 1.000 in 16 steps"


@pytest.mark.parametrize("task", sorted(STATED_FINAL_ACCURACY))
def test_readme_states_the_figure_checked_here(task):
    _, words = STATED_FINAL_ACCURACY[task]
    assert " ".join(words.split()) in " ".join(README.split())


def test_readme_states_the_judged_and_turn_credit_figures_checked_here():
    for words in (JUDGED_WORDS, JUDGE_AGREEMENT_WORDS, TURN_CREDIT_WORDS):
        assert words in " ".join(README.split())


async def run_example(config: str, tmp_path, name: str) -> tuple[dict, list[dict]]:
    """`turnrl run` of examples/`config` named `name` to its end: its summary.json, and its
    metrics.jsonl's records."""
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / config), *FREE_PORTS,
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}",
        timeout_seconds=840,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    return summary, [json.loads(line) for line in (tmp_path / name / METRICS_FILE).open()]


def check_learned(summary: dict, stated: float) -> None:
    """The run ended within TOLERANCE of the held-out accuracy `stated`, from below it, the
    tool called on nearly every held-out problem, the trainer's logprobs the engine's."""
    assert summary["initial_eval_accuracy"] < stated - TOLERANCE, summary
    assert summary["final_eval_accuracy"] >= stated - TOLERANCE, summary
    assert summary["final_eval_tool_call_share"] > 0.9, summary
    assert summary["logprob_mismatch_mean_abs"] < 1e-5, summary


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", sorted(STATED_FINAL_ACCURACY))
async def test_the_task_learns_as_readme_says(task, tmp_path):
    summary, _ = await run_example(f"{task}/config.yaml", tmp_path, task)
    check_learned(summary, STATED_FINAL_ACCURACY[task][0])


@pytest.mark.learning
@pytest.mark.timeout(900)
async def test_lora_learns_with_adapter_pushes(tmp_path):
    summary, steps = await run_example("calculator/lora.yaml", tmp_path, "lora")
    gain = summary["final_eval_accuracy"] - summary["initial_eval_accuracy"]
    assert gain >= LORA_GAIN, summary
    mismatches = [
        step["mismatch/mean_abs_diff"] for step in steps if "mismatch/mean_abs_diff" in step
    ]
    assert len(mismatches) == summary["steps"], summary
    assert max(mismatches) < 1e-5, mismatches
    assert (tmp_path / "lora" / "final_model" / "adapter_model.safetensors").is_file()


@pytest.mark.learning
@pytest.mark.timeout(900)
async def test_a_policy_rewarded_by_its_co_trained_judge_learns_and_the_judge_agrees_more(tmp_path):
    summary, steps = await run_example("calculator/judge.yaml", tmp_path, "judge")
    # By the task's answers, not the judge's verdicts: a policy that fooled its judge fails here.
    check_learned(summary, JUDGED_FINAL_ACCURACY)
    judged = [step for step in steps if "judge/agreement" in step]
    assert len(judged) == summary["steps"], summary
    first, last = judged[0], judged[-1]
    assert last["judge/agreement"] >= first["judge/agreement"] + JUDGE_AGREEMENT_GAIN, judged
    assert all(step["judge/infra_failed_verdicts"] == 0 for step in judged), judged


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_turn_level_credit_makes_the_chain_the_warm_start_rarely_shows_the_rule(tmp_path):
    command = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "turn_credit.py"), "--variants", "turn",
        "--steps", str(TURN_CREDIT_STEPS), "--eval-every", str(TURN_CREDIT_STEPS),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["multi_call_rate_start_turn"] <= 0.05, headline
    assert headline["multi_call_rate_end_turn"] >= CHAINED_SHARE, headline
    assert headline["chain_share_end_turn"] > headline["chain_share_start_turn"], headline
