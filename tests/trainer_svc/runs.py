"""Runs on a trainer service for the end-to-end tests: a small run's config, following its
progress, running it to its end."""

from pathlib import Path

import yaml

from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc

from ..conftest import EXAMPLE_CONFIG

State = trainer_pb2.Run.State
# A run small enough for a test: 2 prompts x 4 samples per step, 8 held-out prompts.
SMALL_RUN = {
    "steps": 2,
    "eval_every": 1,
    "checkpoint_every": 1,
    "wandb_mode": "offline",
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
