"""The gateway's HTTP skin: a Starlette app over `ChatSessions`, served by uvicorn in the rollout
service's own event loop (`serve_gateway`), on a port of its own.

Routes (the `openai` client takes `base_url=http://HOST:PORT/sessions/<id>/v1` as it is):

- `GET /v1/models` and `GET /sessions/{id}/v1/models`: the served model;
- `POST /sessions/{id}/v1/chat/completions`: one model turn of session `id` (created by its
  first request), streamed as server-sent events with `stream: true`;
- `POST /sessions/{id}/end`: ends the session and returns its trajectory as JSON.

The gateway serves with the rollout service's `server` settings: HTTPS with its certificate
(`server.tls`; client certificates required with `client_ca_file`), and with
`server.auth_token_env` every route requires `Authorization: Bearer <token>` (the `openai`
client sends its api_key so), answering 401 without it.

Errors have OpenAI's shape and status: 400 for a bad request or history, 401 for a missing or
wrong token, 404 for an unknown route, model or session, 409 for a second request on a busy
session or one that ended (or whose last turn cannot be continued), 413 for a body over
`gateway.max_request_bytes`, 503 when the engine could not answer. A stream sends its role
chunk once the request is checked and the rest when the turn is sampled (the engine returns
whole turns); an error after the first chunk comes as an `error` event. A client that leaves a
stream cancels its engine request; one that leaves a plain request has its turn recorded, and
its retry replaces that turn (sessions.py).
"""

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_svc.config import GatewayConfig
from rollout_svc.gateway import replies
from rollout_svc.gateway.requests import ChatCompletionRequest, parse_request
from rollout_svc.gateway.session_state import ModelTurn, PendingTurn
from rollout_svc.gateway.sessions import ChatSessions
from turnrl.config import ServerConfig
from turnrl.errors import (
    ConfigError,
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
STOP_TIMEOUT_SECONDS = 10.0


class RequestTooLargeError(Exception):
    """A request body over the gateway's limit (HTTP 413)."""


def build_app(sessions: ChatSessions, max_request_bytes: int, token: str | None) -> Starlette:
    """The gateway's ASGI app over `sessions`; with `token`, every route requires it."""
    created = int(time.time())
    tokenizer = sessions.tokenizer

    async def models(request: Request) -> Response:
        return JSONResponse(replies.model_list(sessions.model_name, created))

    async def chat_completions(request: Request) -> Response:
        body = await _body(request, max_request_bytes)
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
            turn = await sessions.generate(pending)
        finally:
            sessions.release(session)
        logprobs = replies.token_logprobs(tokenizer, turn) if chat.logprobs else None
        reply = replies.completion(completion_id, now, chat.model, turn, logprobs)
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
        middleware=[Middleware(BearerTokenMiddleware, token=token)] if token else [],
        exception_handlers={
            HTTPException: _http_error,
            RequestTooLargeError: _error,
            **handlers,
            Exception: _error,
        },
    )


def listening_socket(config: GatewayConfig) -> socket.socket:
    """The gateway's socket, bound to `config.host:config.port` and listening. Raises OSError
    when the address cannot be bound."""
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets that say they are TCP, and with it on every reply's second write waited ~40 ms
    # for the client's delayed ACK (benchmarks/gateway.py).
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host.strip("[]"), config.port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def serve_gateway(
    config: GatewayConfig, server: ServerConfig, sessions: ChatSessions
) -> AsyncIterator[str]:
    """Serves the gateway in this event loop on `config.host:config.port` (0: a free port),
    with the TLS and bearer token of the rollout service's gRPC `server`; yields its base URL,
    `http://HOST:PORT` (`https://` with TLS), and stops it on exit. Raises OSError when the
    address cannot be bound, ConfigError when the TLS files cannot be loaded, the token's
    variable is unset, or the host is one other machines reach and the gateway would have
    neither TLS nor a token (`ServerConfig.check_exposure`)."""
    server.check_exposure(config.host, setting="gateway.host")
    app = build_app(sessions, config.max_request_bytes, server.auth_token())
    tls = server.tls
    uvicorn_config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level="warning",
        # Requests still running then are cancelled (their engine requests aborted).
        timeout_graceful_shutdown=STOP_TIMEOUT_SECONDS / 2,
        ssl_certfile=tls.cert_file if tls else None,
        ssl_keyfile=tls.key_file if tls else None,
        ssl_ca_certs=tls.client_ca_file if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
    )
    if tls is not None:
        # Loads the TLS files now, so that a bad one fails the start, not the server task
        # (which would tell only when the gateway stops).
        try:
            uvicorn_config.load()
        except OSError as e:  # ssl.SSLError included
            files = [str(f) for f in (tls.cert_file, tls.key_file, tls.client_ca_file) if f]
            raise ConfigError(f"server.tls: the gateway cannot load {files}: {e}") from e
    sock = listening_socket(config)
    gateway = uvicorn.Server(uvicorn_config)
    task = asyncio.create_task(gateway.serve(sockets=[sock]))
    host = f"[{config.host}]" if ":" in config.host else config.host
    scheme = "https" if tls else "http"
    try:
        yield f"{scheme}://{host}:{sock.getsockname()[1]}"
    finally:
        gateway.should_exit = True
        try:
            async with asyncio.timeout(STOP_TIMEOUT_SECONDS):
                await task
        finally:
            sock.close()


async def _stream(
    sessions: ChatSessions,
    tokenizer,
    pending: PendingTurn,
    chat: ChatCompletionRequest,
    completion_id: str,
    created: int,
) -> AsyncIterator[str]:
    """The events of a streamed turn: role, content, tool calls, finish, usage, `[DONE]`."""
    with_usage = bool(chat.stream_options and chat.stream_options.include_usage)

    def chunk(delta, **fields) -> str:
        return replies.chunk(
            completion_id, created, chat.model, delta, with_usage=with_usage, **fields
        )

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    try:
        turn: ModelTurn = await sessions.generate(pending)
    except Exception as e:
        status, param = _status(e)
        yield replies.event(replies.error_body(status, str(e), param))
        return
    logprobs = replies.token_logprobs(tokenizer, turn) if chat.logprobs else None
    # The turn's logprobs ride on its first delta (the finish chunk's, when it has none), so a
    # client that gathers them gets all of them, as a plain reply gives them.
    for delta in replies.turn_deltas(turn):
        yield chunk(delta, logprobs=logprobs)
        logprobs = None
    yield chunk({}, finish_reason=turn.finish_reason, logprobs=logprobs)
    if with_usage:
        yield chunk(None, turn_usage=replies.usage(turn))
    yield replies.event("[DONE]")


class BearerTokenMiddleware:
    """Answers a request without `Authorization: Bearer <token>` with 401 and OpenAI's
    `invalid_api_key` error, before any route runs."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        presented = dict(scope["headers"]).get(b"authorization", b"")
        # In constant time: how long a wrong token takes to refuse tells nothing of the right one.
        if hmac.compare_digest(presented, self._expected):
            await self._app(scope, receive, send)
            return
        reason = "invalid bearer token" if presented else "missing bearer token"
        message = (
            f"{reason}: send `Authorization: Bearer <token>` (the openai client's api_key) "
            "with the token of the rollout service's server.auth_token_env"
        )
        body = replies.error_body(401, message, code="invalid_api_key")
        refusal = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await refusal(scope, receive, send)


class _EventStream(StreamingResponse):
    """A server-sent-event stream that calls `on_close` however it ends: finished, failed, or
    cancelled by a client that went away (also before its first event)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._on_close = on_close

    async def stream_response(self, send: Callable[..., Awaitable[None]]) -> None:
        try:
            await super().stream_response(send)
        finally:
            self._on_close()


async def _body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(f"the request body is {declared} bytes; at most {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise RequestTooLargeError(f"the request body is over {max_bytes} bytes")
    return bytes(body)


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
