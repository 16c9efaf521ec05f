"""Whose fault a failure is: the rule of DESIGN.md "Failures", written down once and followed
by the tool service, the reward service and the rollout's agent loop.

The model's fault: its tool call had bad arguments, its code raised or ran past the tool's own
time limit, its answer is unparsable or wrong, or a scorer failed on what it wrote. The model
reads it as an observation, or earns it as its reward.

The system's fault: a service was down, a call waited past its caller's deadline in a queue, a
tool or scorer could not start or is broken, an engine or agent process crashed. The
trajectory stays out of the loss and of its group's statistics and is counted; the trainer
reads the mark from the record (trainer_svc/rl_step.py `infra_failed`): `reward.error`, the
"tool_infra_errors" metric, or the finish reason ERROR or ABORTED.

Rule scorers and plugins grade the model's text in a worker process, so a scorer that raises,
hangs or dies on one response may have been made to by the response (math-verify on a
pathological expression) or may be broken. The reward service tells the two apart by grading
the ground truth alone in the response's place: a scorer that grades it is sound, and the
response's failure is the model's (`error_score`, the lowest score, with the reason in
`extras["error"]`); a scorer that fails on it too is broken, the system's. A response past
`max_response_bytes` is the model's: the model wrote it, so it earns `error_score`, never an
exclusion that would spare it the consequence of writing it.

A user's agent that the rollout runs as a process of its own (rollout_svc/agent_runner.py)
and that ends without a result, whatever the reason (`AgentFailure`), is the system's: the
model's turns reach that agent as replies it reads, so its process crashing, hanging or
raising is the agent program's failure, not a turn the model took.
"""

import enum

from turnrl.v1 import reward_pb2, tool_pb2

ToolKind = tool_pb2.ToolError.Kind

# Tool error results the model caused: an observation it reads, and the trajectory trains.
MODEL_TOOL_ERROR_KINDS = frozenset(
    {
        ToolKind.KIND_INVALID_ARGUMENTS,  # malformed or schema-invalid arguments
        ToolKind.KIND_UNKNOWN_TOOL,  # a tool name the service does not serve
        ToolKind.KIND_TOO_LARGE,  # arguments past the service's size limit
        ToolKind.KIND_TIMEOUT,  # the model's code ran past the tool's own time limit
        ToolKind.KIND_EXECUTION_FAILED,  # the model's code raised, exited non-zero, hit a limit
    }
)
# Of those, the failures of code that ran: what a candidate program is graded on.
CODE_TOOL_ERROR_KINDS = frozenset({ToolKind.KIND_TIMEOUT, ToolKind.KIND_EXECUTION_FAILED})
# Tool error results the system caused: the model reads them too, and the trajectory is
# counted in "tool_infra_errors" and kept out of the loss.
SYSTEM_TOOL_ERROR_KINDS = frozenset(
    {
        ToolKind.KIND_UNKNOWN_SESSION,  # the session id is the rollout's, never the model's
        ToolKind.KIND_RATE_LIMITED,  # the tool's rate limit refused the call
        ToolKind.KIND_UNAVAILABLE,  # a dependency of the tool (retriever, MCP server) is down
        ToolKind.KIND_INTERNAL,  # a bug in the tool
        ToolKind.KIND_DEADLINE_EXCEEDED,  # the caller's deadline cut the call short
    }
)
# RPC errors of the tool service that answer what the model wrote, by RPC; every other status
# (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, a session kwarg of the data refused, a
# tool that could not start) is the system's.
MODEL_TOOL_RPC_STATUSES = {
    "Execute": frozenset({"INVALID_ARGUMENT"}),  # an empty tool name
    "CreateSession": frozenset({"NOT_FOUND"}),  # a tool name the service does not serve
}


class ScoringFailure(enum.Enum):
    """Why the reward service could not grade an item; values are the wire enum's."""

    RESPONSE_TOO_LARGE = reward_pb2.ScoringResult.FAILURE_RESPONSE_TOO_LARGE
    SCORER_FAILED_ON_RESPONSE = reward_pb2.ScoringResult.FAILURE_SCORER_FAILED_ON_RESPONSE
    SCORER_BROKEN = reward_pb2.ScoringResult.FAILURE_SCORER_BROKEN
    SCORER_UNAVAILABLE = reward_pb2.ScoringResult.FAILURE_SCORER_UNAVAILABLE
    UNKNOWN_DATA_SOURCE = reward_pb2.ScoringResult.FAILURE_UNKNOWN_DATA_SOURCE


# Scoring failures the model caused: scored `error_score`, and the trajectory trains on it.
MODEL_SCORING_FAILURES = frozenset(
    {ScoringFailure.RESPONSE_TOO_LARGE, ScoringFailure.SCORER_FAILED_ON_RESPONSE}
)
# Scoring failures the system caused: `reward.error` is set, and the trajectory is excluded.
SYSTEM_SCORING_FAILURES = frozenset(ScoringFailure) - MODEL_SCORING_FAILURES


def tool_rpc_error_is_models(rpc: str, status: str) -> bool:
    """Whether a tool service RPC failing with `status` (a StatusCode name) answered what the
    model wrote, rather than failing to run its call."""
    return status in MODEL_TOOL_RPC_STATUSES.get(rpc, frozenset())


class AgentFailure(enum.StrEnum):
    """Why a user's agent process ended without a result (rollout_svc/agent_runner.py)."""

    COULD_NOT_START = "agent_could_not_start"  # its command or interpreter could not be run
    RAISED = "agent_raised"  # the agent function raised an exception
    CRASHED = "agent_crashed"  # its process exited non-zero or was killed by a signal
    TIMED_OUT = "agent_timed_out"  # it ran past the runner's time limit and was killed
    BAD_RESULT = "agent_bad_result"  # it printed no result, or one that is not JSON or the contract


# Every agent failure is the system's: the trajectory is excluded and counted, never scored 0.
# An agent that raised is counted here too, as its code broke rather than a model turn; whether
# some exceptions (the model's reply unparsable by the agent) should be the model's is open.
SYSTEM_AGENT_FAILURES = frozenset(AgentFailure)
