"""What the GPU recipes' tests share: an example's scripts loaded as modules, the rows its
converter wrote loaded as the trainer loads them, its tool section served by a real
ToolService and the schemas its trainer offers, and the recipe run for two steps on the SGLang
stand-in."""

import contextlib
import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

from tool_svc.config import ToolConfig
from tool_svc.service import ToolService
from trainer_svc.data import PromptRecord, load_datasets
from turnrl_cli.project_config import ProjectConfig

from ..conftest import run_turnrl
from ..rollout_svc.sglang_stand_in import stand_in_command


@contextlib.asynccontextmanager
async def tool_service(config: ToolConfig) -> AsyncIterator[ToolService]:
    service = await ToolService.create(config)
    try:
        yield service
    finally:
        await service.close()


def offered_tool_schemas(service: ToolService, config: ProjectConfig) -> list[dict]:
    """The served schemas of the tools the trainer offers, as the rollout service renders them."""
    served = {info.schema["name"]: info.schema for info in service.list_tools()}
    missing = set(config.trainer.rollout.tools) - set(served)
    assert not missing, (
        f"trainer.rollout.tools offers {missing}; the tool section serves {set(served)}"
    )
    return [{"type": "function", "function": served[name]} for name in config.trainer.rollout.tools]


def on_stand_in(
    example: Path, tiny_model_dir: Path, output_dir: Path, data: dict[str, Any]
) -> dict[str, Any]:
    """A GPU recipe scaled down to the tiny model on CPU, as a config file's mapping: the
    rollout service launches the SGLang stand-in serving the model where the recipe launches
    SGLang, gloo stands for NCCL, fp32, services on free ports, two steps of 2 prompts on
    `data` (trainer.data)."""
    return {
        "base": str(example),
        "tool": {"server": {"port": 0}},
        "reward": {"server": {"port": 0}, "workers": 1},
        "rollout": {
            "server": {"port": 0},
            "model_path": str(tiny_model_dir),
            "engine_options": {
                "launch": {"port": 0, "extra_args": [], "command": list(stand_in_command())},
                "startup_timeout_seconds": 120,
            },
            "max_new_tokens": 48,
            "max_response_length": 256,
            "max_concurrent_trajectories": 16,
        },
        "trainer": {
            "server": {"port": 0},
            "model_path": str(tiny_model_dir),
            "output_dir": str(output_dir),
            "steps": 2,
            "eval_every": 0,
            "data": data,
            "rollout": {"prompts_per_step": 2, "max_turns": 3},
            "optim": {"dtype": "float32", "activation_checkpointing": False},
            "weight_sync": {"backend": "gloo"},
            "loggers": [],
        },
    }


async def run_two_steps(config: dict[str, Any], folder: Path, run_name: str) -> list[dict]:
    """Runs `config` (from `on_stand_in`) with `turnrl run` and checks its two steps: each
    pushed its weights by broadcast, and step 2's rollouts came from the weights step 1 pushed
    into the server, so the trainer's logprobs match them. Returns the run's metric records."""
    config_file = folder / "config.yaml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    code, _, stderr = await run_turnrl("run", "--config", str(config_file), timeout_seconds=600)
    assert code == 0, stderr[-4000:]
    lines = (folder / run_name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [record for record in records if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2]
    assert all(record["push/broadcast"] == 1.0 for record in steps)
    assert steps[1]["mismatch/mean_abs_diff"] < 1e-3, steps[1]
    return records


def load_script(example: Path, name: str) -> ModuleType:
    """The example's script `name`.py as a module, registered by its name, as a script imports
    another beside it."""
    spec = importlib.util.spec_from_file_location(name, example / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def converted_records(config: ProjectConfig, output_dir: Path) -> dict[str, list[PromptRecord]]:
    """The prompts a converter wrote into `output_dir`, loaded as the trainer loads them: the
    config's data section with its file names, in that folder."""
    data = config.trainer.data
    data = data.model_copy(
        update={
            "train_files": [output_dir / path.name for path in data.train_files],
            "eval_files": [output_dir / path.name for path in data.eval_files],
        }
    )
    train, held_out = load_datasets(data, seed=config.trainer.seed)
    return {"train": train, "test": held_out}
