"""Every RPC of the four services, fuzzed on loopback: requests built by Hypothesis from the
proto descriptors, bytes that are cut short or overwritten, and messages past the server's
size limit. A service answers each with OK or a status that names the caller's mistake
(INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED...), never INTERNAL or
UNKNOWN, and still reports SERVING after it.

The services (tests/fuzz/fuzzed_services.py) start once for the module and run in a thread of
their own (tests/fuzz/rpc_fuzzing.py); field hints (tests/fuzz/field_hints.py) steer requests
past validation and keep them safe. What fuzzing found is at the end, each with its request.
"""

import math
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from tests.conftest import free_port
from trainer_svc import service as trainer_service_module
from turnrl.v1 import common_pb2, reward_pb2, rollout_pb2, tool_pb2, trainer_pb2

from .field_hints import (
    SAFE_TO_SEND,
    field_hints,
    generate_requests,
    tensor_bytes,
    weight_pushes,
)
from .fuzzed_services import (
    MAX_MESSAGE_BYTES,
    SERVICES,
    EndsAtOnce,
    Served,
    four_services,
    rollout_service,
)
from .proto_strategies import damaged, messages
from .rpc_fuzzing import (
    call,
    call_for_responses,
    check_status,
    open_raw_channel,
    padded,
    server_failed,
    serving_in_thread,
)
from .rpc_fuzzing import serving_status as health

RPCS = [method for service in SERVICES for method in service.methods]
# Calls that do real work get fewer examples and more time.
EXAMPLES_BY_RPC = {"Generate": settings.default.max_examples // 2}
TIMEOUT_SECONDS_BY_RPC = {"Generate": 60.0}
DEFAULT_TIMEOUT_SECONDS = 20.0


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        for loop in ("sync", "async", "sft"):
            patch.setitem(trainer_service_module.LOOPS, loop, EndsAtOnce)
        # A run's output_dir is relative: runs/<name> under the current folder.
        patch.chdir(tmp_path_factory.mktemp("fuzzed_runs"))
        with serving_in_thread(lambda: four_services(tiny_model_dir)) as result:
            yield result


@pytest.fixture(scope="module")
def channels(served: Served):
    opened = {name: open_raw_channel(address) for name, address in served.addresses.items()}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def shapes(tiny_model_dir: Path) -> dict[str, list[int]]:
    """The shape of each parameter of the fuzzed model."""
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as weights:
        return {name: weights.get_slice(name).get_shape() for name in weights.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def hints(served: Served, shapes) -> dict[str, st.SearchStrategy]:
    return field_hints(served, shapes)


@pytest.fixture(autouse=True)
def engine_resumed(channels):
    """Resumes generation after each test: a fuzzed Pause must not stall later Generates."""
    yield
    rollout = channels[SERVICES[2].full_name]
    code, details = call(rollout, SERVICES[2].methods_by_name["Resume"], [b""], 10.0)
    assert code == grpc.StatusCode.OK, details


def requests(method: MethodDescriptor, hints: dict, shapes: dict) -> st.SearchStrategy[list]:
    """One request, or for a client-streaming RPC a stream of them (maybe none)."""
    request = messages(method.input_type, hints)
    if method.name == "PushWeights":
        return st.lists(request, max_size=3) | weight_pushes(shapes)
    if method.client_streaming:
        return st.lists(request, max_size=3)
    return request.map(lambda message: [message])


def rpc_timeout(method: MethodDescriptor) -> float:
    return TIMEOUT_SECONDS_BY_RPC.get(method.name, DEFAULT_TIMEOUT_SECONDS)


def rpc_id(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


@pytest.mark.parametrize("method", RPCS, ids=rpc_id)
def test_random_requests_get_a_status_that_is_not_a_server_failure(method, channels, hints, shapes):
    channel = channels[method.containing_service.full_name]

    @settings(max_examples=EXAMPLES_BY_RPC.get(method.name, settings.default.max_examples))
    @given(st.data())
    def fuzz(data):
        sent = data.draw(requests(method, hints, shapes), label="requests")
        check_status(channel, method, [m.SerializeToString() for m in sent], rpc_timeout(method))

    fuzz()


@settings(max_examples=settings.default.max_examples // 2)
@given(data=st.data())
def test_a_generate_that_passes_validation_returns_every_trajectory(data, served, channels):
    """Past validation, what the prompts hold (any text, tools, sampling values) cannot fail
    the call: each of the n samples of each prompt comes back, its masks one per token."""
    request = data.draw(generate_requests(served), label="request")
    generate = SERVICES[2].methods_by_name["Generate"]
    channel = channels[SERVICES[2].full_name]
    code, details, replies = call_for_responses(
        channel, generate, [request.SerializeToString()], TIMEOUT_SECONDS_BY_RPC["Generate"]
    )
    assert code == grpc.StatusCode.OK, f"{code.name}: {details}"
    trajectories = [rollout_pb2.GenerateResponse.FromString(r).trajectory for r in replies]
    expected = [p.prompt_id or f"prompt-{i}" for i, p in enumerate(request.prompts)]
    assert sorted(t.group_id for t in trajectories) == sorted(expected * request.n)
    # The engine still generates (a dead one refuses a pause as closed).
    pause, resume = (SERVICES[2].methods_by_name[name] for name in ("Pause", "Resume"))
    assert call(channel, pause, [b""], 10.0) == (grpc.StatusCode.OK, "")
    assert call(channel, resume, [b""], 10.0) == (grpc.StatusCode.OK, "")
    for trajectory in trajectories:
        assert trajectory.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        model = common_pb2.SEGMENT_SOURCE_MODEL
        sources = [s.source for s in trajectory.segments for _ in s.token_ids]
        assert list(trajectory.loss_mask) == [source == model for source in sources]
        assert len(trajectory.response_mask) == len(sources)


@pytest.mark.parametrize("method", RPCS, ids=rpc_id)
def test_damaged_bytes_get_a_status_that_is_not_a_server_failure(method, channels, hints):
    channel = channels[method.containing_service.full_name]
    encoded = messages(method.input_type, hints).map(lambda message: message.SerializeToString())
    count = (1, 3) if method.client_streaming else (1, 1)

    @settings(max_examples=EXAMPLES_BY_RPC.get(method.name, settings.default.max_examples))
    @given(st.lists(damaged(encoded), min_size=count[0], max_size=count[1]))
    def fuzz(sent):
        if method.name in SAFE_TO_SEND:
            assume(SAFE_TO_SEND[method.name](sent[0]))
        check_status(channel, method, sent, rpc_timeout(method))

    fuzz()


@pytest.mark.parametrize("method", RPCS, ids=rpc_id)
def test_a_message_past_the_size_limit_is_refused(method, channels):
    channel = channels[method.containing_service.full_name]
    oversized = padded(b"", MAX_MESSAGE_BYTES + 1)
    code, details = call(channel, method, [oversized], DEFAULT_TIMEOUT_SECONDS)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code.name}: {details}"
    assert health(channel, method.containing_service.full_name) == "SERVING"


@pytest.mark.parametrize("method", RPCS, ids=rpc_id)
def test_a_message_just_under_the_size_limit_is_served(method, channels):
    """An empty request padded with an unknown field to the limit: served as the empty one."""
    channel = channels[method.containing_service.full_name]
    almost = padded(b"", MAX_MESSAGE_BYTES - 64)
    code, details = call(channel, method, [almost], rpc_timeout(method))
    failed = server_failed(method, code) or code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not failed, f"{code.name}: {details}"
    assert health(channel, method.containing_service.full_name) == "SERVING"


def _score_request(**scoring_input) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(input=reward_pb2.ScoringInput(**scoring_input))


def _join_request(**fields) -> rollout_pb2.InitWeightSyncRequest:
    defaults = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    defaults |= {"rank_offset": 1, "backend": rollout_pb2.InitWeightSyncRequest.BACKEND_GLOO}
    defaults |= {"timeout": duration_pb2.Duration(nanos=10_000_000)}
    return rollout_pb2.InitWeightSyncRequest(**(defaults | fields))


def _start_request(run_name: str = "", **trainer) -> trainer_pb2.StartRunRequest:
    config_yaml = yaml.safe_dump({"trainer": {"steps": 1, **trainer}})
    return trainer_pb2.StartRunRequest(config_yaml=config_yaml, run_name=run_name, resume=True)


def _generate_request(n: int = 1, **sampling) -> rollout_pb2.GenerateRequest:
    text = common_pb2.ContentPart(text="What is 2 + 3?")
    prompt = rollout_pb2.RolloutPrompt(
        messages=[common_pb2.Message(role=common_pb2.Message.ROLE_USER, content=[text])]
    )
    return rollout_pb2.GenerateRequest(
        prompts=[prompt], n=n, sampling=common_pb2.SamplingParams(**sampling)
    )


INFINITY = struct_pb2.Value(number_value=math.inf)
# What fuzzing found, each answered INTERNAL or UNKNOWN before its fix: (RPC, requests,
# status, words of its details).
FOUND = [
    # grpc answered bytes that do not parse with UNKNOWN.
    ("ToolService.Execute", [b"\x00"], "INVALID_ARGUMENT", "does not parse"),
    ("RolloutService.PushWeights", [b"\xff"], "INVALID_ARGUMENT", "does not parse"),
    # A Duration past timedelta's range: OverflowError.
    (
        "ToolService.CreateSession",
        [tool_pb2.CreateSessionRequest(tool_name="calculator", ttl={"seconds": 2**62})],
        "INVALID_ARGUMENT",
        "ttl must be positive and at most",
    ),
    # A TTL whose expiry falls past the year 9999: OverflowError from datetime.
    (
        "ToolService.CreateSession",
        [tool_pb2.CreateSessionRequest(tool_name="calculator", ttl={"seconds": 300_000_000_000})],
        "INVALID_ARGUMENT",
        "the last time expire_time holds",
    ),
    # Infinity in a Struct or Value: ValueError from json_format.
    (
        "ToolService.CreateSession",
        [
            tool_pb2.CreateSessionRequest(
                tool_name="gsm8k_answer", session_kwargs={"fields": {"ground_truth": INFINITY}}
            )
        ],
        "INVALID_ARGUMENT",
        "session_kwargs: Fail to serialize Infinity",
    ),
    (
        "RewardService.Score",
        [_score_request(data_source="openai/gsm8k", ground_truth=INFINITY)],
        "INVALID_ARGUMENT",
        "input.ground_truth: Fail to serialize Infinity",
    ),
    (
        "RolloutService.Generate",
        [
            rollout_pb2.GenerateRequest(
                prompts=[
                    rollout_pb2.RolloutPrompt(
                        messages=[common_pb2.Message(role=common_pb2.Message.ROLE_USER)],
                        extra_info={"fields": {"x": INFINITY}},
                    )
                ]
            )
        ],
        "INVALID_ARGUMENT",
        "prompts[0].extra_info: Fail to serialize Infinity",
    ),
    # A bad item of a stream: its InvalidArgumentError came wrapped in an ExceptionGroup.
    (
        "RewardService.ScoreBatch",
        [reward_pb2.ScoreBatchRequest(item_id="a")],
        "INVALID_ARGUMENT",
        "input.data_source is required",
    ),
    # A port past 65535: TypeError from torch's TCPStore.
    (
        "RolloutService.InitWeightSync",
        [_join_request(master_port=70_000)],
        "INVALID_ARGUMENT",
        "master_port",
    ),
    (
        "RolloutService.InitWeightSync",
        [_join_request(timeout={"seconds": 2**62})],
        "INVALID_ARGUMENT",
        "timeout must be positive and at most",
    ),
    # No group forms in time: a TimeoutError, which the proto documents as DEADLINE_EXCEEDED.
    ("RolloutService.InitWeightSync", [_join_request()], "DEADLINE_EXCEEDED", "could not join"),
    # Run folders the OS refuses: ValueError (a NUL) or OSError (a name too long).
    ("TrainerService.StartRun", [_start_request("a\x00b")], "INVALID_ARGUMENT", "cannot write"),
    ("TrainerService.StartRun", [_start_request("x" * 300)], "INVALID_ARGUMENT", "cannot write"),
    (
        "TrainerService.StartRun",
        [_start_request(output_dir="\x00")],
        "INVALID_ARGUMENT",
        "cannot write",
    ),
    # n has no upper bound in the proto: 2**31 - 1 trajectories were started as tasks.
    (
        "RolloutService.Generate",
        [_generate_request(n=2**31 - 1)],
        "INVALID_ARGUMENT",
        "max_trajectories_per_call",
    ),
    # A run name that is a path wrote the run outside trainer.output_dir.
    ("TrainerService.StartRun", [_start_request("..")], "INVALID_ARGUMENT", "not a folder name"),
    (
        "TrainerService.StartRun",
        [_start_request("../escaped")],
        "INVALID_ARGUMENT",
        "not a folder name",
    ),
]
METHODS = {rpc_id(method): method for method in RPCS}


@pytest.mark.parametrize(
    ("rpc", "sent", "status", "words"), FOUND, ids=[f"{row[0]}-{row[3]}" for row in FOUND]
)
def test_what_fuzzing_found_gets_its_status(rpc, sent, status, words, channels):
    method = METHODS[rpc]
    channel = channels[method.containing_service.full_name]
    encoded = [r if isinstance(r, bytes) else r.SerializeToString() for r in sent]
    code, details = call(channel, method, encoded, DEFAULT_TIMEOUT_SECONDS)
    assert (code.name, words in details) == (status, True), details
    assert health(channel, method.containing_service.full_name) == "SERVING"


def _nan_push(shapes: dict[str, list[int]]) -> list[rollout_pb2.PushWeightsRequest]:
    name = "model.norm.weight"
    nan = tensor_bytes(torch.full(shapes[name], math.nan), torch.float32)
    spec = rollout_pb2.TensorSpec(
        name=name, dtype=rollout_pb2.TensorSpec.D_TYPE_FLOAT32, shape=shapes[name]
    )
    return [
        rollout_pb2.PushWeightsRequest(
            header=rollout_pb2.PushWeightsHeader(tensors=[spec], policy_version=1)
        ),
        rollout_pb2.PushWeightsRequest(chunk=rollout_pb2.TensorChunk(tensor_index=0, data=nan)),
    ]


# Each ended the hf engine's worker (torch.multinomial on NaN probabilities) before its fix:
# the engine then refused every call as closed while the service reported SERVING.
@pytest.mark.parametrize(
    ("pushed", "sampling", "error"),
    [
        # The model's logits are NaN: the trajectory fails, flagged, and the engine goes on.
        pytest.param(True, {}, "logits are NaN", id="a NaN weight pushed"),
        # Above 0, so sampled; small enough that logits / temperature overflow to infinity.
        pytest.param(False, {"temperature": 1e-45}, "", id="a subnormal temperature"),
        pytest.param(False, {"repetition_penalty": 1e-45}, "", id="a subnormal penalty"),
    ],
)
def test_one_generate_leaves_the_engine_serving(
    pushed, sampling, error, served, shapes, tiny_model_dir
):
    tool, reward = (served.addresses[service.full_name] for service in SERVICES[:2])
    with serving_in_thread(lambda: rollout_service(tiny_model_dir, tool, reward)) as address:
        channel = open_raw_channel(address)
        methods = SERVICES[2].methods_by_name
        if pushed:
            push = [request.SerializeToString() for request in _nan_push(shapes)]
            call(channel, methods["PushWeights"], push, 30.0)
        generate = _generate_request(**sampling).SerializeToString()
        timeout = TIMEOUT_SECONDS_BY_RPC["Generate"]
        _, _, replies = call_for_responses(channel, methods["Generate"], [generate], timeout)
        code, details = call(channel, methods["Pause"], [b""], 10.0)
        channel.close()
    (trajectory,) = (rollout_pb2.GenerateResponse.FromString(r).trajectory for r in replies)
    assert code == grpc.StatusCode.OK, details
    failed = trajectory.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert (failed, error in trajectory.error_message) == (bool(error), True), trajectory
