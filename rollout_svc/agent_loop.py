"""The multi-turn agent loop: one (prompt, sample) from its first token to its reward.

generate -> parse tool calls -> call the tool service (the calls of one turn concurrently)
-> append the results -> generate again, until the model answers without a tool call (and no
interaction asks for more), `max_turns`, or a length limit. Every trajectory is its own asyncio
task, so a slow tool call holds up only its own trajectory.

Each run builds its `Trajectory` (turnrl/trajectory.py) turn by turn: the segments and the
conversation's messages live there and nowhere else. Token ids come from the engine as they are
and are never re-tokenized; only new non-model messages are tokenized, by `ConversationTokens`
(the chat template's difference rule), a prompt's or a tool result's images among them
(`TrajectoryImages`: processed, placed, and sent with every model turn). A malformed call, an unknown tool, a tool timeout or a
dead tool service becomes a tool message the model reads, never a lost trajectory. Whose fault
each failure is follows turnrl/failures.py: a call the system failed (the tool service down or
overloaded, the caller's deadline spent in its queue, a tool that could not start) is also
counted in the trajectory's `tool_infra_errors` metric, and a scorer's failure the system
caused comes back as `reward.error`; the trainer keeps both out of the loss.

Rewards of single model turns go on the trajectory's `turn_rewards` as they are given: a tool
call's `step_reward` on the turn that made the call, the interaction's score on the turn it
answered, and the scorer's per-turn rewards (`Reward.turn_rewards`) once it has graded the
trajectory. A scorer that rewards a turn the trajectory does not have is a broken scorer: the
reward is marked `error` (the system's failure), and its turn rewards are left out.
"""

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from rollout_svc.engines.base import Engine, SamplingParams
from rollout_svc.engines.base import FinishReason as EngineFinish
from rollout_svc.interactions.base import Interaction
from rollout_svc.parsers import ParsedTurn
from rollout_svc.tool_client import ToolClient
from rollout_svc.trajectory_images import TrajectoryImages
from rollout_svc.trajectory_tools import TrajectoryTools
from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import InvalidArgumentError, RpcError
from turnrl.images import ImageSettings, LoadedImage, load_message_images
from turnrl.messages import dict_to_message
from turnrl.replicas import ReplicaSet
from turnrl.trajectory import (
    FinishReason,
    Segment,
    SegmentSource,
    Trajectory,
    TurnMetrics,
    TurnReward,
    TurnRewardSource,
    appended_segments,
    model_segments,
)
from turnrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from turnrl.vision import VisionProcessor

log = logging.getLogger(__name__)

# The trajectory metric that sums each source's turn rewards.
TURN_REWARD_SUMS = {
    TurnRewardSource.TOOL: "tool_step_reward_sum",
    TurnRewardSource.INTERACTION: "interaction_score_sum",
    TurnRewardSource.SCORER: "scorer_turn_reward_sum",
}


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a Generate call, as plain Python values (verl's dataset row)."""

    prompt_id: str
    messages: list[dict[str, Any]]
    tool_names: list[str] = field(default_factory=list)  # as the tool service serves them
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_name: str = ""
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: list[LoadedImage] = field(default_factory=list)  # of `messages`, in order


@dataclass(frozen=True)
class RolloutLimits:
    """The three length limits and the turn limit of one Generate call."""

    max_model_len: int
    max_response_length: int
    max_new_tokens: int
    max_turns: int

    def turn_budget(self, length: int, response_length: int) -> int:
        """The most tokens the next model turn may sample after `length` tokens,
        `response_length` of them past the prompt: max_new_tokens within the room both length
        limits leave (0 or less: no room)."""
        return min(
            self.max_new_tokens,
            self.max_model_len - length,
            self.max_response_length - response_length,
        )


def turn_seed(seed: int | None, trajectory_id: str, turn: int) -> int | None:
    """The caller's seed made distinct per trajectory and turn: one seed for all would give
    the `n` samples of a prompt the same tokens."""
    if seed is None:
        return None
    key = f"{seed}/{trajectory_id}/{turn}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


@dataclass
class AgentLoop:
    """Everything a trajectory needs, shared by all of them."""

    engine: Engine
    tokenizer: Any
    chat_template: str | None
    parser: Callable[[str], ParsedTurn]  # a function of rollout_svc.parsers.PARSERS
    tool_client: ToolClient
    reward_replicas: ReplicaSet[reward_pb2_grpc.RewardServiceStub]
    interactions: dict[str, Interaction]
    tool_call_timeout_seconds: float
    reward_timeout_seconds: float
    # A vision-language model's image processor (None: a text-only model), and the limits on
    # the images of prompts and tool results.
    vision: VisionProcessor | None = None
    image_settings: ImageSettings = field(default_factory=ImageSettings)
    # Generate calls being aborted, and the engine requests running per call.
    aborted: set[str] = field(default_factory=set)
    engine_requests: dict[str, set[str]] = field(default_factory=dict)

    def with_images(self, prompt: PromptSpec, where: str) -> PromptSpec:
        """`prompt` with its messages' images loaded and checked (their bytes inlined in the
        messages). Raises InvalidArgumentError, naming the image, for one that fails its
        check, and for images given to a text-only model."""
        messages, images = load_message_images(prompt.messages, self.image_settings, where)
        if images and self.vision is None:
            raise InvalidArgumentError(
                f"{where} hold {len(images)} images, but the model is text-only: images need a "
                "vision-language model"
            )
        return dataclasses.replace(prompt, messages=messages, images=images)

    async def abort(self, request_id: str) -> None:
        """Ends the trajectories of one Generate call: their running engine requests stop
        now, and none of them starts another turn."""
        self.aborted.add(request_id)
        for engine_request_id in list(self.engine_requests.get(request_id, ())):
            await self.engine.abort(engine_request_id)

    def forget(self, request_id: str) -> None:
        """Drops the bookkeeping of a finished Generate call."""
        self.aborted.discard(request_id)
        self.engine_requests.pop(request_id, None)

    async def run(
        self,
        prompt: PromptSpec,
        tools: list[dict[str, Any]],
        sample_index: int,
        sampling: SamplingParams,
        limits: RolloutLimits,
        enable_scoring: bool,
        request_id: str,
    ) -> Trajectory:
        """Rolls out one sample of `prompt`, whose model may call `tools` (OpenAI schemas);
        never raises for the trajectory's sake."""
        run = _Run(self, prompt, tools, sample_index, sampling, limits, request_id)
        try:
            await run.start()
            await run.turns()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("trajectory %s failed", run.trajectory.trajectory_id)
            run.finish(FinishReason.ERROR, f"{type(e).__name__}: {e}")
        finally:
            await asyncio.shield(run.release())
        trajectory = run.finished()
        if enable_scoring:
            await self.score(prompt, trajectory)
        return trajectory

    async def score(
        self, prompt: PromptSpec, trajectory: Trajectory, answer: str | None = None
    ) -> None:
        """Sets `trajectory.reward` to the reward service's grade of it, whose response is
        `answer` when given (an agent's final answer), else its last assistant message, and
        appends the scorer's turn rewards. A reward service that cannot answer, or a scorer
        that rewards a turn the trajectory does not have, gives a Reward with `error` set (the
        trajectory is left out of the loss) and no turn rewards."""
        reward = await self._grade(prompt, trajectory, answer)
        turns = len(trajectory.model_turn_spans())
        outside = [r for r in reward.turn_rewards if not 0 <= r.turn < turns]
        if outside:
            message = (
                f"scorer {outside[0].name!r} rewarded turn {outside[0].turn}, but the "
                f"trajectory has {turns} model turns"
            )
            log.warning("trajectory %s: %s", trajectory.trajectory_id, message)
            reward = common_pb2.Reward(error=True, error_message=message)
        trajectory.reward = reward
        trajectory.turn_rewards += [
            TurnReward(r.turn, r.value, TurnRewardSource.SCORER, r.name)
            for r in reward.turn_rewards
        ]
        add_turn_reward_sums(trajectory)

    async def _grade(
        self, prompt: PromptSpec, trajectory: Trajectory, answer: str | None
    ) -> common_pb2.Reward:
        """The reward service's Reward for `trajectory`; one with `error` set when the service
        cannot answer."""
        scoring_input = reward_pb2.ScoringInput(
            data_source=prompt.data_source,
            response_text=_final_text(trajectory.messages) if answer is None else answer,
            messages=[dict_to_message(m) for m in trajectory.messages],
        )
        if prompt.ground_truth is not None:
            json_format.ParseDict(prompt.ground_truth, scoring_input.ground_truth)
        scoring_input.extra_info.update(prompt.extra_info)
        try:  # scoring is safe to repeat: tried again while the reward service restarts
            reply = await self.reward_replicas.call_with_retries(
                lambda stub: stub.Score,
                reward_pb2.ScoreRequest(input=scoring_input),
                timeout_seconds=self.reward_timeout_seconds,
            )
        except RpcError as e:
            message = f"reward service: {e.status}: {e.details}"
            return common_pb2.Reward(error=True, error_message=message)
        return reply.result.reward


class _Run:
    """One trajectory while it runs: the `Trajectory` it builds turn by turn, and the state
    its turns need (token differences, tool sessions, the interaction)."""

    def __init__(
        self,
        loop: AgentLoop,
        prompt: PromptSpec,
        tools: list[dict[str, Any]],
        sample_index: int,
        sampling: SamplingParams,
        limits: RolloutLimits,
        request_id: str,
    ) -> None:
        self.loop = loop
        self.prompt = prompt
        self.sampling = sampling
        self.limits = limits
        self.request_id = request_id
        self.trajectory = Trajectory(
            trajectory_id=f"{prompt.prompt_id}/{sample_index}",
            group_id=prompt.prompt_id,
            sample_index=sample_index,
            messages=[dict(m) for m in prompt.messages],
            data_source=prompt.data_source,
        )
        # The ids a model turn may end on: the tokenizer's end of turn and the call's stops.
        # Only a special token can be where the template itself ends a turn; a stop id of
        # ordinary text ("\n") ends the turn as a stop string does, and the template closes it.
        special_ids = special_token_ids(loop.tokenizer)
        self.text_stop_ids = frozenset(sampling.stop_token_ids) - special_ids
        turn_end_ids = [i for i in sampling.stop_token_ids if i in special_ids]
        self.tokens = ConversationTokens(
            loop.tokenizer,
            loop.chat_template,
            tools or None,
            prompt.chat_template_kwargs or None,
            stop_token_ids=[loop.tokenizer.eos_token_id, *turn_end_ids],
            vision=loop.vision,
        )
        self.images = TrajectoryImages(loop.vision, loop.image_settings)
        self.trajectory.images = self.images.records
        self.tools = TrajectoryTools(
            loop.tool_client, loop.tool_call_timeout_seconds, tools, prompt.tools_kwargs
        )
        self.interaction_state: Any = None
        self.tool_infra_errors = 0  # calls the tool service could not run

    async def start(self) -> None:
        images = self.prompt.images
        processed = await asyncio.to_thread(self.images.process, images)
        prompt_ids = await asyncio.to_thread(
            self.tokens.prompt_ids, self.trajectory.messages, processed
        )
        self.images.place(0, prompt_ids, images, processed)
        self.trajectory.segments.append(Segment(SegmentSource.PROMPT, prompt_ids))
        if self.prompt.interaction_name:
            interaction = self.loop.interactions.get(self.prompt.interaction_name)
            if interaction is None:
                raise ValueError(
                    f"unknown interaction {self.prompt.interaction_name!r}; "
                    f"configured: {sorted(self.loop.interactions)}"
                )
            self.interaction_state = await interaction.start(**self.prompt.interaction_kwargs)

    async def turns(self) -> None:
        for _ in range(self.limits.max_turns):
            # Nothing awaits between this check and `_model_turn` registering its engine
            # request, so an abort is either seen here or finds that request to abort.
            if self._aborted():
                return
            metrics = TurnMetrics()
            self.trajectory.turns.append(metrics)
            parsed = await self._model_turn(metrics)
            # An abort too late to stop the turn in the engine (the turn had ended, or a remote
            # engine had not taken the request in yet) still ends the trajectory before its
            # tool calls are made.
            if self.trajectory.finish_reason is not None or self._aborted():
                return
            new_images: list[LoadedImage] = []
            if parsed.tool_calls or parsed.errors:
                new_messages, new_images = await self._call_tools(parsed, metrics)
                source = SegmentSource.TOOL
            else:
                reply = await self._interaction_reply()
                if reply is None:
                    return
                new_messages = [{"role": "user", "content": reply}]
                source = SegmentSource.USER
            if not await self._append(new_messages, source, new_images):
                return
        self.finish(FinishReason.MAX_TURNS)

    def _aborted(self) -> bool:
        """Whether the Generate call is being aborted; if so the trajectory ends ABORTED."""
        if self.request_id in self.loop.aborted:
            self.finish(FinishReason.ABORTED)
            return True
        return False

    async def _model_turn(self, metrics: TurnMetrics) -> ParsedTurn:
        trajectory = self.trajectory
        token_ids = trajectory.token_ids
        budget = self.limits.turn_budget(len(token_ids), trajectory.response_length)
        if budget <= 0:
            limit = len(token_ids) >= self.limits.max_model_len
            self.finish(FinishReason.MAX_MODEL_LEN if limit else FinishReason.MAX_RESPONSE_LENGTH)
            return ParsedTurn(content="", tool_calls=[], errors=[])
        started = time.monotonic()
        turn = len(trajectory.turns)
        engine_request_id = f"{self.request_id}/{trajectory.trajectory_id}/{turn}"
        running = self.loop.engine_requests.setdefault(self.request_id, set())
        running.add(engine_request_id)
        try:
            output = await self.loop.engine.generate(
                token_ids,
                dataclasses.replace(
                    self.sampling,
                    max_new_tokens=budget,
                    seed=turn_seed(
                        self.sampling.seed,
                        self.trajectory.trajectory_id,
                        len(self.trajectory.turns),
                    ),
                ),
                request_id=engine_request_id,
                session_id=trajectory.trajectory_id,
                images=self.images.engine_images,
            )
        finally:
            running.discard(engine_request_id)
        metrics.generate_seconds = time.monotonic() - started
        metrics.generated_tokens = len(output.output_ids)
        if not output.output_ids and output.finish_reason is not EngineFinish.STOP:
            # Ended before its first token: aborted while it waited in the engine (a full
            # batch, a pause for a weight push), or no room left. There is no model turn to
            # append; the conversation ends as it was. (A STOP holds its stop token, so an
            # empty one is an engine bug, which `ConversationTokens` refuses.)
            self.trajectory.turns.pop()
            aborted = output.finish_reason is EngineFinish.ABORT
            self.finish(FinishReason.ABORTED if aborted else self._length_reason())
            return ParsedTurn(content="", tool_calls=[], errors=[])
        self.trajectory.segments += model_segments(
            output.output_ids, output.logprobs, output.policy_versions
        )
        # A stop id of ordinary text stays in the tokens and out of the message's text.
        on_text_stop = (
            output.finish_reason is EngineFinish.STOP
            and output.output_ids[-1] in self.text_stop_ids
        )
        text_ids = output.output_ids[:-1] if on_text_stop else output.output_ids
        text = self.tokens.model_turn_text(text_ids) if text_ids else ""
        # A turn cut short still joins the conversation, as it was written: its text is what
        # gets scored.
        if output.finish_reason in (EngineFinish.ABORT, EngineFinish.LENGTH):
            self._append_model_message(output.output_ids, {"role": "assistant", "content": text})
            aborted = output.finish_reason is EngineFinish.ABORT
            self.finish(FinishReason.ABORTED if aborted else self._length_reason())
            return ParsedTurn(content="", tool_calls=[], errors=[])
        parsed = self.loop.parser(text)
        self._append_model_message(output.output_ids, parsed.assistant_message(), on_text_stop)
        return parsed

    def _append_model_message(
        self, output_ids: list[int], message: dict[str, Any], on_text_stop: bool = False
    ) -> None:
        self.tokens.append_model_turn(output_ids, message, ended_on_stop_string=on_text_stop)
        self.trajectory.messages.append(message)

    def _length_reason(self) -> FinishReason:
        """Which limit a turn cut short by its token budget ran into."""
        if len(self.trajectory.token_ids) >= self.limits.max_model_len:
            return FinishReason.MAX_MODEL_LEN
        if self.trajectory.response_length >= self.limits.max_response_length:
            return FinishReason.MAX_RESPONSE_LENGTH
        return FinishReason.MAX_NEW_TOKENS

    async def _call_tools(
        self, parsed: ParsedTurn, metrics: TurnMetrics
    ) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
        """The tool results' messages, each call's in order, and their images."""
        started = time.monotonic()
        results = await asyncio.gather(
            *(self.tools.call(call.name, call.arguments) for call in parsed.tool_calls)
        )
        metrics.tool_latency_seconds = time.monotonic() - started
        metrics.tool_calls = len(parsed.tool_calls) + len(parsed.errors)
        messages, images = [], []
        turn = len(self.trajectory.turns) - 1
        for call, outcome in zip(parsed.tool_calls, results, strict=True):
            content, loaded, bad_image = self.images.tool_content(
                outcome.text, outcome.images, call.name
            )
            images += loaded
            metrics.tool_errors += outcome.failed or bad_image
            self.tool_infra_errors += outcome.infra_failed
            if outcome.step_reward is not None:
                reward = TurnReward(turn, outcome.step_reward, TurnRewardSource.TOOL, call.name)
                self.trajectory.turn_rewards.append(reward)
            messages.append(
                {
                    "role": "tool",
                    "content": content,
                    "tool_call_id": call.id,
                    "name": call.name,
                }
            )
        for error in parsed.errors:
            metrics.tool_errors += 1
            messages.append({"role": "tool", "content": f"Error: {error}"})
        return messages, images

    async def _interaction_reply(self) -> str | None:
        """The simulated user's next turn, or None when the conversation is over."""
        if not self.prompt.interaction_name:
            self.finish(FinishReason.STOP)
            return None
        name = self.prompt.interaction_name
        reply = await self.loop.interactions[name].respond(
            self.interaction_state, self.trajectory.messages
        )
        if reply.score is not None:  # of the model turn it answers, the last one
            turn = len(self.trajectory.turns) - 1
            reward = TurnReward(turn, reply.score, TurnRewardSource.INTERACTION, name)
            self.trajectory.turn_rewards.append(reward)
        if reply.terminate:
            self.finish(FinishReason.INTERACTION_TERMINATED)
            return None
        return reply.text

    async def _append(
        self,
        messages: list[dict[str, Any]],
        source: SegmentSource,
        images: list[LoadedImage] | None = None,
    ) -> bool:
        """Appends non-model messages (with their `images`, in order) and the next generation
        prompt; False when that would pass a length limit (the trajectory then ends without
        them)."""
        trajectory = self.trajectory
        images = images or []
        processed = await asyncio.to_thread(self.images.process, images)
        new_ids = await asyncio.to_thread(self.tokens.append_messages, messages, processed)
        if len(trajectory.token_ids) + len(new_ids) >= self.limits.max_model_len:
            self.finish(FinishReason.MAX_MODEL_LEN)
            return False
        if trajectory.response_length + len(new_ids) >= self.limits.max_response_length:
            self.finish(FinishReason.MAX_RESPONSE_LENGTH)
            return False
        self.images.place(len(trajectory.token_ids), new_ids, images, processed)
        trajectory.messages.extend(messages)
        trajectory.segments += appended_segments(source, new_ids, self.tokens.generation_prompt_ids)
        return True

    def finish(self, reason: FinishReason, error_message: str = "") -> None:
        if self.trajectory.finish_reason is None:
            self.trajectory.finish_reason = reason
            self.trajectory.error_message = error_message

    async def release(self) -> None:
        """Releases the tool sessions, the interaction state and the engine's session cache."""
        await self.tools.release()
        if self.interaction_state is not None:
            await self.loop.interactions[self.prompt.interaction_name].finish(
                self.interaction_state
            )
        await self.loop.engine.end_session(self.trajectory.trajectory_id)

    def finished(self) -> Trajectory:
        """The trajectory with its summary metrics; one that never finished is an ERROR."""
        trajectory = self.trajectory
        assert trajectory.finish_reason is not None, "every way out of `turns` finishes it"
        turns = trajectory.turns
        model_tokens = sum(trajectory.loss_mask)
        trajectory.metrics = {
            "turns": float(len(turns)),
            "model_tokens": float(model_tokens),
            "tool_calls": float(sum(t.tool_calls for t in turns)),
            "tool_errors": float(sum(t.tool_errors for t in turns)),
            "tool_infra_errors": float(self.tool_infra_errors),  # also counted in tool_errors
            "images": float(len(trajectory.images)),
            "tool_images_unseen": float(self.images.unseen),  # a text-only model's
        }
        add_turn_reward_sums(trajectory)
        return trajectory


def add_turn_reward_sums(trajectory: Trajectory) -> None:
    """Sets the sum of each source's turn rewards in the trajectory's metrics."""
    for source, name in TURN_REWARD_SUMS.items():
        rewards = (r.value for r in trajectory.turn_rewards if r.source is source)
        trajectory.metrics[name] = float(sum(rewards))


@functools.cache
def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (EOS, the chat markers), which no text encodes."""
    added = (i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset([*tokenizer.all_special_ids, *added])


def _final_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message["role"] == "assistant":
            content = message.get("content") or ""
            return content if isinstance(content, str) else json.dumps(content)
    return ""
