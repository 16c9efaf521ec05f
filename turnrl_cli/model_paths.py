"""The config file with the model each started service loads: a `rollout.model_path` or
`trainer.model_path` left null becomes the folder of the config's tiny demo model
(turnrl_demo), which no service builds for itself."""

from collections.abc import Sequence
from pathlib import Path

from turnrl_cli.project_config import ProjectConfig, load_project_config


def load_with_tiny_model(
    config_path: Path | None, overrides: Sequence[str], services: Sequence[str] | None = None
) -> tuple[ProjectConfig, list[str]]:
    """The config, and the overrides, with `model_path` set for each of `services` (default:
    those to start) that leaves it null: the tiny model of the config's `tiny_model`, built
    here on first use (minutes; cached), so that a service loads it at once instead of racing
    to build it within its start-up timeout. Blocks while it builds."""
    project = load_project_config(config_path, overrides)
    services = project.services_to_start() if services is None else services
    needing = [
        name
        for name in ("rollout", "trainer")
        if name in services and getattr(project, name).model_path is None
    ]
    if not needing:
        return project, list(overrides)
    # Imported here: torch would slow every thin client.
    from turnrl_demo.tiny_model import build_tiny_model

    folder = build_tiny_model(settings=project.tiny_model)
    overrides = [*overrides, *(f"{name}.model_path={folder}" for name in needing)]
    return load_project_config(config_path, overrides), overrides
