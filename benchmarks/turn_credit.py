"""Turn-level credit against outcome-only credit, on a task where RL must make the rule a
behaviour the warm start rarely shows: chaining calculator calls.

The task: word problems of 2-3 operations on a running count (`turnrl.calculator_data`,
`one_call_per_operation`), scored by the reward service's `calc_chain` scorer
(`reward_svc/scorers/calc_chain.py`): the outcome is the final `#### N`; each turn whose
calculator result is the chain's next value earns 1/steps. The calculator takes one operation
a call (`max_operations: 1`), so a chain cannot be folded into one expression such as
`(12 + 7) * 3`: a solution needs a call per operation, each on the previous result.

The task's config is examples/calculator/turn_credit.yaml (the demo's services and batch). Its
warm start is the demo's tiny model (4 layers) fine-tuned on the chained problems, nine
conversations in ten cut short after their first call and answering that call's result
(`calls_shown: 1`, `calls_shown_share: 0.9`): it starts every chain right, and goes on with
it in one conversation in ten. The first call's turn earns a turn reward on every problem, the
outcome only where the chain was followed to its end. `--warm-start tests` starts from the
tests' tiny model instead, which has seen two-call conversations whose first call folds all
operations but the last (which this calculator refuses for three).

Starts the four services once (`turnrl up`, the hf engine, one torch thread a service as in
async_vs_sync.py), then runs on the trainer service, one after another, from the same warm
start, seed and prompts:
  outcome   GRPO on the outcome alone: the turn rewards are computed and ignored
  turn      turn-level GRPO (`turn_grpo`): the turn rewards added to the reward, a group
            baseline per turn index, each turn's tokens credited with its own return
  summed    (with --variants) GRPO on outcome + the turn rewards summed into one reward: the
            same signal without turn-level credit
Every `--eval-every` steps each run evaluates the held-out split (greedy, problems no run
trains on). Reported per run: held-out accuracy per evaluation, the steps to reach
`--target` accuracy (null if never), the multi-call rate (share of trajectories with >= 2
calculator calls) of the held-out generations and of each step's training samples, and the
mean share of the chain reached.

    .venv/bin/python benchmarks/turn_credit.py [--steps 16] [--prompts 8] [--samples 8]  # ~4 min

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import smoke_mode
from async_vs_sync import run, services

from reward_svc.scorers.calc_chain import DATA_SOURCES
from turnrl.calculator_data import CalculatorProblem, ProblemSettings, generate_problems
from turnrl.config import REPO_ROOT, load_config_data

EXAMPLE = REPO_ROOT / "examples" / "calculator" / "turn_credit.yaml"

CHAINED = ProblemSettings(min_operations=2, max_operations=3, one_call_per_operation=True)
# Trainer overrides of each way to assign credit.
VARIANTS = {
    "outcome": {"algorithm": {"advantage_estimator": "grpo", "enable_turn_rewards": False}},
    "turn": {"algorithm": {"advantage_estimator": "turn_grpo", "enable_turn_rewards": True}},
    "summed": {"algorithm": {"advantage_estimator": "grpo", "enable_turn_rewards": True}},
}


def prompt_record(problem: CalculatorProblem, index: int) -> dict[str, Any]:
    """A verl RL record of a chained problem, graded by calc_chain."""
    return {
        "prompt": problem.prompt_messages,
        "data_source": DATA_SOURCES[0],
        "reward_model": {"ground_truth": {"answer": problem.answer, "chain": problem.call_results}},
        "extra_info": {"index": index},
    }


def write_prompts(path: Path, count: int, split: str) -> Path:
    problems = generate_problems(count, seed=0, split=split, settings=CHAINED)
    path.write_text("".join(json.dumps(prompt_record(p, i)) + "\n" for i, p in enumerate(problems)))
    return path


def project_config(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The task's config with its prompts, this benchmark's batch, run length and evaluations,
    every training sample dumped."""
    project, _ = load_config_data(EXAMPLE, [])
    if args.warm_start == "tests":
        project["tiny_model"] = {}  # TinyModelSettings' defaults: the tests' model
    trainer = project["trainer"]
    trainer.update(
        seed=args.seed,
        steps=args.steps,
        eval_every=args.eval_every,
        checkpoint={"every": 0},
        output_dir=str(folder / "runs"),
        loggers=[],
    )
    trainer["data"] = {
        "train_files": [str(write_prompts(folder / "train.jsonl", args.train_prompts, "train"))],
        "eval_files": [str(write_prompts(folder / "test.jsonl", args.eval_prompts, "test"))],
    }
    trainer["rollout"].update(prompts_per_step=args.prompts, samples_per_prompt=args.samples)
    trainer["dumps"] = {"rollouts_per_step": args.prompts * args.samples}
    return project


def calls(line: dict[str, Any]) -> int:
    """Well-formed tool calls of a dumped trajectory (a malformed one is no call)."""
    return sum(len(m.get("tool_calls") or []) for m in line["messages"] if m["role"] == "assistant")


def multi_call_share(lines: list[dict[str, Any]]) -> float:
    return sum(calls(line) >= 2 for line in lines) / max(len(lines), 1)


def chain_share(lines: list[dict[str, Any]]) -> float:
    """Mean share of the chain's values each trajectory's calls reached."""
    shares = [
        line["reward_extras"].get("chain_steps_reached", 0)
        / line["reward_extras"].get("chain_steps", 1)
        for line in lines
    ]
    return statistics.mean(shares) if shares else 0.0


def dumped(run_dir: Path, folder: str) -> dict[int, list[dict[str, Any]]]:
    """The dump lines of each step in the run's `folder` (eval or rollouts)."""
    return {
        int(path.stem.removeprefix("step_")): [json.loads(line) for line in path.open()]
        for path in sorted((run_dir / folder).glob("step_*.jsonl"))
    }


def figures(records: list[dict], run_dir: Path, target: float) -> dict[str, Any]:
    evals = dumped(run_dir, "eval")
    rollouts = dumped(run_dir, "rollouts")
    accuracy = {r["eval/step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    reached = [step for step, value in accuracy.items() if value >= target]
    steps = [r for r in records if "train/loss" in r]
    return {
        "eval_steps": [int(step) for step in accuracy],
        "eval_accuracy": [round(value, 3) for value in accuracy.values()],
        "eval_multi_call_rate": [round(multi_call_share(lines), 3) for lines in evals.values()],
        "eval_chain_share": [round(chain_share(lines), 3) for lines in evals.values()],
        "train_reward_mean": [round(r["rollout/reward_mean"], 3) for r in steps],
        "train_accuracy": [round(r["rollout/accuracy"], 3) for r in steps],
        "train_turn_reward_mean": [round(r["rollout/turn_reward_mean"], 3) for r in steps],
        "train_multi_call_rate": [round(multi_call_share(lines), 3) for lines in rollouts.values()],
        "steps_to_target": int(reached[0]) if reached else None,
        "accuracy_start": round(accuracy[min(accuracy)], 3),
        "accuracy_end": round(accuracy[max(accuracy)], 3),
        "wall_s": round(steps[-1]["time"] - records[0]["time"], 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="training steps of every run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between evaluations")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out problems")
    parser.add_argument("--train-prompts", type=int, default=512, help="training problems")
    parser.add_argument(
        "--target", type=float, default=0.25, help="held-out accuracy steps_to_target counts to"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the runs' trainer.seed: data order and sampling"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per service (async_vs_sync.py)"
    )
    parser.add_argument(
        "--warm-start",
        choices=["task", "tests"],
        default="task",
        help="task: the task's warm start, which mostly stops after the chain's first call; "
        "tests: the tests' tiny model, fine-tuned on 1-3 operation problems with up to two "
        "calls, the first folding all operations but the last",
    )
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=["outcome", "turn"]
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="write the runs (metrics, dumps) and services' log here; "
        "default: a temporary folder, removed at the end",
    )
    smoke = {"steps": 1, "prompts": 2, "samples": 2, "eval_prompts": 2, "eval_every": 1}
    args = smoke_mode.parse_args(parser, smoke)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.keep or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        project = project_config(args, folder)
        async with services(project, folder, args.threads) as rows:
            addresses = {name: row.address for name, row in rows.items()}
            for name in args.variants:
                records = await run(addresses, project, name, VARIANTS[name])
                results[name] = figures(records, folder / "runs" / name, args.target)
                print(f"{name}: {json.dumps(results[name])}", flush=True)
    headline: dict[str, Any] = {"target_accuracy": args.target}
    for name, result in results.items():
        for key in ("accuracy_start", "accuracy_end", "steps_to_target"):
            headline[f"{key}_{name}"] = result[key]
        for key in ("eval_multi_call_rate", "eval_chain_share"):
            figure = key.removeprefix("eval_")
            headline[f"{figure}_start_{name}"] = result[key][0]
            headline[f"{figure}_end_{name}"] = result[key][-1]
        headline[f"train_multi_call_rate_last_{name}"] = result["train_multi_call_rate"][-1]
    print(json.dumps(headline))


if __name__ == "__main__":
    asyncio.run(main())
