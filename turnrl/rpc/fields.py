"""The request fields whose conversion a bad value breaks: each raises InvalidArgumentError
naming the field, so the caller gets INVALID_ARGUMENT rather than INTERNAL."""

from typing import Any

from google.protobuf import duration_pb2, json_format
from google.protobuf.message import Message

from turnrl import errors

# The most a google.protobuf.Duration may hold: 10,000 years.
MAX_DURATION_SECONDS = 315_576_000_000


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
