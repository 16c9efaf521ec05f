"""The fault table of turnrl/failures.py covers every failure kind on the wire exactly once."""

from turnrl import failures
from turnrl.v1 import reward_pb2, tool_pb2


def test_every_tool_error_kind_is_either_the_models_or_the_systems():
    kinds = set(tool_pb2.ToolError.Kind.values()) - {tool_pb2.ToolError.KIND_UNSPECIFIED}
    model, system = failures.MODEL_TOOL_ERROR_KINDS, failures.SYSTEM_TOOL_ERROR_KINDS
    assert not model & system
    assert model | system == kinds
    assert model >= failures.CODE_TOOL_ERROR_KINDS


def test_every_scoring_failure_is_either_the_models_or_the_systems():
    wire = set(reward_pb2.ScoringResult.Failure.values()) - {
        reward_pb2.ScoringResult.FAILURE_UNSPECIFIED
    }
    assert {failure.value for failure in failures.ScoringFailure} == wire
    model, system = failures.MODEL_SCORING_FAILURES, failures.SYSTEM_SCORING_FAILURES
    assert not model & system and model | system == set(failures.ScoringFailure)


def test_only_the_rpc_errors_that_answer_what_the_model_wrote_are_its_own():
    assert failures.tool_rpc_error_is_models("Execute", "INVALID_ARGUMENT")
    assert failures.tool_rpc_error_is_models("CreateSession", "NOT_FOUND")
    for rpc, status in [
        ("Execute", "FAILED_PRECONDITION"),  # the tool could not start
        ("Execute", "DEADLINE_EXCEEDED"),
        ("Execute", "RESOURCE_EXHAUSTED"),
        ("CreateSession", "INVALID_ARGUMENT"),  # the data's session kwargs
        ("CreateSession", "UNAVAILABLE"),
    ]:
        assert not failures.tool_rpc_error_is_models(rpc, status), (rpc, status)


def test_every_agent_failure_is_the_systems():
    assert set(failures.AgentFailure) == failures.SYSTEM_AGENT_FAILURES
    assert all(failure.startswith("agent_") for failure in failures.AgentFailure)
