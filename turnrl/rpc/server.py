"""One server bootstrap for the four services: health, reflection, TLS, bearer-token auth
(`BearerTokenInterceptor`), error-to-status mapping (`status.StatusMappingInterceptor`),
graceful shutdown, and an optional Prometheus endpoint."""

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from turnrl.config import ServerConfig
from turnrl.rpc.credentials import server_credentials
from turnrl.rpc.status import StatusMappingInterceptor, replace_behavior

log = logging.getLogger(__name__)

# Health checks answer without a token, so load balancers and `turnrl up` can probe a service.
UNAUTHENTICATED_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# Servers accept client keepalive pings this often (clients ping every `keepalive_seconds`).
MIN_CLIENT_PING_INTERVAL_MS = 5_000


@dataclass
class RunningServer:
    """A started server, the port it is bound to, and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_name: str


async def start_server(
    config: ServerConfig,
    service: ServiceDescriptor,
    add_servicer: Callable[[grpc.aio.Server], None],
) -> RunningServer:
    """Builds, binds and starts a server for one service, with health and reflection.

    `add_servicer` registers the service's servicer (the generated `add_*_to_server`).
    Raises OSError when the address cannot be bound, ConfigError when it is one other machines
    reach and the server would have neither TLS nor a token (`ServerConfig.check_exposure`).
    """
    config.check_exposure()
    token = config.auth_token()
    interceptors: list[grpc.aio.ServerInterceptor] = [StatusMappingInterceptor()]
    if token is not None:
        interceptors.insert(0, BearerTokenInterceptor(token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            service.full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = (
        f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    )
    try:
        if config.tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(config))
    except RuntimeError as e:
        raise OSError(f"cannot bind {service.name} to {address}: {e}") from e
    await server.start()
    for name in ("", service.full_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(
        server=server, port=port, health=health_servicer, service_name=service.full_name
    )


async def stop_server(running: RunningServer, grace_seconds: float) -> None:
    """Marks the service NOT_SERVING, lets in-flight RPCs finish within the grace, then stops."""
    await running.health.enter_graceful_shutdown()
    await running.server.stop(grace_seconds)


async def serve(
    config: ServerConfig,
    service: ServiceDescriptor,
    add_servicer: Callable[[grpc.aio.Server], None],
    *,
    metrics: CollectorRegistry,
    watch: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serves one service until SIGTERM or SIGINT, then shuts down gracefully. When `watch()`
    (the rollout engine's) raises, the service can no longer serve: it shuts down the same way
    and the error is raised, so the process exits failed and its supervisor restarts it.

    Prints one line to stdout once serving, `serving <ServiceName> on <host>:<port>`, which
    launchers and tests read to learn the port when `config.port` is 0. With
    `config.metrics_port` set, `metrics` is exposed over HTTP for Prometheus, and a line
    `metrics of <ServiceName> on http://<host>:<port>/metrics` is printed before it.
    """
    running = await start_server(config, service, add_servicer)
    if config.metrics_port is not None:
        # prometheus_client serves from its own daemon thread; it never touches the event loop.
        http_server, _ = start_http_server(config.metrics_port, addr=config.host, registry=metrics)
        print(
            f"metrics of {service.name} on http://{config.host}:{http_server.server_port}/metrics",
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    security = "TLS" if config.tls else "plaintext"
    auth = "token" if config.auth_token_env else "no auth"
    log.info("%s: %s, %s, grace %.1fs", service.name, security, auth, config.shutdown_grace_seconds)
    print(f"serving {service.name} on {config.host}:{running.port}", flush=True)
    stopped = asyncio.ensure_future(stop.wait())
    watched = asyncio.ensure_future(watch() if watch is not None else asyncio.Event().wait())
    try:
        await asyncio.wait([stopped, watched], return_when=asyncio.FIRST_COMPLETED)
        if watched.done():
            log.error("%s: cannot serve any more: %s", service.name, watched.exception())
        log.info("%s: shutting down (grace %.1fs)", service.name, config.shutdown_grace_seconds)
    finally:
        stopped.cancel()
        watched.cancel()
        await stop_server(running, config.shutdown_grace_seconds)
    if watched.done() and not watched.cancelled():
        watched.result()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects RPCs without `authorization: Bearer <token>` with UNAUTHENTICATED (health exempt)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(
            UNAUTHENTICATED_METHOD_PREFIXES
        ):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = metadata.get("authorization", "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._expected):
            return handler
        reason = "missing bearer token" if not presented else "invalid bearer token"
        return replace_behavior(handler, _aborting_behavior(handler, reason))


def _aborting_behavior(handler: grpc.RpcMethodHandler, reason: str) -> Callable:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # unreachable; makes this an async generator like the handler it replaces

    return abort_stream if handler.response_streaming else abort
