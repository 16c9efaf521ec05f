"""Calling any RPC with any bytes, and servers that keep serving between Hypothesis examples.

Hypothesis runs a test's examples one after another in plain functions, so the services under
fuzz run in an event loop of their own, in a thread, for a whole module, and the examples call
them through a blocking channel: a server is started once, not per example, and what one
example leaves behind (a session, a run, a paused engine) is there for the next.
"""

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

T = TypeVar("T")
STARTUP_TIMEOUT_SECONDS = 120.0
# A field number no turnrl message uses: bytes under it are an unknown field, which a parser
# skips, so they make any message as large as wanted.
PADDING_FIELD_NUMBER = 1000
# Statuses that mean the server failed, not the request: a handler raised something that is
# not a turnrl error (INTERNAL), or grpc caught an exception around the handler (UNKNOWN).
SERVER_FAILURES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# The RPCs ("Service.Method") whose handler answers DEADLINE_EXCEEDED itself, as its proto
# says (a weight-sync group that does not form within the request's timeout). Every other
# handler answers a fuzzed request, a validation error most of all, long before the test's
# deadline: DEADLINE_EXCEEDED from one of them means it hung, a server failure too.
MAY_ANSWER_DEADLINE_EXCEEDED = frozenset({"RolloutService.InitWeightSync"})


@contextlib.contextmanager
def serving_in_thread(
    serve: Callable[[], contextlib.AbstractAsyncContextManager[T]],
) -> Iterator[T]:
    """Enters `serve()` in a new event loop in a thread of its own and yields what it yields;
    leaves it when the block ends."""
    started: concurrent.futures.Future = concurrent.futures.Future()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def run() -> None:
        try:
            async with serve() as value:
                started.set_result(value)
                await stop.wait()
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), name="fuzzed")
    thread.start()
    try:
        yield started.result(timeout=STARTUP_TIMEOUT_SECONDS)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()


def open_raw_channel(address: str) -> grpc.Channel:
    """A blocking channel with no limit of its own on message sizes: the server's limit is
    the one tested."""
    return grpc.insecure_channel(
        address,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )


def call(
    channel: grpc.Channel,
    method: MethodDescriptor,
    requests: Sequence[bytes],
    timeout_seconds: float,
) -> tuple[grpc.StatusCode, str]:
    """Sends `requests` as they are (one for a unary request, a stream of them otherwise),
    reads every response, and returns the call's status code and details."""
    code, details, _ = call_for_responses(channel, method, requests, timeout_seconds)
    return code, details


def call_for_responses(
    channel: grpc.Channel,
    method: MethodDescriptor,
    requests: Sequence[bytes],
    timeout_seconds: float,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """`call`, and the responses as they came."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    callable_ = kind(path)
    request = iter(requests) if method.client_streaming else requests[0]
    responses: list[bytes] = []
    try:
        reply = callable_(request, timeout=timeout_seconds)
        responses.extend(reply if method.server_streaming else [reply])
    except grpc.RpcError as e:
        return e.code(), e.details() or "", responses
    return grpc.StatusCode.OK, "", responses


def server_failed(method: MethodDescriptor, code: grpc.StatusCode) -> bool:
    """Whether `code`, the status of a call of `method`, is the server's failure rather than
    an answer about the request."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{method.containing_service.name}.{method.name}" not in MAY_ANSWER_DEADLINE_EXCEEDED
    return code in SERVER_FAILURES


def check_status(
    channel: grpc.Channel,
    method: MethodDescriptor,
    requests: Sequence[bytes],
    timeout_seconds: float,
) -> None:
    """Asserts that `requests` get a status that is not a server failure (`server_failed`), and
    that the service still reports SERVING after them."""
    code, details = call(channel, method, requests, timeout_seconds)
    assert not server_failed(method, code), f"{method.full_name}: {code.name}: {details}"
    assert serving_status(channel, method.containing_service.full_name) == "SERVING"


def padded(message: bytes, size_bytes: int) -> bytes:
    """`message` grown to `size_bytes` (up to 5 more) with an unknown field: still a valid
    encoding of the same message."""
    tag = _varint(PADDING_FIELD_NUMBER << 3 | 2)  # wire type 2: length-delimited
    length = max(size_bytes - len(message) - len(tag), 0)
    return message + tag + _varint(length) + b"x" * length


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def serving_status(channel: grpc.Channel, service: str) -> str:
    """The health status the server reports for `service`."""
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
