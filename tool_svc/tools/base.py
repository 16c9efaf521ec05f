"""The Tool API: what every tool implements, and the result it returns.

A tool is a class with an OpenAI function `schema`, an `Options` model for its YAML `config`,
and async `create` / `execute` / `calc_reward` / `release` on a per-trajectory session.
The service (`tool_svc/service.py`) owns limits, timeouts, sessions and metrics; a tool only
does its one job. A failure the model should read is raised as `ToolCallError`; anything
else a tool raises is a bug, reported to the model as an internal error and logged.
"""

import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jsonschema
from pydantic import BaseModel

from turnrl.config import StrictModel


class ToolErrorKind(enum.StrEnum):
    """Class of a tool failure; mirrors `turnrl.v1.ToolError.Kind`."""

    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    TIMEOUT = "TIMEOUT"
    EXECUTION_FAILED = "EXECUTION_FAILED"
    RATE_LIMITED = "RATE_LIMITED"
    TOO_LARGE = "TOO_LARGE"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class ToolCallError(Exception):
    """A failure the model reads as the tool's observation (bad arguments, a crash, ...)."""

    def __init__(self, kind: ToolErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class ToolImage:
    """An image a tool returns (PNG/JPEG/WebP bytes)."""

    data: bytes
    mime_type: str


@dataclass
class ToolResult:
    """What one call returns: the observation text, optional images and step reward."""

    text: str
    images: list[ToolImage] = field(default_factory=list)
    step_reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error_kind: ToolErrorKind | None = None

    @classmethod
    def failure(cls, kind: ToolErrorKind, message: str) -> "ToolResult":
        """An error observation: `text` holds the message the model reads."""
        return cls(text=message, error_kind=kind)


class NoOptions(StrictModel):
    """Options of a tool that takes none."""


class Tool:
    """Base of every tool. Subclasses set `schema` and `Options`, and override `execute`.

    `schema` is an OpenAI function definition: {"name", "description", "parameters"}.
    One instance serves every caller; per-trajectory state lives in the session object that
    `create` returns, so methods must not keep per-call state on `self`.
    """

    schema: ClassVar[dict[str, Any]]
    Options: ClassVar[type[BaseModel]] = NoOptions
    # Whether Execute needs a session from CreateSession (state or per-trajectory kwargs).
    requires_session: ClassVar[bool] = False

    def __init__(self, name: str, options: BaseModel, schema: dict[str, Any] | None = None):
        self.name = name
        self.options = options
        self.schema = {**(schema or type(self).schema), "name": name}
        self._validator = jsonschema.Draft202012Validator(self.schema.get("parameters", {}))

    @classmethod
    async def from_config(
        cls, name: str, options: dict[str, Any], schema: dict[str, Any] | None
    ) -> list["Tool"]:
        """Builds the tools one config entry declares; most entries declare exactly one.

        Raises pydantic.ValidationError for bad options. A proxy (MCP) overrides this to
        return one tool per remote tool.
        """
        return [cls(name, cls.Options.model_validate(options), schema)]

    def parse_args(self, raw: str) -> dict[str, Any]:
        """Parses the model's raw argument text: a JSON object valid against the schema."""
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"arguments are not valid JSON ({e.msg} at position {e.pos}): {_clip(raw)!r}",
            ) from None
        if not isinstance(args, dict):
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"arguments must be a JSON object, got {type(args).__name__}: {_clip(raw)!r}",
            )
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(args))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"invalid arguments for {self.name}: {where}: {error.message}",
            )
        return args

    async def create(self, **session_kwargs: Any) -> Any:
        """Opens a session for one trajectory; the default keeps the kwargs as its state."""
        return dict(session_kwargs)

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        """Runs one call with parsed, schema-valid `args`. Raise ToolCallError on failure."""
        raise NotImplementedError

    async def calc_reward(self, session: Any) -> float:
        """The trajectory-level reward of a session; 0.0 for tools that give none."""
        return 0.0

    async def release(self, session: Any) -> None:
        """Frees a session's resources. Called once per session, on release or expiry."""

    async def close(self) -> None:
        """Frees the tool's own resources (pools, connections) when the service stops."""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
