"""The `rollout:` section of a turnrl config."""

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, ServerConfig, StrictModel


class RolloutConfig(StrictModel):
    """Settings of the rollout service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["rollout"]),
        description="Where and how the rollout service listens.",
    )
