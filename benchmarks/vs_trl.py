"""turnrl against Hugging Face TRL's GRPOTrainer with tools, on the same model and problems.

One invocation runs both systems on this machine, one after the other, for each task:
  single  the demo's tiny model (`examples/calculator/config.yaml`) on one-operation
          problems: one calculator call, then the answer (two model turns);
  multi   the tests' tiny model (trained on 1-3 operations) on three-operation problems: two
          calculator calls, then the answer (three model turns).
Both systems load the model from its Hugging Face folder and see the same prompts token for
token: the same system and user messages, the same tool schema (the tool service's; TRL is
given it in place of the one transformers would derive from the Python function), the same
chat template. The same settings on both sides: `--prompts` prompts of `--samples` samples a
step, in the same order (no shuffling), at most 256 tokens after the prompt and 4 model turns
(TRL: `max_tool_calling_iterations=3`), temperature 1, GRPO advantages (group std), no KL,
the token-mean loss (TRL's `dapo`) with clip 0.2 / 0.28, two optimizer steps a batch (TRL:
`steps_per_generation=2`), AdamW at a constant 1e-3, gradient norm clipped to 1, fp32, no
activation checkpointing, torch's default threads (one per core), the reward the same GSM8K
scorer (`reward_svc.scorers.gsm8k`).
  turnrl  `turnrl run`: the four services as it starts them, the hf engine with its defaults
          (continuous batching, KV reuse across a trajectory's turns), the sync loop;
  trl     GRPOTrainer(tools=[calculator]) with transformers' generate, the calculator a Python
          function doing the tool service's arithmetic.

Per system and task: seconds per step (median and range over the steps after `--warmup`),
generated tokens/s (the model's tokens over the rollout's seconds), trained tokens/s (prompt
and response tokens over the update's seconds), peak resident memory of all its processes
together, and the mean reward of each step (a PNG beside the JSON).

    .venv/bin/pip install -c constraints.txt -e '.[bench]'
    .venv/bin/python benchmarks/vs_trl.py [--steps 8] [--warmup 2] [--tasks single,multi]  # ~6 min

The last line printed is one JSON object with the headline figures: `ratio_single_call` and
`ratio_multi_call`, turnrl's median seconds per step over TRL's.
"""

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import smoke_mode
import yaml
from child_processes import child

from turnrl.calculator_data import CALCULATOR_TOOL, ProblemSettings, generate_problems
from turnrl.config import REPO_ROOT
from turnrl_demo.settings import TinyModelSettings

EXAMPLE = REPO_ROOT / "examples" / "calculator" / "config.yaml"
DATA_SOURCE = "openai/gsm8k"
MAX_RESPONSE_TOKENS = 256
MAX_TURNS = 4
MINI_BATCHES = 2
LEARNING_RATE = 1e-3
TASKS = {
    "single": {
        "model": yaml.safe_load(EXAMPLE.read_text())["tiny_model"],
        "problems": ProblemSettings(min_operations=1, max_operations=1),
    },
    "multi": {
        "model": {},
        "problems": ProblemSettings(min_operations=3, max_operations=3),
    },
}
RSS_SAMPLE_SECONDS = 0.2


def prompts(task: str, count: int) -> list[dict[str, Any]]:
    """The task's first `count` training problems: chat messages and answer."""
    problems = generate_problems(count, seed=0, split="train", settings=TASKS[task]["problems"])
    return [{"messages": p.prompt_messages, "answer": str(p.answer)} for p in problems]


def model_folder(task: str) -> Path:
    from turnrl_demo.tiny_model import build_tiny_model

    return build_tiny_model(settings=TinyModelSettings.model_validate(TASKS[task]["model"]))


class PeakRss:
    """The largest total resident memory of a process and its descendants, sampled."""

    def __init__(self, pid: int) -> None:
        self.peak_bytes = 0
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_SECONDS):
            total = 0
            try:
                for process in [self._root, *self._root.children(recursive=True)]:
                    total += process.memory_info().rss
            except psutil.Error:  # one exited between listing and reading
                continue
            self.peak_bytes = max(self.peak_bytes, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def run_measured(command: list[str], log: Path) -> int:
    """Runs `command` to its end, its output to `log`; its processes' peak RSS in bytes."""
    with log.open("w") as out, child(command, stdout=out, stderr=subprocess.STDOUT) as process:
        rss = PeakRss(process.pid)
        try:
            code = process.wait()
        finally:
            peak = rss.stop()
    if code != 0:
        raise RuntimeError(f"{command[:4]} failed with exit code {code}; see {log}")
    return peak


def summary(
    step_seconds: list[float],
    rollout_seconds: list[float],
    generated: list[float],
    train_seconds: list[float],
    trained: list[float],
    rewards: list[float],
    warmup: int,
    peak_rss: int,
) -> dict[str, Any]:
    """Figures over the steps after warm-up, and the reward of every step."""
    kept = slice(warmup, None)
    steps = step_seconds[kept]
    return {
        "s_per_step_median": statistics.median(steps),
        "s_per_step_min": min(steps),
        "s_per_step_max": max(steps),
        "rollout_s_median": statistics.median(rollout_seconds[kept]),
        "train_s_median": statistics.median(train_seconds[kept]),
        "generated_tokens_per_s": sum(generated[kept]) / sum(rollout_seconds[kept]),
        "trained_tokens_per_s": sum(trained[kept]) / sum(train_seconds[kept]),
        "generated_tokens_per_step": statistics.mean(generated[kept]),
        "trained_tokens_per_step": statistics.mean(trained[kept]),
        "peak_rss_gib": peak_rss / 2**30,
        "s_per_step": step_seconds,
        "rollout_s_per_step": rollout_seconds,
        "train_s_per_step": train_seconds,
        "reward_per_step": rewards,
    }


# turnrl ---------------------------------------------------------------------------------


def run_turnrl(task: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """`turnrl run` of the task on the same prompts; its figures from the run's metrics."""
    data = folder / "prompts.jsonl"
    rows = [
        {
            "prompt": p["messages"],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": p["answer"]},
            "extra_info": {"index": index},
        }
        for index, p in enumerate(prompts(task, args.steps * args.prompts))
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    project = yaml.safe_load(EXAMPLE.read_text())
    project["tiny_model"] = TASKS[task]["model"]
    project["rollout"].update(
        max_new_tokens=MAX_RESPONSE_TOKENS, max_response_length=MAX_RESPONSE_TOKENS
    )
    for service in ("tool", "reward", "rollout", "trainer"):
        project[service]["server"]["port"] = 0
    trainer = project["trainer"]
    trainer.update(
        run_name=f"vs-trl-{task}",
        output_dir=str(folder / "runs"),
        steps=args.steps,
        eval_every=0,
        checkpoint={"every": 0},
        loggers=[],
    )
    trainer["data"] = {"train_files": [str(data)], "shuffle": False}
    trainer["rollout"].update(
        prompts_per_step=args.prompts, samples_per_prompt=args.samples, max_turns=MAX_TURNS
    )
    trainer["algorithm"].update(mini_batches=MINI_BATCHES, loss_aggregation="token-mean")
    trainer["optim"].update(learning_rate=LEARNING_RATE, lr_schedule="constant")
    config = folder / "turnrl.yaml"
    config.write_text(yaml.safe_dump(project))
    command = [sys.executable, "-m", "turnrl_cli", "run", "--config", str(config), *args.turnrl_set]
    started = time.time()
    peak = run_measured(command, folder / "turnrl.log")
    metrics = folder / "runs" / f"vs-trl-{task}" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    ends = [started] + [r["time"] for r in steps]
    return summary(
        step_seconds=[b - a for a, b in itertools.pairwise(ends)],
        rollout_seconds=[r["time/rollout"] for r in steps],
        generated=[r["rollout/tokens_per_s"] * r["time/rollout"] for r in steps],
        train_seconds=[r["time/train"] for r in steps],
        trained=[r["train/tokens_per_s"] * r["time/train"] for r in steps],
        rewards=[r["rollout/reward_mean"] for r in steps],
        warmup=args.warmup,
        peak_rss=peak,
    )


# TRL ------------------------------------------------------------------------------------


def run_trl(task: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the task, in a process of its own (`trl_child`)."""
    result = folder / "trl.json"
    command = [
        sys.executable, __file__, "--trl-child", task, "--steps", str(args.steps),
        "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--result", str(result),
    ]  # fmt: skip
    peak = run_measured(command, folder / "trl.log")
    timings = json.loads(result.read_text())
    return summary(**timings, warmup=args.warmup, peak_rss=peak)


def trl_child(task: str, args: argparse.Namespace) -> None:
    """Trains with TRL and writes per-step timings, token counts and rewards to --result."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import chat_template_utils
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from reward_svc.scorers.base import ScoringRequest
    from reward_svc.scorers.gsm8k import score
    from tool_svc.tools.calculator import CalculatorTool, format_value

    evaluator = CalculatorTool("calculator", CalculatorTool.Options())

    def calculator(expression: str) -> str:
        """The tool service's calculator (its schema is given to the template below).

        Args:
            expression: The expression to evaluate.
        """
        return format_value(evaluator.evaluate(expression))

    # transformers derives a function's schema from its signature, without the tool service's
    # "additionalProperties": false; the template renders the tool service's schema instead,
    # so the prompts are the same tokens as turnrl's.
    derive_schema = chat_template_utils.get_json_schema
    chat_template_utils.get_json_schema = lambda f: (
        CALCULATOR_TOOL if f is calculator else derive_schema(f)
    )

    def gsm8k_reward(completions: list[list[dict]], answer: list[str], **_: Any) -> list[float]:
        finals = [[m for m in c if m["role"] == "assistant"] for c in completions]
        texts = [turns[-1].get("content") or "" if turns else "" for turns in finals]
        return [
            score(ScoringRequest(DATA_SOURCE, text, ground_truth=truth)).score
            for text, truth in zip(texts, answer, strict=True)
        ]

    folder = model_folder(task)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.response_template = qwen3_template  # our template writes Qwen's tool calls
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = prompts(task, args.steps * args.prompts)
    dataset = Dataset.from_list([{"prompt": p["messages"], "answer": p["answer"]} for p in rows])
    batch = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=batch // MINI_BATCHES,
        steps_per_generation=MINI_BATCHES,
        gradient_accumulation_steps=1,
        num_iterations=1,
        num_generations=args.samples,
        max_steps=args.steps * MINI_BATCHES,
        max_completion_length=MAX_RESPONSE_TOKENS,
        max_tool_calling_iterations=MAX_TURNS - 1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        seed=0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    timings: dict[str, list[float]] = {
        key: [] for key in ("rollout_seconds", "generated", "trained", "rewards")
    }
    step_ends: list[float] = []

    class Timed(GRPOTrainer):
        def _generate(self, prompts_: list) -> Any:
            started = time.monotonic()
            out = super()._generate(prompts_)
            timings["rollout_seconds"].append(time.monotonic() - started)
            prompt_ids, completion_ids, tool_mask = out[0], out[1], out[2]
            timings["generated"].append(sum(map(sum, tool_mask)))
            timings["trained"].append(sum(map(len, prompt_ids)) + sum(map(len, completion_ids)))
            return out

        def _calculate_rewards(self, *args_: Any, **kwargs: Any) -> torch.Tensor:
            rewards = super()._calculate_rewards(*args_, **kwargs)
            timings["rewards"].append(float(rewards.mean()))
            return rewards

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.monotonic())

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            if state.global_step % MINI_BATCHES == 0:
                step_ends.append(time.monotonic())

    trainer = Timed(
        model=model,
        reward_funcs=[gsm8k_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        callbacks=[StepClock()],
    )
    trainer.train()
    step_seconds = [b - a for a, b in itertools.pairwise(step_ends)]
    train_seconds = [s - r for s, r in zip(step_seconds, timings["rollout_seconds"], strict=True)]
    Path(args.result).write_text(
        json.dumps(
            {
                "step_seconds": step_seconds,
                "rollout_seconds": timings["rollout_seconds"],
                "generated": timings["generated"],
                "train_seconds": train_seconds,
                "trained": timings["trained"],
                "rewards": timings["rewards"],
            }
        )
    )


# ----------------------------------------------------------------------------------------


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for axis, (task, systems) in zip(axes[0], results.items(), strict=True):
        for system, figures in systems.items():
            rewards = figures["reward_per_step"]
            axis.plot(range(1, len(rewards) + 1), rewards, marker="o", label=system)
        axis.set(title=f"{task}-call problems", xlabel="step", ylabel="mean reward")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="Steps of each run.")
    parser.add_argument("--warmup", type=int, default=2, help="First steps left out.")
    parser.add_argument("--prompts", type=int, default=16, help="Prompts per step.")
    parser.add_argument("--samples", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--tasks", default="single,multi", help="Comma-separated: single, multi.")
    parser.add_argument("--systems", default="turnrl,trl", help="Comma-separated: turnrl, trl.")
    parser.add_argument(
        "--out", type=Path, default=Path("vs_trl.json"), help="JSON result; the PNG beside it."
    )
    parser.add_argument(
        "--turnrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for turnrl's runs, as `turnrl run` takes it (repeatable).",
    )
    parser.add_argument("--trl-child", choices=sorted(TASKS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    smoke_out = Path(tempfile.gettempdir()) / "vs_trl_smoke.json"
    smoke = {"steps": 2, "warmup": 1, "prompts": 2, "samples": 2, "tasks": "single"}
    args = smoke_mode.parse_args(parser, smoke | {"out": smoke_out})
    if args.trl_child:
        trl_child(args.trl_child, args)
        return
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    if "trl" in args.systems.split(",") and importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: .venv/bin/pip install -c constraints.txt -e '.[bench]'")
    runners = {"turnrl": run_turnrl, "trl": run_trl}
    systems = args.systems.split(",")
    results: dict[str, dict[str, dict]] = {}
    for task in args.tasks.split(","):
        results[task] = {}
        for system in systems:
            with tempfile.TemporaryDirectory(prefix=f"vs-trl-{system}-") as folder:
                print(f"{task}: {system} ...", flush=True)
                figures = runners[system](task, args, Path(folder))
            results[task][system] = figures
            print(f"{task}: {system}: {json.dumps(figures)}", flush=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.out.with_suffix(".png"))
    headline: dict[str, Any] = {}
    for task, figures in results.items():
        if "turnrl" in figures and "trl" in figures:
            ratio = figures["turnrl"]["s_per_step_median"] / figures["trl"]["s_per_step_median"]
            headline[f"ratio_{task}_call"] = round(ratio, 3)
        for system, result in figures.items():
            headline[f"{system}_{task}_s_per_step"] = round(result["s_per_step_median"], 3)
    print(json.dumps(headline))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
