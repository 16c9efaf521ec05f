"""The `tool:` section of a turnrl config: where the service listens, which tools it serves,
and the limits that hold for every caller."""

from pathlib import Path
from typing import Any

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, HttpJsonServerConfig, StrictModel


class ToolLimits(StrictModel):
    """Limits of one tool: they hold across every caller at once. The rate limit holds for the
    whole service, its replicas together (`ToolConfig.replicas`); the concurrency cap and the
    queue hold for each replica, as they protect the machine it runs on."""

    max_concurrency: int = Field(
        default=16,
        ge=0,
        description="Calls of this tool running at once on each replica; 0: unlimited.",
    )
    max_queue: int = Field(
        default=1024,
        ge=0,
        description="Calls waiting for a free slot on each replica; one more is refused with "
        "RESOURCE_EXHAUSTED.",
    )
    rate_limit_per_second: float = Field(
        default=0.0,
        ge=0,
        description="Sustained calls started per second by the whole service (each replica "
        "allows its even share); 0: unlimited.",
    )
    rate_limit_burst: int = Field(
        default=1,
        ge=1,
        description="Calls the whole service may start at once before the rate applies (each "
        "replica allows its even share, at least 1).",
    )
    max_rate_wait_seconds: float = Field(
        default=1.0,
        ge=0,
        description="Longest a call waits for the rate limit before it returns a RATE_LIMITED "
        "tool error, in seconds.",
    )
    call_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Wall-clock limit of one call, in seconds."
    )


class ToolEntry(StrictModel):
    """One tool to serve, in the shape of verl's tool config (class_name, config, tool_schema)."""

    class_name: str = Field(
        description="A built-in tool (a key of tool_svc.tools.TOOLS, e.g. 'calculator') or a "
        "user tool by import path: a Tool subclass, 'package.module:ClassName', or a plain "
        "function with type hints and a Google-style docstring, 'package.module:function'."
    )
    name: str | None = Field(
        default=None,
        pattern=r"^[a-zA-Z0-9_.-]{1,64}$",
        description="Name the model calls it by; default: the name in its schema.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="Options of the tool, validated by its Options model."
    )
    tool_schema: dict[str, Any] | None = Field(
        default=None,
        description="OpenAI function schema replacing the tool's own: {name, description, "
        "parameters} or {type: function, function: {...}}.",
    )
    limits: ToolLimits | None = Field(
        default=None, description="This tool's limits; default: `default_limits`."
    )


def _default_tools() -> list[ToolEntry]:
    return [ToolEntry(class_name="calculator"), ToolEntry(class_name="python")]


class ToolConfig(StrictModel):
    """Settings of the tool service."""

    server: HttpJsonServerConfig = Field(
        default_factory=lambda: HttpJsonServerConfig(port=DEFAULT_PORTS["tool"]),
        description="Where and how the tool service listens.",
    )
    tools: list[ToolEntry] = Field(
        default_factory=_default_tools,
        description="Tools to serve; default: calculator and python.",
    )
    tools_file: Path | None = Field(
        default=None,
        description="A YAML file with more entries under `tools:` (verl's tool config shape).",
    )
    default_limits: ToolLimits = Field(
        default_factory=ToolLimits, description="Limits of tools that set none."
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="Replicas of this service a launcher starts, all with this config. Each "
        "enforces rate_limit_per_second / replicas (and rate_limit_burst likewise, at least 1), "
        "so that a rate limit holds for the whole service.",
    )
    session_ttl_seconds: float = Field(
        default=600.0, gt=0, description="Idle time after which a session is released, in seconds."
    )
    max_sessions: int = Field(
        default=10_000, gt=0, description="Live sessions at once; more are RESOURCE_EXHAUSTED."
    )
    max_argument_bytes: int = Field(
        default=64 * 1024,
        gt=0,
        description="Largest arguments text of one call, in bytes; larger is a TOO_LARGE error.",
    )
    max_result_bytes: int = Field(
        default=32 * 1024,
        gt=0,
        description="Largest result text of one call, in UTF-8 bytes; longer text is truncated.",
    )
