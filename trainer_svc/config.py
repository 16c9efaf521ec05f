"""The `trainer:` section of a turnrl config."""

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, ServerConfig, StrictModel


class TrainerConfig(StrictModel):
    """Settings of the trainer service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["trainer"]),
        description="Where and how the trainer service listens.",
    )
