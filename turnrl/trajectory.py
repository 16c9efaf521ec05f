"""The trajectory: the unit of truth between the rollout service and the trainer.

A trajectory is a list of segments, each a run of token ids with one source. The token
sequence is their concatenation. `loss_mask` is 1 on model-sampled tokens only;
`response_mask` is 1 on every token after the prompt. They are different things and stay
separate fields. Both are derived from the segments, so they cannot disagree with them.

A trajectory may come in parts: a PROMPT segment after segments of other sources starts a new
context, one that does not continue the tokens before it (an agent that rewrote its history
through the gateway: rollout_svc/gateway/history.py). The trainer trains each part as a
sequence of its own (`parts`), all under the trajectory's reward.

The rollout service's agent loop builds one `Trajectory` as the conversation goes; it crosses
the wire once (`to_proto`, then `from_proto` on the trainer's side, which checks the wire's
masks against the segments), and the trainer builds its tensors from the same fields.
"""

import array
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnrl.errors import InvalidArgumentError
from turnrl.messages import dict_to_message, message_to_dict
from turnrl.v1 import common_pb2


class SegmentSource(enum.Enum):
    """Origin of a segment's tokens; values are the wire enum's."""

    PROMPT = common_pb2.SEGMENT_SOURCE_PROMPT
    MODEL = common_pb2.SEGMENT_SOURCE_MODEL
    TOOL = common_pb2.SEGMENT_SOURCE_TOOL
    USER = common_pb2.SEGMENT_SOURCE_USER
    TEMPLATE = common_pb2.SEGMENT_SOURCE_TEMPLATE


class FinishReason(enum.Enum):
    """Why a trajectory ended; values are the wire enum's."""

    STOP = common_pb2.FINISH_REASON_STOP
    MAX_TURNS = common_pb2.FINISH_REASON_MAX_TURNS
    MAX_MODEL_LEN = common_pb2.FINISH_REASON_MAX_MODEL_LEN
    MAX_RESPONSE_LENGTH = common_pb2.FINISH_REASON_MAX_RESPONSE_LENGTH
    MAX_NEW_TOKENS = common_pb2.FINISH_REASON_MAX_NEW_TOKENS
    INTERACTION_TERMINATED = common_pb2.FINISH_REASON_INTERACTION_TERMINATED
    ABORTED = common_pb2.FINISH_REASON_ABORTED
    ERROR = common_pb2.FINISH_REASON_ERROR


class TurnRewardSource(enum.Enum):
    """What gave a model turn its reward; values are the wire enum's."""

    TOOL = common_pb2.TURN_REWARD_SOURCE_TOOL
    INTERACTION = common_pb2.TURN_REWARD_SOURCE_INTERACTION
    SCORER = common_pb2.TURN_REWARD_SOURCE_SCORER


@dataclass(frozen=True)
class TurnReward:
    """A reward earned by model turn `turn` (0-based; see `Trajectory.model_turn_spans`),
    given by the tool, interaction or scorer called `name`."""

    turn: int
    value: float
    source: TurnRewardSource
    name: str = ""

    def to_proto(self) -> common_pb2.TurnReward:
        return common_pb2.TurnReward(
            turn=self.turn, value=self.value, source=self.source.value, name=self.name
        )

    @classmethod
    def from_proto(cls, proto: common_pb2.TurnReward) -> "TurnReward":
        """Raises ValueError for an unset or unknown source."""
        return cls(proto.turn, proto.value, TurnRewardSource(proto.source), proto.name)


@dataclass(frozen=True)
class TrajectoryImage:
    """An image of the conversation: its tokens' [token_offset, token_offset + token_count)
    in the trajectory, the SHA-256 of its bytes, and the grid its processor made."""

    token_offset: int
    token_count: int
    sha256: str
    grid_thw: tuple[int, int, int]

    def to_proto(self) -> common_pb2.TrajectoryImage:
        return common_pb2.TrajectoryImage(
            token_offset=self.token_offset,
            token_count=self.token_count,
            sha256=self.sha256,
            grid_thw=self.grid_thw,
        )

    @classmethod
    def from_proto(cls, proto: common_pb2.TrajectoryImage) -> "TrajectoryImage":
        """Raises ValueError for a grid of other than three sizes."""
        if len(proto.grid_thw) != 3:
            raise ValueError(f"an image's grid_thw has 3 sizes, got {list(proto.grid_thw)}")
        t, h, w = proto.grid_thw
        return cls(proto.token_offset, proto.token_count, proto.sha256, (t, h, w))


@dataclass
class Segment:
    """A run of tokens with one origin. Model segments carry a logprob per token and the
    policy version that sampled them."""

    source: SegmentSource
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = 0

    def __post_init__(self) -> None:
        if self.source is SegmentSource.MODEL and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"a model segment needs one logprob per token: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} logprobs"
            )
        if self.source is not SegmentSource.MODEL and self.logprobs:
            raise ValueError(f"only model segments carry logprobs, not {self.source.name}")
        # The wire carries float32 logprobs; holding them at that precision makes the record
        # the same on both sides of the wire.
        self.logprobs = array.array("f", self.logprobs).tolist()


def model_segments(ids: list[int], logprobs: list[float], versions: list[int]) -> list[Segment]:
    """A model turn's segments: one per run of tokens sampled by the same policy version (a
    generation a weight push paused spans two), from the engine's ids, logprobs and versions."""
    segments = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or versions[end] != versions[start]:
            segments.append(
                Segment(SegmentSource.MODEL, ids[start:end], logprobs[start:end], versions[start])
            )
            start = end
    return segments


def appended_segments(
    source: SegmentSource, new_ids: list[int], generation_prompt_ids: list[int]
) -> list[Segment]:
    """The segments of ids appended after a model turn (`ConversationTokens.append_messages`):
    the messages as `source`, and the generation prompt that ends them as TEMPLATE."""
    opener = generation_prompt_ids
    if not opener or new_ids[-len(opener) :] != opener:
        return [Segment(source, list(new_ids))]
    return [
        Segment(source, new_ids[: -len(opener)]),
        Segment(SegmentSource.TEMPLATE, list(opener)),
    ]


@dataclass
class TurnMetrics:
    """Metrics of one model turn and the tool calls that followed it."""

    generated_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_seconds: float = 0.0
    generate_seconds: float = 0.0


@dataclass
class Trajectory:
    """A multi-turn rollout: built turn by turn by the agent loop, finished once it has a
    `finish_reason`. `messages` is the conversation (OpenAI dicts), the prompt's first."""

    trajectory_id: str
    group_id: str
    sample_index: int
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # None while it runs
    data_source: str = ""
    error_message: str = ""
    turns: list[TurnMetrics] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    reward: common_pb2.Reward | None = None
    turn_rewards: list[TurnReward] = field(default_factory=list)
    images: list[TrajectoryImage] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for segment in self.segments for t in segment.token_ids]

    @property
    def loss_mask(self) -> list[bool]:
        """True on model-sampled tokens only."""
        return self._mask_of(lambda source: source is SegmentSource.MODEL)

    @property
    def response_mask(self) -> list[bool]:
        """True on every token after the prompt."""
        return self._mask_of(lambda source: source is not SegmentSource.PROMPT)

    def _mask_of(self, marks: Callable[[SegmentSource], bool]) -> list[bool]:
        """One flag per token, its segment's; built a segment at a time, since `from_proto`
        checks both masks of every trajectory the trainer receives (per token, 80% of its time
        on 9k-token trajectories)."""
        mask: list[bool] = []
        for segment in self.segments:
            mask += [marks(segment.source)] * len(segment.token_ids)
        return mask

    @property
    def rollout_logprobs(self) -> list[float]:
        """The engine's logprob of every model token; 0 on the other tokens."""
        return [
            logprob
            for segment in self.segments
            for logprob in (segment.logprobs or [0.0] * len(segment.token_ids))
        ]

    @property
    def policy_versions(self) -> list[int]:
        """The policy version of each model segment, in order (a generation a weight push
        paused spans two)."""
        return [s.policy_version for s in self.segments if s.source is SegmentSource.MODEL]

    @property
    def parts(self) -> list[tuple[int, int]]:
        """The [start, end) token positions of each part: one for a trajectory that is one
        context, a part more for each PROMPT segment that follows another source."""
        starts, position, previous = [0], 0, SegmentSource.PROMPT
        for segment in self.segments:
            if segment.source is SegmentSource.PROMPT and previous is not SegmentSource.PROMPT:
                starts.append(position)
            position += len(segment.token_ids)
            previous = segment.source
        return list(zip(starts, [*starts[1:], position], strict=True))

    def model_turn_spans(self) -> list[tuple[int, int]]:
        """The [start, end) token positions of each model turn: a run of consecutive MODEL
        segments (a generation a weight push paused is two segments, one turn)."""
        spans: list[tuple[int, int]] = []
        position, previous = 0, None
        for segment in self.segments:
            end = position + len(segment.token_ids)
            if segment.source is SegmentSource.MODEL:
                if previous is SegmentSource.MODEL:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((position, end))
            position, previous = end, segment.source
        return spans

    @property
    def prompt_length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.source is SegmentSource.PROMPT)

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def to_proto(self) -> common_pb2.Trajectory:
        assert self.finish_reason is not None, "only a finished trajectory goes on the wire"
        proto = common_pb2.Trajectory(
            trajectory_id=self.trajectory_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            segments=[
                common_pb2.Segment(
                    source=s.source.value,
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    policy_version=s.policy_version,
                )
                for s in self.segments
            ],
            loss_mask=self.loss_mask,
            response_mask=self.response_mask,
            messages=[dict_to_message(m) for m in self.messages],
            finish_reason=self.finish_reason.value,
            error_message=self.error_message,
            turns=[common_pb2.TurnMetrics(**vars(turn)) for turn in self.turns],
            metrics=self.metrics,
            data_source=self.data_source,
            turn_rewards=[reward.to_proto() for reward in self.turn_rewards],
            images=[image.to_proto() for image in self.images],
        )
        if self.reward is not None:
            proto.reward.CopyFrom(self.reward)
        return proto

    @classmethod
    def from_proto(cls, proto: common_pb2.Trajectory) -> "Trajectory":
        """The record `to_proto` wrote. Raises InvalidArgumentError when the wire's masks
        disagree with its segments, a segment or message is malformed, or a turn reward names
        a turn the trajectory does not have."""
        where = f"trajectory {proto.trajectory_id!r}"
        try:
            segments = [
                Segment(
                    SegmentSource(s.source),
                    list(s.token_ids),
                    list(s.logprobs),
                    s.policy_version,
                )
                for s in proto.segments
            ]
            finish_reason = FinishReason(proto.finish_reason)
            turn_rewards = [TurnReward.from_proto(r) for r in proto.turn_rewards]
            images = [TrajectoryImage.from_proto(image) for image in proto.images]
            messages = [message_to_dict(m) for m in proto.messages]
        except ValueError as e:
            raise InvalidArgumentError(f"{where}: {e}") from None
        trajectory = cls(
            trajectory_id=proto.trajectory_id,
            group_id=proto.group_id,
            sample_index=proto.sample_index,
            segments=segments,
            messages=messages,
            finish_reason=finish_reason,
            data_source=proto.data_source,
            error_message=proto.error_message,
            turns=[
                TurnMetrics(
                    generated_tokens=turn.generated_tokens,
                    tool_calls=turn.tool_calls,
                    tool_errors=turn.tool_errors,
                    tool_latency_seconds=turn.tool_latency_seconds,
                    generate_seconds=turn.generate_seconds,
                )
                for turn in proto.turns
            ],
            metrics=dict(proto.metrics),
            reward=_copy(proto.reward) if proto.HasField("reward") else None,
            turn_rewards=turn_rewards,
            images=images,
        )
        for name in ("loss_mask", "response_mask"):
            if list(getattr(proto, name)) != getattr(trajectory, name):
                raise InvalidArgumentError(f"{where}: {name} disagrees with its segments")
        turns = len(trajectory.model_turn_spans())
        for reward in turn_rewards:
            if not 0 <= reward.turn < turns:
                raise InvalidArgumentError(
                    f"{where}: a {reward.source.name.lower()} reward from {reward.name!r} is "
                    f"for turn {reward.turn}, but the trajectory has {turns} model turns"
                )
        _check_images(trajectory, where)
        return trajectory


def _check_images(trajectory: Trajectory, where: str) -> None:
    """Raises InvalidArgumentError unless the images' tokens come one after another, inside the
    trajectory, on tokens the model did not sample, as many as image parts in its messages."""
    loss_mask, end = trajectory.loss_mask, 0
    for index, image in enumerate(trajectory.images):
        span = range(image.token_offset, image.token_offset + image.token_count)
        if image.token_count <= 0 or span.start < end or span.stop > len(loss_mask):
            raise InvalidArgumentError(
                f"{where}: image {index}'s tokens [{span.start}, {span.stop}) are not after the "
                f"image before it (at {end}) and within the {len(loss_mask)} tokens"
            )
        if any(loss_mask[position] for position in span):
            raise InvalidArgumentError(
                f"{where}: image {index}'s tokens [{span.start}, {span.stop}) overlap tokens "
                "the model sampled"
            )
        end = span.stop
    parts = sum(
        part.get("type") == "image_url"
        for message in trajectory.messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )
    if parts != len(trajectory.images):
        raise InvalidArgumentError(
            f"{where}: {len(trajectory.images)} image records for {parts} images in its messages"
        )


def _copy(reward: common_pb2.Reward) -> common_pb2.Reward:
    copy = common_pb2.Reward()
    copy.CopyFrom(reward)
    return copy
