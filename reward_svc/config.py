"""The `reward:` section of a turnrl config."""

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, ServerConfig, StrictModel


class RewardConfig(StrictModel):
    """Settings of the reward service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["reward"]),
        description="Where and how the reward service listens.",
    )
