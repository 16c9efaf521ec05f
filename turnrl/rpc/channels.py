"""The callers' side: one channel factory (keepalive, default deadline, token,
status-to-error mapping), retries for idempotent calls, waiting for SERVING, and listing a
server's services by reflection."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from turnrl import errors
from turnrl.config import ClientConfig
from turnrl.rpc.credentials import channel_credentials
from turnrl.rpc.status import RPC_ERROR_BY_STATUS

ResponseT = TypeVar("ResponseT")
MAX_RECONNECT_BACKOFF_MS = 5_000


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
    return grpc.aio.secure_channel(
        config.address, channel_credentials(config), options=options, interceptors=interceptors
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
