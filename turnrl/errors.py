"""Domain errors. Services raise these; `turnrl.rpc` maps each to one gRPC status code.

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
