"""The async trainer loop against the sync one, on the calculator task with slow tools.

Starts the four services once (`turnrl up`: the demo's tiny calculator model on the hf engine,
64 requests a decode step, one torch thread a service (`--threads`, given to the services as
OMP_NUM_THREADS) so that the engine and the trainer can each keep one of two cores), the
calculator behind the rollout benchmark's heavy-tailed wait (lognormal, median 50 ms, p99 1 s,
drawn per call), then runs on the trainer service, one after another and from the same
starting model, seed and data:
  sync                trainer.loop sync
  async_eta1          loop async, max_staleness 1, decoupled PPO with token-level TIS (cap 2)
  async_eta4          max_staleness 4, the same correction
  async_eta4_none     max_staleness 4, importance_sampling none: the AReaL ablation
  async_eta4_overlap  async_eta4 with generate_while_training
In the async runs but the last the engine pauses while the trainer trains: on two shared cores
running both at once is slower than running them in turn, so only tool waits (and scoring)
overlap training; the last run measures what generating meanwhile costs here.
Every run trains the same number of samples (steps x prompts x samples per prompt) and ends
with the held-out accuracy (greedy, `--eval-prompts` problems the runs never train on).

Wall time is measured from the end of the starting policy's evaluation (both loops start
generating there) to the last step's push. The ideal bound: on 2 shared cores, compute cannot
overlap compute, only tool waits, so the most any schedule can do is hide every tool wait. The
bound is the sync loop's wall time on the same work with the calculator answering at once (a
run of its own, on services started without the wait); efficiency is that over the async η=4
wall time, and can pass 1 where the async loop also batches generation better (a step's
stragglers decode beside the next step's rollouts). The push stall is the rollout service's
Pause-to-Resume time of each push in async_eta4_overlap (where a push pauses generation;
elsewhere the engine is paused for the whole update already), against a raw gloo broadcast of the
same bytes between two processes.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 10] [--prompts 8] [--samples 8]  # ~7 min

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import smoke_mode
import yaml
from child_processes import async_child, child
from rollout_async_vs_batch import (
    MODEL_SETTINGS,
    PROBLEMS,
    SlowCalculatorOptions,
    tool_wait_seconds,
)
from transformers import AutoModelForCausalLM
from weight_push import broadcast_and_barrier, raw_group

from tool_svc.tools.base import ToolResult
from tool_svc.tools.calculator import CalculatorTool
from turnrl import rpc
from turnrl.config import REPO_ROOT, ClientConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc
from turnrl_cli.up_table import UP_READY_LINE, UpRow, up_row
from turnrl_demo.settings import TinyModelSettings
from turnrl_demo.tiny_model import build_tiny_model

EXAMPLE = REPO_ROOT / "examples" / "calculator" / "config.yaml"


def async_variant(
    max_staleness: int, correction: str = "truncate", generate_while_training: bool = False
) -> dict[str, Any]:
    """The trainer overrides of an async run."""
    return {
        "loop": "async",
        "async_loop": {
            "max_staleness": max_staleness,
            "generate_while_training": generate_while_training,
        },
        "algorithm": {"importance_sampling": correction},
    }


# On 2 shared cores the engine pauses while the trainer trains (only tool waits overlap
# training), except in async_eta4_overlap, which shows what generating meanwhile costs here.
VARIANTS = {
    "sync": {"loop": "sync"},
    "async_eta1": async_variant(1),
    "async_eta4": async_variant(4),
    "async_eta4_none": async_variant(4, correction="none"),
    "async_eta4_overlap": async_variant(4, generate_while_training=True),
}
RAW_BROADCASTS = 9
# `turnrl up` stops its four services one after another, each within its shutdown grace.
UP_STOP_SECONDS = 120.0


class DelayedCalculator(CalculatorTool):
    """The calculator behind the rollout benchmark's heavy-tailed wait, one draw per call in
    the order calls arrive (the trainer's prompts open no tool session)."""

    Options = SlowCalculatorOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls = itertools.count()

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(tool_wait_seconds(self.options, "call", next(self._calls)))
        return await super().execute(session, args)


def project_config(args: argparse.Namespace, output_dir: Path, delayed: bool) -> dict[str, Any]:
    """The demo's config with this benchmark's batch and run length, and the calculator
    behind its wait or, not `delayed`, answering at once."""
    project = yaml.safe_load(EXAMPLE.read_text())
    if args.task == "multi":  # the rollout benchmark's model and problems: a call per operation
        project["tiny_model"] = {"problems": MODEL_SETTINGS.problems.model_dump()}
        problems = PROBLEMS.model_dump()
        project["trainer"]["data"]["generated_problems"] = problems
        project["rollout"].update(max_new_tokens=64, max_response_length=1536, max_model_len=2048)
        project["trainer"]["rollout"]["max_turns"] = 8
    project["rollout"]["engine_options"] = {"max_batch_size": args.max_batch_size}
    if delayed:
        project["tool"]["tools"] = [{"class_name": f"{Path(__file__).stem}:DelayedCalculator"}]
    trainer = project["trainer"]
    trainer.update(
        steps=args.steps,
        eval_every=0,
        checkpoint={"every": 0},
        output_dir=str(output_dir),
        loggers=[],
    )
    trainer["data"]["generated_eval_size"] = args.eval_prompts
    trainer["rollout"].update(prompts_per_step=args.prompts, samples_per_prompt=args.samples)
    return project


@contextlib.asynccontextmanager
async def services(project: dict[str, Any], folder: Path, threads: int):
    """`turnrl up` on free ports with `project` (`threads` torch threads a service, 0 for
    torch's default); yields each service's row of its table. Stops them however it ends."""
    config = folder / "services.yaml"
    config.write_text(yaml.safe_dump(project))
    ports = [f"{name}.server.port=0" for name in ("tool", "reward", "rollout", "trainer")]
    # The tool service imports the delayed calculator from this folder.
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}",
    }
    if threads:  # the services inherit up's environment; torch sizes its thread pool from it
        env["OMP_NUM_THREADS"] = str(threads)
    with (folder / "services.log").open("w") as log:
        up = [sys.executable, "-m", "turnrl_cli", "up", "--config", str(config), *ports]
        # SIGINT: up stops its services in order; die_with_parent takes them down with up.
        async with async_child(
            *up, stop_signal=signal.SIGINT, grace_seconds=UP_STOP_SECONDS,
            stdout=subprocess.PIPE, stderr=log, env=env,
        ) as process:  # fmt: skip
            rows: dict[str, UpRow] = {}
            async for line in process.stdout:
                if row := up_row(line.decode()):
                    rows[row.name] = row
                if UP_READY_LINE in line.decode():
                    break
            if len(rows) != 4:
                raise RuntimeError(f"turnrl up listed {sorted(rows)}; see {log.name}")
            yield rows


async def run(addresses: dict[str, str], project: dict[str, Any], name: str, variant: dict):
    """Runs one variant to its end on the trainer service; its metrics.jsonl records."""
    config = json.loads(json.dumps(project))
    trainer = config["trainer"]
    trainer.update(run_name=name, rollout_service={"address": addresses["rollout"]})
    for key, value in variant.items():
        trainer[key] = {**trainer.get(key, {}), **value} if isinstance(value, dict) else value
    async with rpc.open_channel(ClientConfig(address=addresses["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        request = trainer_pb2.StartRunRequest(config_yaml=yaml.safe_dump(config))
        started = await stub.StartRun(request, timeout=120)
        progress = stub.StreamProgress(trainer_pb2.StreamProgressRequest(run_name=name))
        async for event in progress:
            if event.stage in ("train", "eval"):
                print(f"  {name} step {event.step} {event.stage}", flush=True)
        finished = await stub.GetRun(trainer_pb2.GetRunRequest(run_name=name), timeout=30)
    if finished.run.state != trainer_pb2.Run.STATE_SUCCEEDED:
        raise RuntimeError(f"{name}: {finished.run.error_message}")
    lines = (Path(started.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def figures(records: list[dict], samples_per_step: int) -> dict[str, float]:
    """Wall time from the end of the first evaluation to the last push, samples/s, accuracy."""
    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "train/loss" in r]
    wall = steps[-1]["time"] - evals[0]["time"]
    return {
        "wall_s": round(wall, 2),
        "samples_per_s": round(len(steps) * samples_per_step / wall, 3),
        "step_s_median": round(
            statistics.median(r["time/train"] + r["time/push"] + r["time/rollout"] for r in steps),
            3,
        ),
        "wait_for_batch_s_total": round(sum(r["time/rollout"] for r in steps), 2),
        "train_s_total": round(sum(r["time/train"] for r in steps), 2),
        "push_s_total": round(sum(r["time/push"] for r in steps), 2),
        **{
            f"engine_{name}": round(steps[-1][f"engine/{name}"] - steps[0][f"engine/{name}"], 2)
            for name in ("busy_seconds", "prefill_tokens", "tokens_generated", "prefill_forwards")
        },
        "accuracy_start": evals[0]["eval/accuracy"],
        "accuracy_end": evals[-1]["eval/accuracy"],
        "train_reward_last": steps[-1]["rollout/reward_mean"],
        "staleness_mean": round(statistics.mean(r.get("staleness/mean", 0.0) for r in steps), 3),
        "regenerated_stale_groups": sum(r.get("async/regenerated_stale_groups", 0) for r in steps),
        "is_weight_max": round(max(r["is/weight_max"] for r in steps), 3),
        "is_capped_fraction_mean": round(
            statistics.mean(r["is/capped_fraction"] for r in steps), 4
        ),
    }


def raw_broadcast_seconds(size_bytes: int) -> float:
    """Median of `RAW_BROADCASTS` gloo broadcasts of `size_bytes` to a second process."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    receiver = [
        sys.executable, str(Path(__file__).parent / "weight_push.py"),
        "--raw-receiver", f"{size_bytes},{RAW_BROADCASTS},{port}",
    ]  # fmt: skip
    with child(receiver) as process:
        group, buffer = raw_group(size_bytes, 0, port)
        seconds = [broadcast_and_barrier(group, buffer) for _ in range(RAW_BROADCASTS)]
        group.shutdown()
        process.wait(timeout=60)
    return statistics.median(seconds)


def model_bytes(project: dict[str, Any]) -> int:
    """The fp32 bytes of the demo's tiny model: what one push broadcasts."""
    settings = TinyModelSettings.model_validate(project["tiny_model"])
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(settings=settings))
    return sum(p.nbytes for p in model.parameters())


def print_table(results: dict[str, dict]) -> None:
    columns = ["wall_s", "samples_per_s", "accuracy_start", "accuracy_end", "staleness_mean"]
    print(f"{'run':<16}" + "".join(f"{c:>16}" for c in columns))
    for name, result in results.items():
        print(f"{name:<16}" + "".join(f"{result[c]:>16}" for c in columns))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps of every run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out problems")
    parser.add_argument(
        "--task",
        choices=["demo", "multi"],
        default="demo",
        help="demo: the demo's one-operation problems and model, which learns to call the "
        "calculator; multi: five or six operations, a calculator call each (the rollout "
        "benchmark's model and problems, which it cannot yet solve)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per service, set as OMP_NUM_THREADS in the environment `turnrl up` "
        "and its services start with (0: torch's default, one per core): one lets the engine "
        "and the trainer each keep a core of two",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=64, help="the hf engine's running requests"
    )
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = smoke_mode.parse_args(
        parser, {"steps": 1, "prompts": 2, "samples": 2, "eval_prompts": 2}
    )
    samples_per_step = args.prompts * args.samples
    results: dict[str, dict] = {}
    records: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        chosen = {name: VARIANTS[name] for name in args.variants}
        for delayed, variants in ((False, {"bound": VARIANTS["sync"]}), (True, chosen)):
            project = project_config(args, Path(folder) / "runs", delayed)
            async with services(project, Path(folder), args.threads) as rows:
                addresses = {name: row.address for name, row in rows.items()}
                for name, variant in variants.items():
                    records[name] = await run(addresses, project, name, variant)
                    results[name] = figures(records[name], samples_per_step)
                    print(f"{name}: {json.dumps(results[name])}", flush=True)
    print_table(results)
    if set(VARIANTS) - set(args.variants):
        return
    bound = results["bound"]["wall_s"]
    stalls = [
        # Where the engine generates while the trainer trains: a push pauses it mid-decode.
        r["time/push_stall"]
        for r in records["async_eta4_overlap"]
        if "train/loss" in r
    ]
    size = model_bytes(project)
    raw = raw_broadcast_seconds(size)
    stall = statistics.median(stalls)
    print(
        f"ideal bound {bound:.1f} s (sync, tools answering at once); push stall median {stall * 1e3:.1f} ms, "
        f"raw broadcast of the same {size / 2**20:.1f} MiB {raw * 1e3:.2f} ms"
    )
    sync_rate = results["sync"]["samples_per_s"]
    headline = {
        "speedup_eta1": round(results["async_eta1"]["samples_per_s"] / sync_rate, 3),
        "speedup_eta4": round(results["async_eta4"]["samples_per_s"] / sync_rate, 3),
        "speedup_eta4_no_correction": round(
            results["async_eta4_none"]["samples_per_s"] / sync_rate, 3
        ),
        "ideal_speedup": round(results["sync"]["wall_s"] / bound, 3),
        "efficiency_vs_bound": round(bound / results["async_eta4"]["wall_s"], 3),
        "accuracy_sync": results["sync"]["accuracy_end"],
        "accuracy_async_eta1": results["async_eta1"]["accuracy_end"],
        "accuracy_async_eta4": results["async_eta4"]["accuracy_end"],
        "accuracy_async_eta4_no_correction": results["async_eta4_none"]["accuracy_end"],
        "speedup_eta4_generating_while_training": round(
            results["async_eta4_overlap"]["samples_per_s"] / sync_rate, 3
        ),
        "push_stall_s": round(stall, 4),
        "raw_broadcast_s": round(raw, 5),
        "push_stall_vs_raw": round(stall / raw, 2),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    asyncio.run(main())
