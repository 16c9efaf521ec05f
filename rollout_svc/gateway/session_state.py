"""What a gateway session holds: its recorded state, the request being answered, and the
trajectory it ends as (sessions.py works on them)."""

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from rollout_svc.agent_loop import RolloutLimits
from rollout_svc.engines.base import EngineImage, SamplingParams
from rollout_svc.engines.base import FinishReason as EngineFinish
from rollout_svc.gateway.requests import ChatCompletionRequest
from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import InvalidArgumentError
from turnrl.trajectory import FinishReason, Segment, Trajectory, TrajectoryImage, TurnMetrics

SESSION_ID = re.compile(r"[A-Za-z0-9._~:-]{1,128}")


@dataclass(frozen=True)
class ModelTurn:
    """One answered request: the assistant message the session recorded and what it cost."""

    message: dict[str, Any]
    finish_reason: str  # OpenAI's: "stop", "length" or "tool_calls"
    output_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    # Trailing output ids left out of the content: the stop token the turn ended on, or the ids
    # that spell its stop string; 0 for a turn cut by length.
    stop_token_count: int


@dataclass
class SessionState:
    """What a session has recorded; replaced whole when a turn is committed. `tokens`,
    `part_images` and the positions `part_messages` and `part_tokens` are its current part's
    (history.py); the segments, messages and images are all parts'."""

    tokens: ConversationTokens | None = None  # None until the first turn
    tools: list[dict[str, Any]] | None = None
    stop_strings: tuple[str, ...] = ()
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    part_messages: int = 0  # where the current part's messages start in `messages`
    part_tokens: int = 0  # where its tokens start in the segments' ids
    turns: list[TurnMetrics] = field(default_factory=list)
    last_finish: EngineFinish | None = None
    # The current part's images at their tokens in its context (what the engine is given), and
    # all parts' at their tokens in the trajectory (what it records).
    part_images: list[EngineImage] = field(default_factory=list)
    images: list[TrajectoryImage] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeSettings:
    """What the rollout service sets for a session it opened for an agent's episode
    (rollout_svc/agent_episodes.py): the Generate call's sampling, which wins over the
    request's temperature, top_p and seed (the trainer's distribution, not the agent's), and
    its limits, max_turns included."""

    sampling: SamplingParams
    limits: RolloutLimits


@dataclass
class Session:
    """One session: what it recorded, and whether a request of it runs."""

    session_id: str
    state: SessionState = field(default_factory=SessionState)
    # The last turn's other choices (a request with n > 1), each a state that a later request
    # may continue instead of `state` (`sessions.continued_choice`).
    other_choices: list[SessionState] = field(default_factory=list)
    # The state before the last turn and the messages of the request that made it, for a retry.
    before_last: SessionState | None = None
    last_request: list[dict[str, Any]] | None = None
    busy: bool = False
    episode: EpisodeSettings | None = None  # None: a session an agent opened itself
    # Set while no request runs, for `ChatSessions.close` to wait on.
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    engine_request_ids: list[str] = field(default_factory=list)  # the running turn's, to abort
    closing: bool = False  # `ChatSessions.close` was called: no new turn starts
    # The limit a refused request ran into: the model's doing, so the episode is still scored.
    limit_reached: FinishReason | None = None

    def __post_init__(self) -> None:
        self.idle.set()


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
    """The trajectory a session recorded, finished: the limit a request ran into, else
    MAX_NEW_TOKENS when its last turn was cut, else STOP."""
    state = session.state
    reasons = {EngineFinish.LENGTH: FinishReason.MAX_NEW_TOKENS}
    finish_reason = session.limit_reached or reasons.get(state.last_finish, FinishReason.STOP)
    trajectory = Trajectory(
        trajectory_id=session.session_id,
        group_id=session.session_id,
        sample_index=0,
        segments=state.segments,
        messages=state.messages,
        finish_reason=finish_reason,
        turns=state.turns,
        images=state.images,
    )
    trajectory.metrics = session_metrics(
        state.turns, sum(trajectory.loss_mask), len(trajectory.parts)
    )
    return trajectory


def session_metrics(turns: list[TurnMetrics], model_tokens: int, parts: int) -> dict[str, float]:
    """A session's summary metrics, under the agent loop's names, and its `parts` (one more
    for each history the agent rewrote: history.py). The agent runs its tools, so how they
    went is not seen here: tool_errors is 0."""
    return {
        "turns": float(len(turns)),
        "model_tokens": float(model_tokens),
        "tool_calls": float(sum(turn.tool_calls for turn in turns)),
        "tool_errors": 0.0,
        "parts": float(parts),
    }
