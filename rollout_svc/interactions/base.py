"""Interactions: simulated users that answer when the model replies without a tool call
(verl's BaseInteraction). The reply is appended as a user turn and generation goes on, until
the interaction ends the conversation."""

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from turnrl.config import StrictModel


@dataclass(frozen=True)
class InteractionReply:
    """What the simulated user says, whether the conversation ends, and its score of the model
    turn it answers (the trajectory's turn reward from this interaction), None for no score."""

    terminate: bool
    text: str
    score: float | None = None


class NoOptions(StrictModel):
    """Options of an interaction that takes none."""


class Interaction:
    """Base of every interaction. One instance serves every trajectory; per-trajectory state
    lives in the object `start` returns."""

    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel) -> None:
        self.options = options

    async def start(self, **interaction_kwargs: Any) -> Any:
        """Per-trajectory state from the prompt's interaction_kwargs; default: the kwargs."""
        return dict(interaction_kwargs)

    async def respond(self, state: Any, messages: list[dict[str, Any]]) -> InteractionReply:
        """The user's reply to the conversation so far (its last message is the model's)."""
        raise NotImplementedError

    async def finish(self, state: Any) -> None:
        """Frees a trajectory's state."""

    async def close(self) -> None:
        """Frees the interaction's own resources when the service stops."""
