"""A gRPC service's methods as JSON over HTTP, for callers without gRPC: `build_app` makes a
Starlette app that hands each call to the same servicer object the gRPC server serves, so
its checks, limits, queues and errors are the gRPC path's; `serve_http_json` serves it beside
the gRPC server (`server.http_port`), with that server's TLS and bearer token
(turnrl.asgi_server).

Routes:

- `POST /v1/<Service>/<Method>` (`/v1/ToolService/Execute`) for every method: the request
  message as protobuf's canonical JSON (proto or lowerCamelCase field names; an unknown field
  is refused; an empty body is the empty message), the reply as JSON with proto field names
  and every field, defaults included. A method that streams requests (ScoreBatch) takes an
  NDJSON body, one request message a line; one that streams replies answers NDJSON
  (`application/x-ndjson`), each reply a line as it is ready.
- `GET /openapi.json`: an OpenAPI 3.1 document of these routes (turnrl.rpc.openapi).

A call's deadline is `X-Request-Timeout: <seconds>`; without it, none (as a gRPC call with
no deadline). The body may be `server.max_message_bytes` long (a streamed body: each line);
longer is refused with 413. At most `server.max_concurrent_rpcs` calls run at once on this
port (its own count beside the gRPC server's); more are refused with 429.

An error is `{"code": <gRPC code number>, "status": "<NAME>", "message": ..., "details": []}`
(google.rpc.Status in JSON) with the HTTP status Google maps that code to (HTTP_STATUS_BY_CODE).
A streamed reply that fails after its first line ends with a line `{"error": <that object>}`.
"""

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from turnrl.asgi_server import BearerTokenMiddleware, RequestTooLargeError, read_body, serve_asgi
from turnrl.config import HttpJsonServerConfig
from turnrl.errors import InvalidArgumentError
from turnrl.rpc.openapi import NDJSON, TIMEOUT_HEADER, openapi_document
from turnrl.rpc.status import status_for

log = logging.getLogger(__name__)

# What `serve_http_json` prints once it listens, before `<Service> on <url>`; `turnrl up`
# reads it (turnrl_cli/processes.py).
HTTP_JSON_LINE = "HTTP/JSON of "
# Google's mapping of gRPC codes to HTTP statuses (google/rpc/code.proto).
HTTP_STATUS_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


class AbortedCall(Exception):
    """What `HttpServicerContext.abort` raises, as grpc.aio's context raises its AbortError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class HttpServicerContext:
    """The part of grpc.aio.ServicerContext a servicer may use, for a call over HTTP: its
    deadline, its headers as invocation metadata, its peer, and ending it with a status."""

    def __init__(self, request: Request, deadline: float | None) -> None:
        self._request = request
        self._deadline = deadline  # on the event loop's clock
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline (0 once past); None without one."""
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The request's headers, as (lowercase name, value) pairs."""
        return tuple(self._request.headers.items())

    def peer(self) -> str:
        """The caller's address, as gRPC names it: `ipv4:HOST:PORT`."""
        client = self._request.client
        return f"ipv4:{client.host}:{client.port}" if client else "unknown"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise AbortedCall(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def status_set(self) -> AbortedCall | None:
        """The status a servicer set without raising, when not OK."""
        if self._code is None or self._code == grpc.StatusCode.OK:
            return None
        return AbortedCall(self._code, self._details)


@contextlib.asynccontextmanager
async def serve_http_json(
    server: HttpJsonServerConfig, service: ServiceDescriptor, servicer: Any
) -> AsyncIterator[str]:
    """Serves `service`'s methods on `servicer` as JSON over HTTP on `server.host:http_port`,
    with the gRPC server's TLS, token and limits; prints `HTTP/JSON of <Service> on <url>` and
    yields the URL. Raises OSError or ConfigError as `serve_asgi` does."""
    assert server.http_port is not None
    app = build_app(
        service,
        servicer,
        token=server.auth_token(),
        max_message_bytes=server.max_message_bytes,
        max_concurrent_calls=server.max_concurrent_rpcs,
    )
    async with serve_asgi(
        app, server.host, server.http_port, server, setting="server.host", name="HTTP/JSON port"
    ) as url:
        print(f"{HTTP_JSON_LINE}{service.name} on {url}", flush=True)
        yield url


def build_app(
    service: ServiceDescriptor,
    servicer: Any,
    *,
    token: str | None,
    max_message_bytes: int,
    max_concurrent_calls: int | None,
) -> Starlette:
    """The HTTP/JSON app of `service` over `servicer` (the object the gRPC server serves)."""
    document = openapi_document(service, with_token=token is not None)

    def route(method: MethodDescriptor) -> Route:
        behavior = getattr(servicer, method.name)
        request_class = GetMessageClass(method.input_type)
        name = f"/{service.full_name}/{method.name}"

        async def endpoint(request: Request) -> Response:
            context = HttpServicerContext(request, _deadline(request))
            if method.client_streaming:
                arguments = _requests(request, request_class, max_message_bytes)
            else:
                body = await read_body(request, max_message_bytes)
                arguments = _parse(body, request_class)
            if method.server_streaming:
                return await _streamed(behavior(arguments, context), context, name)
            async with _deadline_of(context, name):
                reply = await behavior(arguments, context)
            if failed := context.status_set():
                raise failed
            return JSONResponse(_json(reply))

        path = f"/v1/{service.name}/{method.name}"
        return Route(path, _answering_errors(endpoint, name), methods=["POST"])

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    routes = [route(method) for method in service.methods]
    routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    middleware = [Middleware(CallLimitMiddleware, max_calls=max_concurrent_calls)]
    if token:
        middleware.insert(0, Middleware(BearerTokenMiddleware, token=token, refusal=_token_refusal))
    return Starlette(
        routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error}
    )


class CallLimitMiddleware:
    """Refuses a call with RESOURCE_EXHAUSTED (429) while `max_calls` run (None: no limit), as
    the gRPC server does past `max_concurrent_rpcs`; a streamed call runs until its last line."""

    def __init__(self, app: ASGIApp, max_calls: int | None) -> None:
        self._app = app
        self._max_calls = max_calls
        self._running = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._max_calls is None:
            await self._app(scope, receive, send)
            return
        if self._running >= self._max_calls:
            refusal = _error_response(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_calls} calls are running already (server.max_concurrent_rpcs)",
            )
            await refusal(scope, receive, send)
            return
        self._running += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self._running -= 1


def _answering_errors(endpoint: Callable, name: str) -> Callable:
    """`endpoint`, with any error it raises answered as its status."""

    async def answering(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as e:
            too_large = isinstance(e, RequestTooLargeError)
            return _error_response(*_status_of(e, name), http_status=413 if too_large else None)

    return answering


def _status_of(error: Exception, name: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised `error` ends with: the one it aborted with, or the gRPC
    path's for a servicer's exception (`status.status_for`)."""
    if isinstance(error, AbortedCall):
        return error.code, str(error)
    if isinstance(error, RequestTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error} (server.max_message_bytes)"
    return status_for(error, name)


@contextlib.asynccontextmanager
async def _deadline_of(context: HttpServicerContext, name: str) -> AsyncIterator[None]:
    """Cancels the work within past the call's deadline, raising AbortedCall(DEADLINE_EXCEEDED)."""
    remaining = context.time_remaining()
    if remaining is None:
        yield
        return
    try:
        async with asyncio.timeout(remaining) as timeout:
            yield
    except TimeoutError:
        if not timeout.expired():
            raise  # the work's own
        raise AbortedCall(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: deadline exceeded") from None


async def _streamed(replies: AsyncIterator[Message], context: HttpServicerContext, name: str):
    """An NDJSON response of `replies`. Its first reply is awaited here, so that a call failing
    before it is answered with the error's status; a later failure ends the stream with an
    `{"error": ...}` line."""
    async with _deadline_of(context, name):
        first = await anext(replies, None)

    async def lines() -> AsyncIterator[bytes]:
        try:
            reply = first
            while reply is not None:
                yield _ndjson_line(_json(reply))
                async with _deadline_of(context, name):
                    reply = await anext(replies, None)
            if failed := context.status_set():
                raise failed
        except Exception as e:
            yield _ndjson_line({"error": _status_body(*_status_of(e, name))})
        finally:
            await replies.aclose()

    return StreamingResponse(lines(), media_type=NDJSON)


async def _requests(
    request: Request, request_class: type[Message], max_line_bytes: int
) -> AsyncIterator[Message]:
    """The request messages of an NDJSON body, each as its line arrives."""
    pending = bytearray()
    async for part in request.stream():
        pending += part
        while (end := pending.find(b"\n")) >= 0:
            line, pending = bytes(pending[:end]), pending[end + 1 :]
            if line.strip():
                yield _parse(line, request_class)
        if len(pending) > max_line_bytes:
            raise RequestTooLargeError(f"a request line is over {max_line_bytes} bytes")
    if bytes(pending).strip():
        yield _parse(bytes(pending), request_class)


def _parse(body: bytes, request_class: type[Message]) -> Message:
    message = request_class()
    try:
        json_format.Parse(body.decode() if body.strip() else "{}", message)
    except (json_format.ParseError, UnicodeDecodeError) as e:
        name = message.DESCRIPTOR.full_name
        raise InvalidArgumentError(f"the request does not parse as {name}: {e}") from None
    return message


def _deadline(request: Request) -> float | None:
    """The call's deadline on the event loop's clock, from its X-Request-Timeout header."""
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise InvalidArgumentError(
            f"{TIMEOUT_HEADER} {text!r}: give the call's time limit as a positive number of seconds"
        )
    return asyncio.get_running_loop().time() + seconds


def _json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )


def _ndjson_line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def _status_body(code: grpc.StatusCode, message: str) -> dict[str, Any]:
    return {"code": code.value[0], "status": code.name, "message": message, "details": []}


def _error_response(
    code: grpc.StatusCode, message: str, http_status: int | None = None
) -> JSONResponse:
    status = http_status or HTTP_STATUS_BY_CODE[code]
    return JSONResponse(_status_body(code, message), status_code=status)


def _token_refusal(reason: str) -> Response:
    response = _error_response(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{reason}: send `Authorization: Bearer <token>` with the token of the service's "
        "server.auth_token_env",
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    code = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED}.get(
        error.status_code, grpc.StatusCode.INVALID_ARGUMENT
    )
    message = f"{request.method} {request.url.path}: {error.detail}; see GET /openapi.json"
    return _error_response(code, message, http_status=error.status_code)
