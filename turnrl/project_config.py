"""The whole turnrl config file: one section per service, each defined by that service.

This module is the launcher's view of the file (`turnrl serve`, `turnrl up`, `turnrl run`);
a service itself receives only its own section.
"""

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from reward_svc.config import RewardConfig
from rollout_svc.config import RolloutConfig
from tool_svc.config import ToolConfig
from trainer_svc.config import TrainerConfig
from turnrl.config import StrictModel, load_config_data, validate_config


class ProjectConfig(StrictModel):
    """A turnrl config file. Every section is optional; defaults are the CPU example task."""

    tool: ToolConfig = Field(default_factory=ToolConfig, description="The tool service.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward service.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="The rollout service."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="The trainer service."
    )


def load_project_config(path: Path | None, overrides: Sequence[str] = ()) -> ProjectConfig:
    """Loads and validates a config file with `key.sub=value` overrides; ConfigError names bad keys."""
    data, applied = load_config_data(path, overrides)
    return validate_config(ProjectConfig, data, path=path, overrides=applied)
