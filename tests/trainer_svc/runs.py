"""Runs on a trainer service for the end-to-end tests: a small run's config, following its
progress, running it to its end."""

import json
from pathlib import Path

import yaml

from trainer_svc.ledger import LEDGER_FILE
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc

from ..conftest import EXAMPLE_CONFIG

State = trainer_pb2.Run.State
# A run small enough for a test: 2 prompts x 4 samples per step, 8 held-out prompts.
SMALL_RUN = {
    "steps": 2,
    "eval_every": 1,
    "checkpoint": {"every": 1},
    "loggers": ["wandb"],
    "data": {"generated_train_size": 64, "generated_eval_size": 8},
    "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_turns": 3},
    "optim": {"learning_rate": 0.001},
}


def run_config(services: dict[str, str], output_dir: Path, **trainer) -> str:
    """A whole-project config for StartRun, pointing the trainer at `services`."""
    project = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    project["trainer"].update(SMALL_RUN)
    project["trainer"].update(
        output_dir=str(output_dir),
        rollout_service={"address": services["rollout"]},
        **trainer,
    )
    return yaml.safe_dump(project)


async def follow(stub, run_name: str) -> list[trainer_pb2.StreamProgressResponse]:
    request = trainer_pb2.StreamProgressRequest(run_name=run_name)
    return [event async for event in stub.StreamProgress(request, timeout=600)]


async def run_to_end(address: str, config: str, name: str) -> list:
    """Runs `name` on the trainer service at `address` to its successful end; its events."""
    async with rpc.open_channel(ClientConfig(address=address)) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
        events = await follow(stub, name)
        run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name=name), timeout=10)).run
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    return events


def read_dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_dumps(run_dir: Path, steps: list[int], per_step: int, eval_steps: list[int]) -> dict:
    """Checks a run's trajectory dumps (trainer_svc/dumps.py): `per_step` lines for each of
    `steps`, of the groups the step trained, the best and worst of each group among them as
    their advantages order them; one line per held-out prompt for each of `eval_steps`; the
    per-token arrays of every line aligned. Returns the rollout lines by step."""
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == [
        f"step_{step:06d}.jsonl" for step in steps
    ]
    ledger = {
        record["step"]: record["trained"]
        for record in map(json.loads, (run_dir / LEDGER_FILE).read_text().splitlines())
    }
    by_step = {}
    for step in steps:
        records = by_step[step] = read_dump(run_dir / "rollouts" / f"step_{step:06d}.jsonl")
        assert len(records) == per_step
        assert len({r["trajectory_id"] for r in records}) == per_step
        for record in records:
            check_aligned(record, step)
            assert record["group_id"] in ledger[step]
            assert len(record["trainer_logprobs"]) == record["total_tokens"]
            assert record["logprob_mismatch"] >= 0 and record["advantage"] is not None
        for group in {r["group_id"] for r in records}:
            # GRPO: within a group, a higher reward has a higher advantage.
            of_group = sorted(
                (r["reward"], r["advantage"]) for r in records if r["group_id"] == group
            )
            assert [a for _, a in of_group] == sorted(a for _, a in of_group), of_group
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in logged if "eval/accuracy" in r}
    assert sorted(evals) == eval_steps
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == [
        f"step_{step:06d}.jsonl" for step in eval_steps
    ]
    for step in eval_steps:
        records = read_dump(run_dir / "eval" / f"step_{step:06d}.jsonl")
        held_out = SMALL_RUN["data"]["generated_eval_size"]
        assert len({r["group_id"] for r in records}) == len(records) == held_out
        for record in records:
            check_aligned(record, step)
            assert record["trainer_logprobs"] is None and record["advantage"] is None
        if evals[step]["eval/infra_failed_trajectories"] == 0:
            mean = sum(r["reward"] for r in records) / len(records)
            assert abs(mean - evals[step]["eval/reward_mean"]) < 1e-6
    return by_step


def check_aligned(record: dict, step: int) -> None:
    assert record["step"] == step
    tokens = record["total_tokens"]
    assert tokens == record["prompt_tokens"] + record["response_tokens"]
    for name in ("token_ids", "tokens", "loss_mask", "rollout_logprobs"):
        assert len(record[name]) == tokens, name
    assert record["messages"] and record["finish_reason"]
    assert isinstance(record["reward"], float)
