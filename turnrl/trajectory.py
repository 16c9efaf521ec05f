"""The trajectory: the unit of truth between the rollout service and the trainer.

A trajectory is a list of segments, each a run of token ids with one source. The token
sequence is their concatenation. `loss_mask` is 1 on model-sampled tokens only;
`response_mask` is 1 on every token after the prompt. They are different things and stay
separate fields. Both are derived from the segments, so they cannot disagree with them.
"""

import enum
from dataclasses import dataclass, field
from typing import Any

from turnrl.messages import dict_to_message
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


@dataclass
class Segment:
    """A run of tokens with one origin. Model segments carry a logprob per token and the
    policy version that sampled them."""

    source: SegmentSource
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = 0

    def __post_init__(self) -> None:
        if self.source is SegmentSource.MODEL:
            assert len(self.logprobs) == len(self.token_ids), "one logprob per model token"
        else:
            assert not self.logprobs, "only model segments carry logprobs"


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
    """A finished multi-turn rollout."""

    trajectory_id: str
    group_id: str
    sample_index: int
    segments: list[Segment]
    messages: list[dict[str, Any]]
    finish_reason: FinishReason
    data_source: str = ""
    error_message: str = ""
    turns: list[TurnMetrics] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    reward: common_pb2.Reward | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for segment in self.segments for t in segment.token_ids]

    @property
    def loss_mask(self) -> list[bool]:
        """True on model-sampled tokens only."""
        return [
            segment.source is SegmentSource.MODEL
            for segment in self.segments
            for _ in segment.token_ids
        ]

    @property
    def response_mask(self) -> list[bool]:
        """True on every token after the prompt."""
        return [
            segment.source is not SegmentSource.PROMPT
            for segment in self.segments
            for _ in segment.token_ids
        ]

    @property
    def prompt_length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.source is SegmentSource.PROMPT)

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def to_proto(self) -> common_pb2.Trajectory:
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
        )
        if self.reward is not None:
            proto.reward.CopyFrom(self.reward)
        return proto
