"""The `tool:` section of a turnrl config."""

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, ServerConfig, StrictModel


class ToolConfig(StrictModel):
    """Settings of the tool service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["tool"]),
        description="Where and how the tool service listens.",
    )
