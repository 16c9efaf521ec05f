"""What trajectory dumps cost an RL step: the calculator demo's sync loop with dumps off and
with every trajectory of every step dumped (the most `trainer.dumps` can write), in turns.

Starts the four services once (`turnrl up`, as benchmarks/async_vs_sync.py does: the demo's
tiny model on the hf engine, one torch thread a service), then runs `--pairs` pairs of runs
from the same starting model, seed and data. The headline is the dump writer's CPU time over
the step time it ran beside (`time/dumps_writer_cpu`, taken at the next step): the writer is a
thread of the trainer's process and its JSON encoding holds the GIL, so this bounds what the
writing can take from the loop whatever the machine's load. The loop's own cost is the hand-off
(`time/dumps`). The step times of the two kinds of run are printed too; on 2 shared cores they
differ by noise more than by the dumps.

    .venv/bin/python benchmarks/dumps.py [--steps 6] [--pairs 2]  # ~6 min

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import smoke_mode
from async_vs_sync import project_config, run, services


def step_seconds(record: dict) -> float:
    return (
        record["time/rollout"] + record["time/train"] + record["time/dumps"] + record["time/push"]
    )


def figures(records: list[dict]) -> dict[str, float]:
    """Per run: step seconds, the hand-off, and the writer's CPU seconds over the steps it ran
    beside (step k's write is counted at step k + 1, so the last step's is not)."""
    steps = [r for r in records if "train/loss" in r]
    written = sum(r["time/dumps_writer_cpu"] for r in steps[1:])
    beside = sum(step_seconds(r) for r in steps[:-1])
    return {
        "step_s_median": statistics.median(step_seconds(r) for r in steps),
        "handoff_ms_max": max(r["time/dumps"] for r in steps) * 1e3,
        "writer_cpu_s": written,
        "writer_cpu_fraction": written / beside,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps of every run")
    parser.add_argument("--pairs", type=int, default=2, help="runs with dumps and without each")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-prompts", type=int, default=32, help="held-out problems")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    args = smoke_mode.parse_args(
        parser, {"steps": 2, "pairs": 1, "prompts": 2, "samples": 2, "eval_prompts": 2}
    )
    # project_config's options this benchmark does not vary.
    args.task, args.max_batch_size = "demo", 64
    every_trajectory = args.prompts * args.samples
    kinds = {
        "off": {"dumps": {"rollouts_per_step": 0, "enable_eval": False}},
        "on": {"dumps": {"rollouts_per_step": every_trajectory, "enable_eval": True}},
    }
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder:
        project = project_config(args, Path(folder) / "runs", delayed=False)
        async with services(project, Path(folder), args.threads) as rows:
            addresses = {name: row.address for name, row in rows.items()}
            for pair in range(args.pairs):
                for kind, variant in kinds.items():
                    records = await run(addresses, project, f"{kind}{pair}", variant)
                    results[kind].append(figures(records))
                    print(f"{kind}{pair}: {json.dumps(results[kind][-1])}", flush=True)
    on, off = results["on"], results["off"]
    headline = {
        "dumped_per_step": every_trajectory,
        "writer_cpu_fraction_max": round(max(r["writer_cpu_fraction"] for r in on), 5),
        "handoff_ms_max": round(max(r["handoff_ms_max"] for r in on), 3),
        "step_s_median_on": round(statistics.median(r["step_s_median"] for r in on), 3),
        "step_s_median_off": round(statistics.median(r["step_s_median"] for r in off), 3),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    asyncio.run(main())
