"""What a gateway session holds: its recorded state, the request being answered, and the
trajectory it ends as (sessions.py works on them)."""

import re
from dataclasses import dataclass, field
from typing import Any

from rollout_svc.engines.base import FinishReason as EngineFinish
from rollout_svc.engines.base import SamplingParams
from rollout_svc.gateway.requests import ChatCompletionRequest
from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import InvalidArgumentError
from turnrl.trajectory import FinishReason, Segment, Trajectory, TurnMetrics

SESSION_ID = re.compile(r"[A-Za-z0-9._~:-]{1,128}")


@dataclass(frozen=True)
class ModelTurn:
    """One answered request: the assistant message the session recorded and what it cost."""

    message: dict[str, Any]
    finish_reason: str  # OpenAI's: "stop", "length" or "tool_calls"
    output_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int


@dataclass
class SessionState:
    """What a session has recorded; replaced whole when a turn is committed."""

    tokens: ConversationTokens | None = None  # None until the first turn
    tools: list[dict[str, Any]] | None = None
    stop_token_ids: tuple[int, ...] = ()
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnMetrics] = field(default_factory=list)
    last_finish: EngineFinish | None = None


@dataclass
class Session:
    """One session: what it recorded, and whether a request of it runs."""

    session_id: str
    state: SessionState = field(default_factory=SessionState)
    # The state before the last turn and the messages of the request that made it, for a retry.
    before_last: SessionState | None = None
    last_request: list[dict[str, Any]] | None = None
    busy: bool = False


@dataclass(frozen=True)
class PendingTurn:
    """A request checked and tokenized, its turn not yet sampled: `state` is the session's
    state with the request's new messages, committed once the model turn is added."""

    session: Session
    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    base: SessionState
    state: SessionState
    input_ids: list[int]
    sampling: SamplingParams


def check_session_id(session_id: str) -> None:
    """Raises InvalidArgumentError for a session id outside `SESSION_ID`."""
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgumentError(
            f"session id {session_id[:140]!r} must be 1-128 characters of A-Z a-z 0-9 . _ ~ : -"
        )


def engine_session(session_id: str) -> str:
    """The engine's session of a gateway session (its KV cache), apart from the rollout's."""
    return f"gateway/{session_id}"


def session_trajectory(session: Session) -> Trajectory:
    """The trajectory a session recorded, finished: MAX_NEW_TOKENS when its last turn was cut."""
    state = session.state
    reasons = {EngineFinish.LENGTH: FinishReason.MAX_NEW_TOKENS}
    trajectory = Trajectory(
        trajectory_id=session.session_id,
        group_id=session.session_id,
        sample_index=0,
        segments=state.segments,
        messages=state.messages,
        finish_reason=reasons.get(state.last_finish, FinishReason.STOP),
        turns=state.turns,
    )
    trajectory.metrics = {
        "turns": float(len(state.turns)),
        "model_tokens": float(sum(trajectory.loss_mask)),
    }
    return trajectory
