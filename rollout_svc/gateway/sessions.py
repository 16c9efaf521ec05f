"""Chat sessions: each one a `Trajectory` that an agent's chat-completions requests build turn
by turn on the rollout service's engine. A plain async class; `app.py` is its HTTP skin.

A request is checked against what its session recorded by the prefix rule (`history.py`): the
current part's whole history sent back as it was generated, then new tool or user messages,
appended with the delta rule; a request that rewrote that history starts a new part (or is
refused, with `gateway.history_rewrites: refuse`). A request that repeats the previous request's messages exactly is a retry (the
agent never received the answer) and replaces that answer: the session rolls back to before it
and samples again.

Model turns go into the trajectory with their logprobs and policy versions (in the loss);
prompts, tool results, user turns and the template's generation prompts are masked. Nothing is
recorded until the engine has answered, so a request that fails leaves the session as it was.
One request runs per session at a time (a second is refused with FailedPreconditionError), and
a session that ended is refused the same way. A request's images are checked, processed and
placed as session_images.py says.
"""

import asyncio
import copy
import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rollout_svc.agent_loop import RolloutLimits, turn_seed
from rollout_svc.engines.base import Engine, GenerateOutput, SamplingParams
from rollout_svc.engines.base import FinishReason as EngineFinish
from rollout_svc.engines.stop_strings import find_stop, stop_string_token_count
from rollout_svc.gateway import history
from rollout_svc.gateway.requests import ChatCompletionRequest, RequestFieldError
from rollout_svc.gateway.session_images import SessionImages
from rollout_svc.gateway.session_state import (
    EpisodeSettings,
    ModelTurn,
    PendingTurn,
    Session,
    SessionState,
    check_session_id,
    engine_session,
    session_trajectory,
)
from rollout_svc.parsers import ParsedTurn
from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import (
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from turnrl.images import LoadedImage
from turnrl.messages import openai_tool_call
from turnrl.trajectory import (
    FinishReason,
    Segment,
    SegmentSource,
    Trajectory,
    TurnMetrics,
    appended_segments,
    model_segments,
)
from turnrl.vision import with_image_placeholders

# Ended sessions remembered, so that reusing one is refused, not a fresh session.
ENDED_SESSIONS_KEPT = 65_536


class ChatSessions:
    """The gateway's sessions on one engine. A request is `claim`, `prepare`, `generate`, and
    `release` however it ends; it batches with the rollout's own, through `Engine.generate`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        chat_template: str | None,
        parser: Callable[[str], ParsedTurn],
        limits: RolloutLimits,
        model_name: str,
        max_sessions: int,
        new_part_on_rewrite: bool,
        images: SessionImages,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self._engine = engine
        self._chat_template = chat_template
        self._parser = parser
        self._limits = limits
        self._max_sessions = max_sessions
        self._new_part_on_rewrite = new_part_on_rewrite  # else a rewritten history is refused
        self._images = images
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def check_model(self, model: str) -> None:
        """Raises NotFoundError unless `model` is the served model's name."""
        if model != self.model_name:
            raise NotFoundError(
                f"model {model!r} is not served here; the model is {self.model_name!r}"
            )

    @property
    def parser(self) -> Callable[[str], ParsedTurn]:
        """The parser that reads a turn's tool calls from its text."""
        return self._parser

    def claim(self, session_id: str, model: str) -> "Session":
        """The session, held for one request until `release` (created by its first request).
        Raises NotFoundError for another model than the served one, InvalidArgumentError for a
        malformed session id, FailedPreconditionError while another request of the session
        runs or after it ended, ResourceExhaustedError when a new one would pass
        `max_sessions`."""
        self.check_model(model)
        check_session_id(session_id)
        self._check_not_ended(session_id)
        if session_id not in self._sessions and len(self._sessions) >= self._max_sessions:
            raise ResourceExhaustedError(
                f"{len(self._sessions)} sessions are open, gateway.max_sessions; end one first"
            )
        session = self._sessions.setdefault(session_id, Session(session_id))
        if session.busy:
            raise FailedPreconditionError(
                f"session {session_id!r} has a request running; a session takes one at a time"
            )
        if session.closing:
            raise FailedPreconditionError(f"session {session_id!r} is ending")
        session.busy = True
        session.idle.clear()
        return session

    def release(self, session: "Session") -> None:
        """Lets the session take its next request; forgets it when none has succeeded yet
        (unless the rollout service opened it for an episode)."""
        session.busy = False
        session.idle.set()
        if session.state.tokens is None and session.episode is None:
            self._sessions.pop(session.session_id, None)

    def open(self, session_id: str, episode: EpisodeSettings) -> None:
        """Opens a session for an agent's episode, with the Generate call's sampling and
        limits; `close` ends it. Raises FailedPreconditionError for a session id in use."""
        check_session_id(session_id)
        self._check_not_ended(session_id)
        if session_id in self._sessions:
            raise FailedPreconditionError(f"session {session_id!r} is already open")
        self._sessions[session_id] = Session(session_id, episode=episode)

    async def close(self, session_id: str) -> Trajectory | None:
        """Ends an episode's session however its agent ended: a request still running (the
        agent was killed mid-request) is aborted and waited for, then the session ends. None
        when no request of it succeeded (the session is dropped)."""
        session = self._sessions[session_id]
        session.closing = True
        for request_id in session.engine_request_ids:
            await self._engine.abort(request_id)
        await session.idle.wait()
        if session.state.tokens is None:
            del self._sessions[session_id]
            self._remember_ended(session_id)
            return None
        return await self._finish(session)

    async def prepare(self, session: "Session", request: ChatCompletionRequest) -> "PendingTurn":
        """The request's messages checked against the session (the prefix rule) and
        tokenized, with the turn's sampling. Raises InvalidArgumentError for a bad request,
        image or history, FailedPreconditionError when the session's last turn cannot be
        continued (cut by max_tokens). Changes nothing in the session."""
        images = await asyncio.to_thread(self._images.load, request)
        messages = request.message_dicts(images)
        stop = tuple(request.stop_strings)
        base = session.state
        if session.last_request is not None and messages == session.last_request:
            base = session.before_last  # a retry: the answer it never received is replaced
        else:
            base = continued_choice([session.state, *session.other_choices], messages)
        assert base is not None
        if base.tokens is None:
            tools = request.tool_schemas()
            state = await self._new_part(SessionState(tools=tools), messages, images, stop)
        else:
            state = await self._next_turn(base, request, messages, images, stop)
        input_ids = [t for segment in state.segments for t in segment.token_ids]
        input_ids = input_ids[state.part_tokens :]  # the current part's context
        max_new_tokens = self._turn_budget(
            session,
            request.max_completion_tokens or request.max_tokens,
            len(input_ids),
            sum(len(s.token_ids) for s in state.segments if s.source is not SegmentSource.PROMPT),
            len(state.turns),
        )
        if session.episode is not None:  # the trainer's sampling, not the agent's
            episode_sampling = session.episode.sampling
            sampling = dataclasses.replace(
                episode_sampling,
                max_new_tokens=max_new_tokens,
                stop_token_ids=(),
                stop_strings=stop,
                seed=turn_seed(episode_sampling.seed, session.session_id, len(state.turns)),
            )
        else:
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                stop_strings=stop,
                seed=request.seed,
            )
        return PendingTurn(session, request, messages, base, state, input_ids, sampling)

    async def generate(
        self,
        pending: "PendingTurn",
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[ModelTurn]:
        """Samples the request's `n` choices of the turn on the engine, at once, and records
        them in the session: the first as its state, the others as choices a later request
        may continue instead (`continued_choice`); `on_tokens(choice, ids)` gets each choice's
        ids as the engine samples them (`Engine.generate`). Raises UnavailableError,
        recording nothing, when the engine could not answer (its weights mid-push, the request
        aborted)."""
        session, state = pending.session, pending.state
        started = time.monotonic()
        if session.closing:
            raise UnavailableError(f"session {session.session_id!r} is ending")
        turn = f"gateway/{session.session_id}/{len(state.turns)}/{time.monotonic_ns()}"
        session.engine_request_ids = [f"{turn}/{i}" for i in range(pending.request.choices)]
        samples = [
            self._engine.generate(
                pending.input_ids,
                dataclasses.replace(pending.sampling, seed=_choice_seed(pending.sampling, i)),
                request_id=request_id,
                session_id=engine_session(session.session_id),
                images=state.part_images,
                on_tokens=None if on_tokens is None else functools.partial(on_tokens, i),
            )
            for i, request_id in enumerate(session.engine_request_ids)
        ]
        try:
            outputs = await asyncio.gather(*samples, return_exceptions=True)
        finally:
            session.engine_request_ids = []
        for output in outputs:
            if isinstance(output, FailedPreconditionError):  # the weights are mid-push
                raise UnavailableError(str(output)) from output
            if isinstance(output, BaseException):
                raise output
            if output.finish_reason is EngineFinish.ABORT or not output.output_ids:
                raise UnavailableError(
                    f"the engine ended the turn with {output.finish_reason.value!r} after "
                    f"{len(output.output_ids)} tokens; nothing was recorded, send the request "
                    "again"
                )
        seconds = time.monotonic() - started
        choices = [self._choice(pending, output, seconds) for output in outputs]
        session.state, session.other_choices = choices[0][0], [c[0] for c in choices[1:]]
        session.before_last, session.last_request = pending.base, pending.messages
        return [turn for _, turn in choices]

    def _choice(
        self, pending: "PendingTurn", output: GenerateOutput, seconds: float
    ) -> tuple[SessionState, ModelTurn]:
        """The session's state after one choice of the turn, and the turn."""
        message, finish = self._assistant_message(pending, output.output_ids, output.finish_reason)
        # The ids that spell the stop string the turn ended on, if it did (kept as sampled).
        spelled = 0
        if output.finish_reason is EngineFinish.STOP:
            decode = self.tokenizer.decode
            spelled = stop_string_token_count(
                decode, output.output_ids, pending.sampling.stop_strings
            )
        tokens = copy.copy(pending.state.tokens)  # each choice appends to a copy of its own
        assert tokens is not None
        tokens.append_model_turn(output.output_ids, message, spelled > 0)
        turn_metrics = TurnMetrics(
            generated_tokens=len(output.output_ids),
            tool_calls=len(message.get("tool_calls", ())),
            generate_seconds=seconds,
        )
        state = dataclasses.replace(
            pending.state,
            tokens=tokens,
            segments=[
                *pending.state.segments,
                *model_segments(output.output_ids, output.logprobs, output.policy_versions),
            ],
            messages=[*pending.state.messages, message],
            turns=[*pending.state.turns, turn_metrics],
            last_finish=output.finish_reason,
        )
        stop_token_count = 0 if finish == "length" else spelled or 1  # else its stop token
        turn = ModelTurn(
            message,
            finish,
            output.output_ids,
            output.logprobs,
            len(pending.input_ids),
            stop_token_count,
        )
        return state, turn

    async def end(self, session_id: str) -> Trajectory:
        """Ends a session and returns its trajectory. NotFoundError for an unknown session;
        FailedPreconditionError while a request of it runs, after it ended, or for an
        episode's session (the rollout service ends those: `close`)."""
        check_session_id(session_id)
        self._check_not_ended(session_id)
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"session {session_id!r} is unknown; none of its requests ran")
        if session.episode is not None:
            raise FailedPreconditionError(
                f"session {session_id!r} is an episode's: it ends when the agent returns"
            )
        if session.busy:
            raise FailedPreconditionError(f"session {session_id!r} has a request running")
        return await self._finish(session)

    async def _finish(self, session: Session) -> Trajectory:
        """Forgets the session (keeping its id as ended) and frees its engine cache."""
        del self._sessions[session.session_id]
        self._remember_ended(session.session_id)
        await self._engine.end_session(engine_session(session.session_id))
        return session_trajectory(session)

    def _remember_ended(self, session_id: str) -> None:
        self._ended[session_id] = None
        if len(self._ended) > ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)

    def _check_not_ended(self, session_id: str) -> None:
        if session_id in self._ended:
            raise FailedPreconditionError(f"session {session_id!r} has ended")

    async def _new_part(
        self,
        base: SessionState,
        messages: list[dict[str, Any]],
        images: list[LoadedImage],
        stop: tuple[str, ...],
    ) -> SessionState:
        """`base` with a new part: `messages` (with their `images`) rendered as its prompt (a
        first request's, with the session's tools)."""
        tokens = ConversationTokens(
            self.tokenizer, self._chat_template, base.tools, vision=self._images.vision
        )
        part_tokens = sum(len(segment.token_ids) for segment in base.segments)
        prompt_ids, part_images, records = await self._images.tokenized(
            functools.partial(tokens.prompt_ids, messages), images, part_tokens, 0
        )
        return dataclasses.replace(
            base,
            tokens=tokens,
            stop_strings=stop,
            segments=[*base.segments, Segment(SegmentSource.PROMPT, prompt_ids)],
            messages=[*base.messages, *(dict(m) for m in messages)],
            part_messages=len(base.messages),
            part_tokens=part_tokens,
            turns=list(base.turns),
            part_images=part_images,
            images=[*base.images, *records],
        )

    async def _next_turn(
        self,
        base: SessionState,
        request: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        images: list[LoadedImage],
        stop: tuple[str, ...],
    ) -> SessionState:
        """`base` with the request's new messages appended (the prefix rule), or a new part."""
        if request.tool_schemas() != base.tools:
            raise RequestFieldError(
                "tools differ from the session's first request; a session keeps its tools", "tools"
            )
        if stop != base.stop_strings:
            raise RequestFieldError(
                "stop differs from the session's first request; a session keeps its stop", "stop"
            )
        try:
            new_messages = history.new_messages(base.messages[base.part_messages :], messages)
        except history.HistoryRewrittenError:
            if not self._new_part_on_rewrite:
                raise
            return await self._new_part(base, messages, images, stop)
        # The history's images are the session's already: only the new messages' are placed.
        new_images = images[len(images) - with_image_placeholders(new_messages)[1] :]
        tokens = copy.copy(base.tokens)  # the session's own changes only on commit
        assert tokens is not None
        length = sum(len(segment.token_ids) for segment in base.segments)
        new_ids, part_images, records = await self._images.tokenized(
            functools.partial(tokens.append_messages, new_messages),
            new_images,
            base.part_tokens,
            length - base.part_tokens,
        )
        roles = {m["role"] for m in new_messages}
        source = SegmentSource.TOOL if roles == {"tool"} else SegmentSource.USER
        return dataclasses.replace(
            base,
            tokens=tokens,
            segments=[
                *base.segments,
                *appended_segments(source, new_ids, tokens.generation_prompt_ids),
            ],
            messages=[*base.messages, *new_messages],
            turns=list(base.turns),
            part_images=[*base.part_images, *part_images],
            images=[*base.images, *records],
        )

    def _turn_budget(
        self, session: Session, asked: int | None, length: int, response_length: int, turns: int
    ) -> int:
        """A turn's max_new_tokens: `asked` (None: max_new_tokens) within the session's limits
        (its episode's, else the rollout's), for a context (the current part) of `length`
        tokens, after `response_length` tokens past the prompts (all parts') and `turns` model
        turns. Raises RequestFieldError when no token fits or an episode has had its
        max_turns, and records which limit it was."""
        limits = self._limits if session.episode is None else session.episode.limits
        budget = limits.turn_budget(length, response_length)
        if session.episode is not None and turns >= limits.max_turns:
            session.limit_reached = FinishReason.MAX_TURNS
            raise RequestFieldError(
                f"the episode has had its {limits.max_turns} model turns (max_turns); end it",
                "messages",
            )
        if budget <= 0:
            session.limit_reached = (
                FinishReason.MAX_MODEL_LEN
                if length >= limits.max_model_len
                else FinishReason.MAX_RESPONSE_LENGTH
            )
            raise RequestFieldError(
                f"the session's context holds {length} tokens and its responses "
                f"{response_length}: no room for a turn under max_model_len "
                f"{limits.max_model_len} and max_response_length "
                f"{limits.max_response_length}; end the session",
                "messages",
            )
        return min(asked, budget) if asked else budget

    def _assistant_message(
        self, pending: "PendingTurn", output_ids: list[int], finish: EngineFinish
    ) -> tuple[dict[str, Any], str]:
        """The assistant message that stands for the model's ids, and OpenAI's finish reason.
        A turn with a malformed call is returned as its text, so the agent sees what the
        model wrote; a turn that ended on a stop string, as its text before it."""
        tokens = pending.state.tokens
        assert tokens is not None
        text = tokens.model_turn_text(output_ids)
        if (
            finish is EngineFinish.STOP
            and (cut := find_stop(text, pending.sampling.stop_strings)) >= 0
        ):
            text = text[:cut]
        if finish is EngineFinish.LENGTH:
            return {"role": "assistant", "content": text}, "length"
        parsed = self._parser(text) if pending.request.calls_tools else None
        if parsed is None or parsed.errors or not parsed.tool_calls:
            return {"role": "assistant", "content": text}, "stop"
        turn = len(pending.state.turns)
        calls = [
            openai_tool_call(f"call_{turn}_{index}", call.name, call.arguments)
            for index, call in enumerate(parsed.tool_calls)
        ]
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, "tool_calls"


def continued_choice(choices: list[SessionState], messages: list[dict[str, Any]]) -> SessionState:
    """The first of a session's last-turn choices (its state first) whose current part
    `messages` continue by the prefix rule; the state when none does (a rewrite: a new part
    after it)."""
    for choice in choices:
        if choice.tokens is None:
            return choice
        try:
            history.new_messages(choice.messages[choice.part_messages :], messages)
        except RequestFieldError:
            continue
        return choice
    return choices[0]


def _choice_seed(sampling: SamplingParams, choice: int) -> int | None:
    """Choice 0 keeps the turn's seed; each other choice gets one of its own, so that the
    choices of a seeded request differ."""
    if choice == 0 or sampling.seed is None:
        return sampling.seed
    return turn_seed(sampling.seed, f"choice/{choice}", 0)
