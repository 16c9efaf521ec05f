"""Domain errors and gRPC status codes, both ways: `StatusMappingInterceptor` turns a
servicer's `turnrl.errors` exception into its status (and a request that does not parse into
INVALID_ARGUMENT), `RPC_ERROR_BY_STATUS` names what a failed call on an `open_channel` channel
raises.
"""

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from turnrl import errors

log = logging.getLogger(__name__)

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

            return replace_behavior(handler, mapped_stream)

        async def mapped(request: Any, context: grpc.aio.ServicerContext):
            try:
                result = behavior(_parsed(request, streaming), context)
                # Only the generated base servicer's UNIMPLEMENTED methods are plain functions.
                return await result if inspect.isawaitable(result) else result
            except Exception as e:
                await _abort_for(e, context, method)

        return replace_behavior(handler, mapped)


async def _abort_for(error: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(error, asyncio.CancelledError):
        raise error
    if _is_abort(error):
        raise error  # context.abort() already set the status
    await context.abort(*status_for(error, method))


def status_for(error: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a servicer's exception is answered with, on gRPC and over
    HTTP/JSON (turnrl.rpc.http_json) alike: a `turnrl.errors` one's by STATUS_BY_ERROR, a bug
    INTERNAL (its traceback logged, the caller told only that it was internal)."""
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented yet"
    for error_type, code in STATUS_BY_ERROR.items():
        if isinstance(error, error_type):
            return code, str(error)
    log.exception("%s failed", method, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log"


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


def replace_behavior(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    kind = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[(handler.request_streaming, handler.response_streaming)]
    return handler._replace(**{kind: behavior})
