"""The whole turnrl config file: one section per service, each defined by that service.

This module is the launcher's view of the file (`turnrl serve`, `turnrl up`, `turnrl run`);
a service itself receives only its own section.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from reward_svc.config import RewardConfig
from rollout_svc.config import RolloutConfig
from tool_svc.config import ToolConfig
from trainer_svc.config import TrainerConfig
from turnrl.config import ClientConfig, ServerConfig, StrictModel, load_config_data, validate_config
from turnrl.errors import ConfigError
from turnrl_demo.settings import TinyModelSettings

# Start order; stop order is the reverse (the trainer calls the rollout service, which calls
# the tool and reward services, so callers go first and never see their callees vanish).
SERVICE_NAMES = ("tool", "reward", "rollout", "trainer")


class ServiceResources(StrictModel):
    """What one replica of a service (one rank, for the trainer) asks of a Ray node."""

    num_cpus: float = Field(
        default=1.0,
        ge=0,
        description="CPUs reserved for it: what Ray places by, not a limit on what it uses "
        "(Ray sets its OMP_NUM_THREADS to this, rounded down, at least 1).",
    )
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved for it.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources it needs, e.g. {node_b: 1} to land on the node "
        "started with `ray start --resources '{\"node_b\": 1}'`.",
    )
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        default="pack",
        description="How its replicas (or ranks) share nodes: pack onto few, spread over many; "
        "strict_ refuses to start otherwise (Ray placement group strategies).",
    )


class RayLauncherConfig(StrictModel):
    """The Ray cluster the services run on (`launcher.kind: ray`)."""

    address: str | None = Field(
        default=None,
        description="The cluster: 'auto' (one this machine joined with `ray start`), "
        "'HOST:PORT' of its head; None: the one this machine runs if any, else a new local one.",
    )
    namespace: str = Field(
        default="turnrl",
        description="Ray namespace of the service actors, named SERVICE:REPLICA (`ray list "
        "actors`); one launch per namespace.",
    )
    # The defaults fit the demo on a 2-CPU cluster, even with 2 rollout and 2 tool replicas:
    # the tool and reward services wait on I/O and sandboxes, the rollout service and the
    # trainer compute.
    tool: ServiceResources = Field(
        default_factory=lambda: ServiceResources(num_cpus=0.1),
        description="Per replica; mostly waits.",
    )
    reward: ServiceResources = Field(
        default_factory=lambda: ServiceResources(num_cpus=0.1),
        description="Per replica; mostly waits.",
    )
    rollout: ServiceResources = Field(
        default_factory=lambda: ServiceResources(num_cpus=0.5),
        description="Per replica; on GPU give each its engine's GPUs (num_gpus: 1 for one SGLang "
        "server of tensor-parallel size 1).",
    )
    trainer: ServiceResources = Field(
        default_factory=lambda: ServiceResources(num_cpus=0.5),
        description="Per rank (trainer.ranks of them, in one placement group); on GPU give "
        "each its GPUs.",
    )


class RestartPolicy(StrictModel):
    """What a launcher does when one of its services dies (compose's `restart:`)."""

    mode: Literal["on-failure", "never"] = Field(
        default="on-failure",
        description="on-failure: start it again, at the same address, when it exits with an "
        "error or a signal; never: stop every service (and the run) instead.",
    )
    max_restarts: int = Field(
        default=5, ge=0, description="Restarts of one replica before the launcher gives up."
    )
    backoff_seconds: float = Field(
        default=1.0, ge=0, description="Wait before the first restart; doubled for each next."
    )
    max_backoff_seconds: float = Field(
        default=30.0, ge=0, description="The longest wait before a restart."
    )


class RestartPolicies(StrictModel):
    """Each service's restart policy."""

    tool: RestartPolicy = Field(default_factory=RestartPolicy, description="Each tool replica.")
    reward: RestartPolicy = Field(default_factory=RestartPolicy, description="Each reward replica.")
    rollout: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Each rollout replica."
    )
    trainer: RestartPolicy = Field(
        default_factory=lambda: RestartPolicy(mode="never"),
        description="The trainer. never: a trainer that dies stops the run (`turnrl run "
        "--resume` continues it from its last checkpoint); on-failure: `turnrl run` submits "
        "the run again to the restarted trainer, with resume, which does the same by itself. "
        "Not on Ray with several ranks: a rank started again alone cannot rejoin the others.",
    )


class LauncherConfig(StrictModel):
    """How `turnrl up` and `turnrl run` start the services."""

    kind: Literal["local", "ray"] = Field(
        default="local",
        description="local: child processes of the launcher, on this machine; ray: Ray actors "
        "on a Ray cluster's nodes (needs the `ray` extra). Both start the same servers.",
    )
    ray: RayLauncherConfig = Field(
        default_factory=RayLauncherConfig, description="The Ray cluster and each service's needs."
    )
    auth_token: Literal["auto", "generate", "none"] = Field(
        default="auto",
        description="A bearer token the launcher makes for this launch and hands to the "
        "services it starts and to their callers (turnrl_cli.launch_token). auto: when one of "
        "them would listen on an address other machines reach (every Ray launch binds its "
        "node's) with no TLS or token of its own; generate: always (a shared machine's other "
        "users reach 127.0.0.1 too); none: never.",
    )
    tls: Literal["auto"] | bool = Field(
        default="auto",
        description="TLS certificates the launcher makes for this launch: a CA of its own and a "
        "certificate for each node, served by every service it starts without server.tls of "
        "its own and trusted by their callers (turnrl_cli.launch_tls), so the token and the "
        "traffic between nodes are encrypted. auto: on Ray; on (true): also for the local "
        "launcher; off (false): plaintext, unless server.tls is set (a private network only).",
    )
    startup_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long a started (or restarted) service may take to report SERVING, "
        "and Ray to place a service's replicas, in seconds; a restart that takes longer is "
        "killed and counts as a failed restart. Raise it for one that loads much first: a "
        "tool service indexing a large corpus with BM25, a rollout service launching SGLang "
        "(its own engine_options.startup_timeout_seconds) or downloading a model.",
    )
    restart: RestartPolicies = Field(
        default_factory=RestartPolicies,
        description="Each service's restart policy. Its callers ride a restart out: the rollout "
        "service tries tool and scoring calls again, the trainer's router waits for a rollout "
        "replica to come back and brings it the current weights.",
    )


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
    launcher: LauncherConfig = Field(
        default_factory=LauncherConfig,
        description="How `turnrl up`/`run` start the services: local processes or Ray actors.",
    )
    trainer_service: ClientConfig | None = Field(
        default=None,
        description="A trainer service already running, which `turnrl run` submits to; None: "
        "`turnrl run` starts one.",
    )

    @model_validator(mode="after")
    def _trainer_ranks_restart_together(self) -> Self:
        restart = self.launcher.restart.trainer.mode
        if self.launcher.kind == "ray" and self.trainer.ranks > 1 and restart == "on-failure":
            raise ValueError(
                "launcher.restart.trainer.mode on-failure with trainer.ranks > 1 on Ray: a rank "
                "started again alone cannot rejoin the others; set it to never (a run then "
                "stops, and `turnrl run --resume` continues it)"
            )
        return self

    def server(self, name: str) -> ServerConfig:
        """Where service `name` listens."""
        return getattr(self, name).server

    def replicas(self, name: str) -> int:
        """How many copies of service `name` a launcher starts (the trainer: one service,
        whatever its ranks)."""
        return 1 if name == "trainer" else getattr(self, name).replicas

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
