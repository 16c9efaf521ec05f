"""gRPC plumbing for the four services and their clients: one server bootstrap (health,
reflection, TLS, bearer-token auth, error-to-status mapping, graceful shutdown), the request
fields whose conversion a bad value breaks (`positive_seconds`, `json_value`: INVALID_ARGUMENT
rather than INTERNAL), one channel factory (keepalive, default deadline, token,
status-to-error mapping), and retries for idempotent calls.

Besides the services' `server.py` files, this is the only turnrl module that imports grpc:
service logic raises `turnrl.errors` exceptions and `StatusMappingInterceptor` turns them into
status codes, so no servicer needs a try/except; on the calling side the channels of
`open_channel` raise a failed call as the `errors.RpcError` of its status
(`RPC_ERROR_BY_STATUS`), so no caller catches grpc's own error.
"""

import asyncio
import hmac
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2, json_format
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from turnrl import errors
from turnrl.config import ClientConfig, ServerConfig

log = logging.getLogger(__name__)
ResponseT = TypeVar("ResponseT")

STATUS_BY_ERROR: dict[type[errors.TurnrlError], grpc.StatusCode] = {
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
}
# What a call through `open_channel` raises for each status; errors.RpcError for the others.
RPC_ERROR_BY_STATUS: dict[grpc.StatusCode, type[errors.RpcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.RpcInvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.RpcNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.RpcAlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.RpcFailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.RpcResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.RpcDeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: errors.RpcUnavailableError,
}
# Health checks answer without a token, so load balancers and `turnrl up` can probe a service.
UNAUTHENTICATED_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MAX_RECONNECT_BACKOFF_MS = 5_000
# Servers accept client keepalive pings this often (clients ping every `keepalive_seconds`).
MIN_CLIENT_PING_INTERVAL_MS = 5_000
# The most a google.protobuf.Duration may hold: 10,000 years.
MAX_DURATION_SECONDS = 315_576_000_000


# ---------------------------------------- Server --------------------------------------------


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
            port = server.add_secure_port(address, _server_credentials(config))
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
    metrics: CollectorRegistry | None = None,
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
    if config.metrics_port is not None and metrics is not None:
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


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    assert config.tls is not None
    client_ca = config.tls.client_ca_file
    return grpc.ssl_server_credentials(
        [(_read_pem(config.tls.key_file), _read_pem(config.tls.cert_file))],
        root_certificates=_read_pem(client_ca) if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def _read_pem(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise errors.ConfigError(f"cannot read TLS file {str(path)!r}: {e.strerror}") from e


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
        return _replace_behavior(handler, _aborting_behavior(handler, reason))


def _aborting_behavior(handler: grpc.RpcMethodHandler, reason: str) -> Callable:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # unreachable; makes this an async generator like the handler it replaces

    return abort_stream if handler.response_streaming else abort


class StatusMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns `turnrl.errors` exceptions into their status codes, anything else into INTERNAL,
    and a request whose bytes do not parse as the method's message into INVALID_ARGUMENT.

    A bug is logged with its traceback; the caller sees only that it was internal.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        behavior = _behavior(handler)
        method = handler_call_details.method
        handler = _parsing_leniently(handler)
        streaming = handler.request_streaming
        if inspect.isasyncgenfunction(behavior):

            async def mapped_stream(request: Any, context: grpc.aio.ServicerContext):
                try:
                    async for response in behavior(_parsed(request, streaming), context):
                        yield response
                except Exception as e:
                    await _abort_for(e, context, method)

            return _replace_behavior(handler, mapped_stream)

        async def mapped(request: Any, context: grpc.aio.ServicerContext):
            try:
                result = behavior(_parsed(request, streaming), context)
                # Only the generated base servicer's UNIMPLEMENTED methods are plain functions.
                return await result if inspect.isawaitable(result) else result
            except Exception as e:
                await _abort_for(e, context, method)

        return _replace_behavior(handler, mapped)


async def _abort_for(error: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(error, asyncio.CancelledError):
        raise error
    if _is_abort(error):
        raise error  # context.abort() already set the status
    if isinstance(error, NotImplementedError):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented yet")
    for error_type, code in STATUS_BY_ERROR.items():
        if isinstance(error, error_type):
            await context.abort(code, str(error))
    log.exception("%s failed", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")


class _Unparsable:
    """What a request whose bytes do not parse is handed on as, so that its handler answers
    INVALID_ARGUMENT: grpc itself would answer UNKNOWN, naming the parser's exception."""

    def __init__(self, error: DecodeError) -> None:
        self.error = errors.InvalidArgumentError(f"the request does not parse: {error}")


def _parsing_leniently(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:  # the handler takes bytes
        return handler

    def parse_leniently(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return _Unparsable(e)

    return handler._replace(request_deserializer=parse_leniently)


def _parsed(request: Any, streaming: bool) -> Any:
    """The request, or the stream of them, that a handler takes: an unparsable one raises
    InvalidArgumentError, for a stream when the handler reaches it."""
    if streaming:
        return _parsed_stream(request)
    if isinstance(request, _Unparsable):
        raise request.error
    return request


async def _parsed_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Unparsable):
            raise request.error
        yield request


def _is_abort(error: Exception) -> bool:
    # grpc.aio raises its own AbortError out of context.abort(); it is not public API.
    return type(error).__name__ == "AbortError"


def _behavior(handler: grpc.RpcMethodHandler) -> Callable:
    return (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def _replace_behavior(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    kind = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[(handler.request_streaming, handler.response_streaming)]
    return handler._replace(**{kind: behavior})


def positive_seconds(duration: duration_pb2.Duration, field: str) -> float:
    """A Duration field of a request in seconds. Raises InvalidArgumentError naming `field`
    unless it is positive and within a Duration's range (past timedelta's, `ToTimedelta`
    raises OverflowError)."""
    seconds = duration.seconds + duration.nanos / 1e9
    if not 0 < seconds <= MAX_DURATION_SECONDS:
        raise errors.InvalidArgumentError(
            f"{field} must be positive and at most {MAX_DURATION_SECONDS}s, got {seconds!r}s"
        )
    return seconds


def json_value(message: Message, field: str) -> Any:
    """A Struct, Value or ListValue field of a request as plain Python values. Raises
    InvalidArgumentError naming `field` for a number JSON has no value for (NaN, Infinity)."""
    try:
        return json_format.MessageToDict(message)
    except ValueError as e:
        raise errors.InvalidArgumentError(f"{field}: {e}") from None


# ---------------------------------------- Client --------------------------------------------


def open_channel(config: ClientConfig, *, token: str | None = None) -> grpc.aio.Channel:
    """A channel to `config.address` with keepalive, TLS when configured, a default deadline
    on unary calls that set none, and the bearer token (`token`, else `config.auth_token()`).

    A call that fails raises the `errors.RpcError` of its status (`RPC_ERROR_BY_STATUS`), naming
    the method, the address, the status and the server's details: a unary call when awaited, a
    streaming one while its responses are read.
    """
    if len(config.addresses()) > 1:
        raise errors.ConfigError(
            f"address {config.address!r} names several replicas; this caller talks to one "
            "service (the rollout service's tool and reward clients and the trainer's rollout "
            "router spread calls over replicas)"
        )
    token = token if token is not None else config.auth_token()
    options = [
        # A replica that comes back is found within seconds (gRPC's default backs off to 2 min).
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    interceptors = [
        kind(config.address, token, config.timeout_seconds)
        for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]
    if config.tls_ca_file is None:
        return grpc.aio.insecure_channel(config.address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(config.tls_ca_file),
        private_key=_read_pem(config.tls_key_file) if config.tls_key_file else None,
        certificate_chain=_read_pem(config.tls_cert_file) if config.tls_cert_file else None,
    )
    return grpc.aio.secure_channel(
        config.address, credentials, options=options, interceptors=interceptors
    )


class _ChannelInterceptor:
    """What every call on an `open_channel` channel gets: the bearer token when there is one,
    and its failure raised as the `errors.RpcError` of its status. grpc wants one interceptor
    per kind of call; the four below share this."""

    def __init__(self, address: str, token: str | None, timeout_seconds: float) -> None:
        self._address = address
        self._header = ("authorization", f"Bearer {token}") if token else None
        self._timeout_seconds = timeout_seconds

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if self._header is None:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        return details._replace(metadata=metadata)

    def _error(
        self, error: grpc.aio.AioRpcError, call: grpc.aio.ClientCallDetails
    ) -> errors.RpcError:
        method = call.method.decode() if isinstance(call.method, bytes) else call.method
        status, details = error.code().name, error.details() or ""
        message = f"{method} at {self._address} failed: {status}: {details}"
        error_type = RPC_ERROR_BY_STATUS.get(error.code(), errors.RpcError)
        return error_type(
            message, method=method, address=self._address, status=status, details=details
        )

    async def _responses(self, call: Any, details: grpc.aio.ClientCallDetails) -> AsyncIterator:
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as e:
            raise self._error(e, details) from e


class _UnaryUnary(_ChannelInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    """Also gives a call without a timeout the channel's: no unary call waits forever.
    Streaming calls (Generate, StreamProgress) run as long as their work and pass their own."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if client_call_details.timeout is None:
            client_call_details = client_call_details._replace(timeout=self._timeout_seconds)
        call = await continuation(self._with_token(client_call_details), request)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            raise self._error(e, client_call_details) from e
        return call  # done: awaiting it again returns its response


class _UnaryStream(_ChannelInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        call = await continuation(self._with_token(client_call_details), request)
        return self._responses(call, client_call_details)


class _StreamUnary(_ChannelInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        call = await continuation(self._with_token(client_call_details), request_iterator)
        return _StreamUnaryCall(call, lambda e: self._error(e, client_call_details))


class _StreamStream(_ChannelInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        call = await continuation(self._with_token(client_call_details), request_iterator)
        return self._responses(call, client_call_details)


class _StreamUnaryCall:
    """A stream-unary call whose awaited failure is an `errors.RpcError`. `_StreamUnary` cannot
    await the call itself, as `_UnaryUnary` does: a caller that write()s its requests would
    wait for its own call. Everything but awaiting is the call's own."""

    def __init__(self, call: Any, to_error: Callable[..., errors.RpcError]) -> None:
        self._call = call
        self._to_error = to_error

    def __await__(self):
        try:
            return (yield from self._call.__await__())
        except grpc.aio.AioRpcError as e:
            raise self._to_error(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def call_idempotent(
    method: Callable[..., Awaitable[ResponseT]],
    request: Any,
    *,
    timeout_seconds: float,
    max_attempts: int,
) -> ResponseT:
    """Calls a unary RPC that is safe to repeat, retrying on UNAVAILABLE with jittered back-off.

    All attempts together stay within `timeout_seconds`: each gets what is left of it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds
    retrying = AsyncRetrying(
        retry=retry_if_exception(_is_unavailable),
        stop=stop_after_attempt(max_attempts),
        wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.1),
        before_sleep=lambda state: _raise_if_past(deadline, state),
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            remaining = deadline - loop.time()
            return await method(request, timeout=max(remaining, 0.001))
    raise AssertionError("unreachable: tenacity reraises the last error")


def _is_unavailable(error: BaseException) -> bool:
    return isinstance(error, errors.UnavailableError)


def _raise_if_past(deadline: float, state: Any) -> None:
    sleep = state.upcoming_sleep or 0.0
    if asyncio.get_running_loop().time() + sleep >= deadline:
        raise state.outcome.exception()


async def wait_until_serving(
    config: ClientConfig, *, service: str = "", timeout_seconds: float
) -> None:
    """Waits until the health service at `config.address` reports SERVING for `service`.

    Uses the health Watch stream, so it neither polls nor sleeps. Raises TimeoutError naming
    the address and the last status seen when the service is not SERVING in time.
    """
    last = "no answer"
    async with open_channel(config) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout_seconds,
            wait_for_ready=True,
        )
        try:
            async for reply in watch:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except errors.RpcError as e:
            last = f"{e.status}: {e.details}"
        finally:
            watch.cancel()
    raise TimeoutError(f"{config.address} not SERVING after {timeout_seconds:.0f}s (last: {last})")


async def list_services(channel: grpc.aio.Channel, *, timeout_seconds: float) -> list[str]:
    """Names of the services a server lists over the reflection protocol, sorted."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(timeout=timeout_seconds)
    # write() rather than a request iterator: when the server ends the call first (a rejected
    # token), write() surfaces the call's real status instead of a send failure.
    try:
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await call.done_writing()
    except asyncio.InvalidStateError:
        pass  # the call is over; read() raises its status
    reply = await call.read()
    if reply is grpc.aio.EOF:
        raise errors.UnavailableError("reflection returned no answer")
    if reply.HasField("error_response"):
        raise errors.UnavailableError(f"reflection failed: {reply.error_response.error_message}")
    call.cancel()
    return sorted(s.name for s in reply.list_services_response.service)
