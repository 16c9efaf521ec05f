"""The gateway's HTTP skin: a Starlette app over `ChatSessions`, served by uvicorn in the rollout
service's own event loop (`serve_gateway`), on a port of its own.

Routes (the `openai` client takes `base_url=http://HOST:PORT/sessions/<id>/v1` as it is):

- `GET /v1/models` and `GET /sessions/{id}/v1/models`: the served model;
- `POST /sessions/{id}/v1/chat/completions`: one model turn of session `id` (created by its
  first request), its `n` choices sampled at once, streamed as server-sent events with
  `stream: true`;
- `POST /sessions/{id}/end`: ends the session and returns its trajectory as JSON.

The gateway serves with the rollout service's `server` settings: HTTPS with its certificate
(`server.tls`; client certificates required with `client_ca_file`), and with
`server.auth_token_env` every route requires `Authorization: Bearer <token>` (the `openai`
client sends its api_key so), answering 401 without it.

Errors have OpenAI's shape and status: 400 for a bad request or history, 401 for a missing or
wrong token, 404 for an unknown route, model or session, 409 for a second request on a busy
session or one that ended (or whose last turn cannot be continued), 413 for a body over
`gateway.max_request_bytes`, 503 when the engine could not answer. A stream sends each
choice's role chunk once the request is checked, then content deltas as the engine samples tokens (the hf
engine per token, the server engines in one piece at the end: `Engine.generate`), holding back
text that may yet be a tool call or change (streamed_content.py); once the turn is recorded,
the rest of its content, its tool calls, finish and usage. An error after the first chunk comes
as an `error` event. A client that leaves a stream cancels its engine request and nothing is
recorded; one that leaves a plain request has its turn recorded, and its retry replaces that
turn (sessions.py).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_svc.config import GatewayConfig
from rollout_svc.gateway import replies
from rollout_svc.gateway.requests import ChatCompletionRequest, parse_request
from rollout_svc.gateway.session_state import PendingTurn
from rollout_svc.gateway.sessions import ChatSessions
from rollout_svc.gateway.streamed_content import StreamedContent
from turnrl.asgi_server import (
    STOP_TIMEOUT_SECONDS,
    BearerTokenMiddleware,
    RequestTooLargeError,
    read_body,
    serve_asgi,
)
from turnrl.config import ServerConfig
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)

log = logging.getLogger(__name__)

STATUS_BY_ERROR: list[tuple[type[Exception], int]] = [
    (InvalidArgumentError, 400),
    (NotFoundError, 404),
    (FailedPreconditionError, 409),
    (ResourceExhaustedError, 429),
    (UnavailableError, 503),
    (DeadlineExceededError, 503),
]


def build_app(sessions: ChatSessions, max_request_bytes: int, token: str | None) -> Starlette:
    """The gateway's ASGI app over `sessions`; with `token`, every route requires it."""
    created = int(time.time())
    tokenizer = sessions.tokenizer

    async def models(request: Request) -> Response:
        return JSONResponse(replies.model_list(sessions.model_name, created))

    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, max_request_bytes)
        chat = await asyncio.to_thread(parse_request, body)
        session = sessions.claim(request.path_params["session_id"], chat.model)
        try:
            pending = await sessions.prepare(session, chat)
        except BaseException:
            sessions.release(session)
            raise
        completion_id, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if chat.stream:
            events = _stream(sessions, tokenizer, pending, chat, completion_id, now)
            return _EventStream(events, on_close=lambda: sessions.release(session))
        try:
            turns = await sessions.generate(pending)
        finally:
            sessions.release(session)
        logprobs = [replies.token_logprobs(tokenizer, t) if chat.logprobs else None for t in turns]
        reply = replies.completion(completion_id, now, chat.model, turns, logprobs)
        return JSONResponse(reply)

    async def end(request: Request) -> Response:
        trajectory = await sessions.end(request.path_params["session_id"])
        return JSONResponse(replies.trajectory_json(trajectory))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/sessions/{session_id}/v1/models", models, methods=["GET"]),
        Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/sessions/{session_id}/end", end, methods=["POST"]),
    ]
    # Each domain error its own handler: one for Exception alone would re-raise after answering.
    handlers = {error_type: _error for error_type, _ in STATUS_BY_ERROR}
    return Starlette(
        routes=routes,
        middleware=[Middleware(BearerTokenMiddleware, token=token, refusal=_token_refusal)]
        if token
        else [],
        exception_handlers={
            HTTPException: _http_error,
            RequestTooLargeError: _error,
            **handlers,
            Exception: _error,
        },
    )


@contextlib.asynccontextmanager
async def serve_gateway(
    config: GatewayConfig, server: ServerConfig, sessions: ChatSessions
) -> AsyncIterator[str]:
    """Serves the gateway in this event loop on `config.host:config.port` (0: a free port),
    with the TLS and bearer token of the rollout service's gRPC `server`
    (turnrl.asgi_server.serve_asgi); yields its base URL, `http://HOST:PORT` (`https://` with
    TLS), and stops it on exit. Raises OSError when the address cannot be bound, ConfigError
    when the TLS files cannot be loaded, the token's variable is unset, or the host is one other
    machines reach and the gateway would have neither TLS nor a token."""
    app = build_app(sessions, config.max_request_bytes, server.auth_token())
    async with serve_asgi(
        app, config.host, config.port, server, setting="gateway.host", name="gateway"
    ) as url:
        yield url


async def _stream(
    sessions: ChatSessions,
    tokenizer,
    pending: PendingTurn,
    chat: ChatCompletionRequest,
    completion_id: str,
    created: int,
) -> AsyncGenerator[str]:
    """The events of a streamed turn: each choice's role, its content as it is sampled, then,
    once the turn is recorded, the rest of each choice's content, its tool calls and finish;
    usage, `[DONE]`."""
    with_usage = bool(chat.stream_options and chat.stream_options.include_usage)

    def chunk(delta, **fields) -> str:
        return replies.chunk(
            completion_id, created, chat.model, delta, with_usage=with_usage, **fields
        )

    for index in range(chat.choices):
        yield chunk({"role": "assistant", "content": "", "refusal": None}, index=index)
    assert pending.state.tokens is not None
    contents = [
        StreamedContent(pending.state.tokens, chat, sessions.parser, tokenizer)
        for _ in range(chat.choices)
    ]
    sampled = asyncio.Event()  # set by new ids and by the end of the turn

    def on_tokens(choice: int, ids: list[int]) -> None:
        contents[choice].extend(ids)
        sampled.set()

    generation = asyncio.create_task(sessions.generate(pending, on_tokens))
    generation.add_done_callback(lambda _: sampled.set())
    try:
        while not generation.done():
            await sampled.wait()
            sampled.clear()
            for index, content in enumerate(contents):
                if delta := content.delta():
                    yield chunk({"content": delta}, index=index)
    finally:
        await _cancel(generation)
    try:
        turns = generation.result()
    except Exception as e:
        status, param = _status(e)
        yield replies.event(replies.error_body(status, str(e), param))
        return
    for index, (turn, content) in enumerate(zip(turns, contents, strict=True)):
        logprobs = replies.token_logprobs(tokenizer, turn) if chat.logprobs else None
        # The turn's logprobs ride on its first delta after the turn (the finish chunk's, when
        # it has none), so a client that gathers them gets all of them, as a plain reply does.
        for delta in replies.turn_deltas(turn, streamed=content.sent):
            yield chunk(delta, index=index, logprobs=logprobs)
            logprobs = None
        yield chunk({}, index=index, finish_reason=turn.finish_reason, logprobs=logprobs)
    if with_usage:
        yield chunk(None, turn_usage=replies.usage(turns))
    yield replies.event("[DONE]")


async def _cancel(task: asyncio.Task) -> None:
    """Cancels `task` unless it is done, and waits for it to unwind (at most
    STOP_TIMEOUT_SECONDS), also while the caller is being cancelled: the stream of a client
    that left aborts its engine request before its session takes the next request."""
    if task.done():
        return
    task.cancel()
    # Starlette cancels a stream whose client left at every await until it ends.
    with anyio.CancelScope(shield=True):
        await asyncio.wait([task], timeout=STOP_TIMEOUT_SECONDS)


def _token_refusal(reason: str) -> Response:
    """A 401 with OpenAI's `invalid_api_key` error."""
    message = (
        f"{reason}: send `Authorization: Bearer <token>` (the openai client's api_key) "
        "with the token of the rollout service's server.auth_token_env"
    )
    body = replies.error_body(401, message, code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class _EventStream(StreamingResponse):
    """A server-sent-event stream that closes its events and then calls `on_close` however it
    ends: finished, failed, or cancelled by a client that went away (also before its first
    event)."""

    def __init__(self, events: AsyncGenerator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._on_close = on_close

    async def stream_response(self, send: Callable[..., Awaitable[None]]) -> None:
        try:
            await super().stream_response(send)
        finally:
            try:
                # Now, not when collected: a client that left while an event was being sent
                # must have its turn's engine request cancelled before `on_close`.
                await self._events.aclose()
            finally:
                self._on_close()


def _status(error: Exception) -> tuple[int, str | None]:
    """The HTTP status of an error raised by a handler, and the request field it names."""
    if isinstance(error, RequestTooLargeError):
        return 413, None
    for error_type, status in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return status, getattr(error, "param", None)
    return 500, None


async def _error(request: Request, error: Exception) -> Response:
    status, param = _status(error)
    message = str(error)
    if status == 500:
        log.error("gateway: %s %s failed", request.method, request.url.path, exc_info=error)
        message = "internal error; the rollout service's log has the traceback"
    return JSONResponse(replies.error_body(status, message, param), status_code=status)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(
        replies.error_body(error.status_code, message), status_code=error.status_code
    )
