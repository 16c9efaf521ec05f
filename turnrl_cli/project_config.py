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
from turnrl.config import ClientConfig, StrictModel, load_config_data, validate_config
from turnrl.errors import ConfigError
from turnrl_demo.settings import TinyModelSettings

# Start order; stop order is the reverse (the trainer calls the rollout service, which calls
# the tool and reward services, so callers go first and never see their callees vanish).
SERVICE_NAMES = ("tool", "reward", "rollout", "trainer")


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
    tiny_model: TinyModelSettings = Field(
        default_factory=TinyModelSettings,
        description="The tiny calculator model (turnrl_demo) that `turnrl serve`, `up` and `run` "
        "build (once, cached) for a rollout.model_path or trainer.model_path left null.",
    )
    trainer_service: ClientConfig | None = Field(
        default=None,
        description="A trainer service already running, which `turnrl run` submits to; None: "
        "`turnrl run` starts one.",
    )

    def services_to_start(self) -> list[str]:
        """The services `turnrl up` and `turnrl run` start, in start order: those this config
        does not point at.

        A service is pointed at when a caller's address for it is set in the file or the
        overrides: the trainer by `trainer_service`, the rollout service by
        `trainer.rollout_service`, the tool and reward services by `rollout.tool_service` and
        `rollout.reward_service` (or when the rollout service is, as only it calls them). An
        SFT run (`trainer.mode: sft`) calls no other service: only the trainer is needed.
        Raises ConfigError when a trainer that runs elsewhere would have to call a rollout
        service started here, on this machine's loopback.
        """
        if self.trainer.mode == "sft":
            return [] if self.trainer_service is not None else ["trainer"]
        pointed_at = {
            "trainer": self.trainer_service is not None,
            "rollout": "rollout_service" in self.trainer.model_fields_set,
            "tool": "tool_service" in self.rollout.model_fields_set,
            "reward": "reward_service" in self.rollout.model_fields_set,
        }
        if pointed_at["trainer"] and not pointed_at["rollout"]:
            raise ConfigError(
                "trainer_service points at a trainer elsewhere, which cannot reach a rollout "
                "service started here: also set trainer.rollout_service"
            )
        if pointed_at["rollout"]:
            pointed_at["tool"] = pointed_at["reward"] = True
        return [name for name in SERVICE_NAMES if not pointed_at[name]]


def load_project_config(path: Path | None, overrides: Sequence[str] = ()) -> ProjectConfig:
    """Loads and validates a config file with `key.sub=value` overrides; ConfigError names bad keys."""
    data, applied = load_config_data(path, overrides)
    return validate_config(ProjectConfig, data, path=path, overrides=applied)
