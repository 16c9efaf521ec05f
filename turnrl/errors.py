"""Domain errors. Services raise these; `turnrl.rpc` maps each to one gRPC status code, and
its channels raise a failed call as the `RpcError` of its status, so no caller imports grpc.

Messages say what was wrong, the offending value with `!r`, and what was allowed, e.g.
`unknown data_source 'gsm8k_v2'; known: ['gsm8k', 'math']`.
"""


class TurnrlError(Exception):
    """Base of every error turnrl reports to a caller."""


class InvalidArgumentError(TurnrlError):
    """A field is malformed, an enum is UNSPECIFIED, lengths disagree, a token id is out of range."""


class NotFoundError(TurnrlError):
    """An unknown tool, scorer, session, run or engine."""


class AlreadyExistsError(TurnrlError):
    """A resource of that name exists already (a run name, a session id)."""


class FailedPreconditionError(TurnrlError):
    """The system is not in a state to do this: engine paused, session closed, stale version."""


class ResourceExhaustedError(TurnrlError):
    """A concurrency cap, rate limit or queue bound refused the request."""


class DeadlineExceededError(TurnrlError):
    """A tool, scorer or engine call ran past its time."""


class UnavailableError(TurnrlError):
    """A dependency is not up yet; the caller may retry."""


class ConfigError(TurnrlError):
    """A config file or override is invalid; the message names the key and where it came from."""


class RpcError(TurnrlError):
    """A call to another service ended with a status other than OK.

    The channels of `turnrl.rpc.open_channel` raise it instead of grpc's own error: as the
    subclass below for a status that has a domain error (`RpcNotFoundError` is a NotFoundError,
    so `except NotFoundError` catches a NOT_FOUND from another service like a local one), as
    RpcError itself for the rest (CANCELLED, UNAUTHENTICATED, UNIMPLEMENTED, INTERNAL, ...).
    `except RpcError` catches every failed call. Raised in a handler, it maps to the status of
    its domain error (INTERNAL for a bare RpcError), like any turnrl error.
    """

    def __init__(self, message: str, *, method: str, address: str, status: str, details: str):
        super().__init__(message)
        self.method = method
        """The full RPC name, e.g. '/turnrl.v1.ToolService/Execute'."""
        self.address = address
        """The channel's target, e.g. '127.0.0.1:50051'."""
        self.status = status
        """The status code's name, e.g. 'NOT_FOUND'."""
        self.details = details
        """The server's message."""


class RpcInvalidArgumentError(RpcError, InvalidArgumentError):
    """INVALID_ARGUMENT from another service."""


class RpcNotFoundError(RpcError, NotFoundError):
    """NOT_FOUND from another service."""


class RpcAlreadyExistsError(RpcError, AlreadyExistsError):
    """ALREADY_EXISTS from another service."""


class RpcFailedPreconditionError(RpcError, FailedPreconditionError):
    """FAILED_PRECONDITION from another service."""


class RpcResourceExhaustedError(RpcError, ResourceExhaustedError):
    """RESOURCE_EXHAUSTED from another service."""


class RpcDeadlineExceededError(RpcError, DeadlineExceededError):
    """DEADLINE_EXCEEDED from another service, or the call's own deadline passed."""


class RpcUnavailableError(RpcError, UnavailableError):
    """UNAVAILABLE from another service, or no connection to it; `rpc.call_idempotent` retries."""
