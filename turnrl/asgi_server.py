"""An HTTP port beside a service's gRPC server, with that server's security: `serve_asgi` runs an
ASGI app under uvicorn in the service's own event loop, HTTPS with `server.tls` (client
certificates required with `client_ca_file`), on an address `ServerConfig.check_exposure`
allows; `BearerTokenMiddleware` requires `server.auth_token_env`'s token on every request.

Used by the rollout service's OpenAI-compatible gateway (rollout_svc.gateway.app) and by the
HTTP/JSON transcoding of the tool and reward services (turnrl.rpc.http_json).
"""

import asyncio
import contextlib
import hmac
import socket
import ssl
from collections.abc import AsyncIterator, Callable

import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from turnrl.config import ServerConfig
from turnrl.errors import ConfigError

STOP_TIMEOUT_SECONDS = 10.0


class RequestTooLargeError(Exception):
    """A request body over its listener's limit (HTTP 413)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port) and listening. Raises OSError when the
    address cannot be bound."""
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets that say they are TCP, and with it on every reply's second write waited ~40 ms
    # for the client's delayed ACK (benchmarks/gateway.py).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def serve_asgi(
    app: ASGIApp, host: str, port: int, server: ServerConfig, *, setting: str, name: str
) -> AsyncIterator[str]:
    """Serves `app` in this event loop on `host:port` (0: a free port) with the TLS of the
    service's gRPC `server`; yields its base URL, `http://HOST:PORT` (`https://` with TLS), and
    stops it on exit (requests still running after STOP_TIMEOUT_SECONDS / 2 are cancelled).

    `setting` names the host's config key and `name` the listener, in errors. Raises OSError
    when the address cannot be bound, ConfigError when the TLS files cannot be loaded or the
    host is one other machines reach and the service would have neither TLS nor a token
    (`ServerConfig.check_exposure`)."""
    server.check_exposure(host, setting=setting)
    tls = server.tls
    uvicorn_config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=STOP_TIMEOUT_SECONDS / 2,
        ssl_certfile=tls.cert_file if tls else None,
        ssl_keyfile=tls.key_file if tls else None,
        ssl_ca_certs=tls.client_ca_file if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
    )
    if tls is not None:
        # Loads the TLS files now, so that a bad one fails the start, not the server task
        # (which would tell only when the listener stops).
        try:
            uvicorn_config.load()
        except OSError as e:  # ssl.SSLError included
            files = [str(f) for f in (tls.cert_file, tls.key_file, tls.client_ca_file) if f]
            raise ConfigError(f"server.tls: the {name} cannot load {files}: {e}") from e
    sock = listening_socket(host, port)
    http_server = uvicorn.Server(uvicorn_config)
    task = asyncio.create_task(http_server.serve(sockets=[sock]))
    bracketed = f"[{host}]" if ":" in host else host
    scheme = "https" if tls else "http"
    try:
        yield f"{scheme}://{bracketed}:{sock.getsockname()[1]}"
    finally:
        http_server.should_exit = True
        try:
            async with asyncio.timeout(STOP_TIMEOUT_SECONDS):
                await task
        finally:
            sock.close()


class BearerTokenMiddleware:
    """Answers a request without `Authorization: Bearer <token>` with `refusal(reason)` (a 401
    in the app's own error shape), before any route runs."""

    def __init__(self, app: ASGIApp, token: str, refusal: Callable[[str], Response]) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()
        self._refusal = refusal

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
        await self._refusal(reason)(scope, receive, send)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; RequestTooLargeError once it is over `max_bytes`, before reading
    more than that (a declared Content-Length over it: before reading any)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(f"the request body is {declared} bytes; at most {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise RequestTooLargeError(f"the request body is over {max_bytes} bytes")
    return bytes(body)
