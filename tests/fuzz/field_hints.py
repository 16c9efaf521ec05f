"""Field hints for fuzzing the services' requests (`proto_strategies.messages`): values that get
a request past the checks a random one rarely passes (a served tool, an open session, a data
source, a parameter name of the model), so that what lies behind them is fuzzed too, and that
keep a call safe and cheap: a weight-sync rendezvous only ever on loopback with a short
timeout, `n` small (`n` has no upper bound yet: a huge one starts that many tasks), run names
that stay in the run folder. `SAFE_TO_SEND` holds damaged requests to the same rules."""

import json
import math

import torch
import yaml
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from turnrl import rpc
from turnrl.v1 import common_pb2, rollout_pb2
from turnrl.weights import DTYPES

from .fuzzed_services import RUN_NAME, TOOLS, Served
from .proto_strategies import TEXTS, messages, mostly

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Every temperature the engine samples at (rollout_svc/engines/hf.py: 0 <= temperature < inf),
# as float32 holds them: 0, subnormal ones, up to the largest.
ENGINE_TEMPERATURES = st.floats(0, float(torch.finfo(torch.float32).max), width=32)
# The longest a fuzzed weight-sync rendezvous may wait.
MAX_JOIN_SECONDS = 0.05


def field_hints(served: Served, shapes: dict[str, list[int]]) -> dict[str, st.SearchStrategy]:
    """Strategies for the fields whose random values would rarely get past validation, or
    would make a call unsafe or slow; a value from TEXTS, where given, keeps random text.
    `shapes` are the model's parameters."""
    tool_names = mostly(st.sampled_from(TOOLS), TEXTS)
    session_ids = mostly(st.sampled_from(served.session_ids), TEXTS)
    arguments = st.one_of(
        st.fixed_dictionaries({"expression": TEXTS}).map(json.dumps),
        st.fixed_dictionaries({"answer": TEXTS}).map(json.dumps),
        TEXTS,
    )
    ground_truth = st.fixed_dictionaries({"ground_truth": TEXTS | st.integers()}).map(_struct)
    data_sources = mostly(st.sampled_from(served.data_sources), TEXTS)
    # 0 takes the configured default; anything above the configured limits is refused.
    limits = mostly(st.just(0), st.integers(-(2**31), 2**31 - 1))
    int32s = st.integers(-(2**31), 2**31 - 1)
    run_names = mostly(st.just(RUN_NAME), _path_safe_texts())
    # A prompt with a role that is not set gets no further than validation.
    roles = mostly(st.sampled_from(range(1, 5)), int32s)
    prompt = _prompts(roles, tool_names, data_sources, mostly(st.just(""), TEXTS), {})
    return {
        "turnrl.v1.CreateSessionRequest.tool_name": tool_names,
        "turnrl.v1.CreateSessionRequest.session_kwargs": ground_truth
        | messages(struct_pb2.Struct.DESCRIPTOR),
        "turnrl.v1.ExecuteRequest.tool_name": tool_names,
        "turnrl.v1.ExecuteRequest.arguments": arguments,
        "turnrl.v1.ExecuteRequest.session_id": session_ids,
        "turnrl.v1.CalcRewardRequest.session_id": session_ids,
        "turnrl.v1.ReleaseSessionRequest.session_id": session_ids,
        "turnrl.v1.ScoringInput.data_source": data_sources,
        "turnrl.v1.GenerateRequest.prompts": st.lists(prompt, min_size=1, max_size=2),
        "turnrl.v1.GenerateRequest.n": mostly(st.integers(0, 2), int32s.filter(lambda n: n < 0)),
        # Any float: the engine samples at every temperature in [0, inf), however close to 0,
        # and refuses the rest (NaN, negatives, infinity); likewise every penalty in (0, inf).
        "turnrl.v1.SamplingParams.temperature": st.none() | st.floats(width=32),
        "turnrl.v1.SamplingParams.repetition_penalty": st.none() | st.floats(width=32),
        "turnrl.v1.LengthLimits.max_model_len": limits,
        "turnrl.v1.LengthLimits.max_response_length": limits,
        "turnrl.v1.LengthLimits.max_new_tokens": limits,
        # Never another machine; never a long wait for a group that cannot form.
        "turnrl.v1.InitWeightSyncRequest.master_address": st.sampled_from(LOOPBACK),
        "turnrl.v1.InitWeightSyncRequest.timeout": _durations(),
        "turnrl.v1.InitWeightSyncRequest.master_port": mostly(st.integers(1, 65_535), int32s),
        "turnrl.v1.InitWeightSyncRequest.world_size": mostly(st.integers(2, 4), int32s),
        "turnrl.v1.InitWeightSyncRequest.rank_offset": mostly(st.integers(1, 3), int32s),
        "turnrl.v1.InitWeightSyncRequest.backend": mostly(st.sampled_from([1, 2]), int32s),
        "turnrl.v1.TensorSpec.name": mostly(st.sampled_from(sorted(shapes)), TEXTS),
        "turnrl.v1.TensorSpec.shape": mostly(
            st.sampled_from(sorted(shapes.values())),
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
        ),
        "turnrl.v1.StartRunRequest.config_yaml": mostly(_trainer_configs(), TEXTS),
        "turnrl.v1.StartRunRequest.run_name": run_names,
        "turnrl.v1.GetRunRequest.run_name": run_names,
        "turnrl.v1.StreamProgressRequest.run_name": run_names,
        "turnrl.v1.StopRunRequest.run_name": run_names,
        "turnrl.v1.SaveCheckpointRequest.run_name": run_names,
    }


def generate_requests(served: Served) -> st.SearchStrategy[rollout_pb2.GenerateRequest]:
    """Generate requests that pass validation: 1 or 2 prompts, each with messages whose role is
    set, served tools, no interaction and finite JSON; limits left to the service; `n` 1 or 2;
    sampling values in range (the engine refuses others, ending the trajectory), temperatures
    over all the engine takes (ENGINE_TEMPERATURES). Any text, and text only: the served model
    is a text model, which refuses images (tests/rollout_svc/test_rollout_images.py)."""
    valid = {
        "google.protobuf.Value.number_value": st.floats(-1e6, 1e6),
        "turnrl.v1.Message.content": st.lists(st.builds(common_pb2.ContentPart, text=TEXTS)),
    }
    prompt = _prompts(
        st.sampled_from(range(1, 5)),
        st.sampled_from(TOOLS),
        st.sampled_from(served.data_sources),
        st.just(""),
        valid,
    )
    sampling = st.builds(
        common_pb2.SamplingParams,
        temperature=ENGINE_TEMPERATURES,
        top_p=st.floats(0.125, 1, width=32),
        top_k=st.integers(0, 50),
        min_p=st.floats(0, 0.5, width=32),
        repetition_penalty=st.floats(0.5, 2, width=32),
        seed=st.integers(-(2**63), 2**63 - 1),
        stop_token_ids=st.lists(st.integers(0, 100), max_size=2),
    )
    return st.builds(
        rollout_pb2.GenerateRequest,
        prompts=st.lists(prompt, min_size=1, max_size=2),
        n=st.integers(1, 2),
        sampling=sampling,
        max_turns=st.integers(0, 3),
        enable_scoring=st.booleans(),
        request_id=TEXTS,
    )


def _prompts(
    roles: st.SearchStrategy[int],
    tool_names: st.SearchStrategy[str],
    data_sources: st.SearchStrategy[str],
    interaction_names: st.SearchStrategy[str],
    hints: dict[str, st.SearchStrategy],
) -> st.SearchStrategy[rollout_pb2.RolloutPrompt]:
    chat = st.lists(
        messages(common_pb2.Message.DESCRIPTOR, hints | {"turnrl.v1.Message.role": roles}),
        min_size=1,
        max_size=3,
    )
    return messages(
        rollout_pb2.RolloutPrompt.DESCRIPTOR,
        hints
        | {
            "turnrl.v1.RolloutPrompt.messages": chat,
            "turnrl.v1.RolloutPrompt.data_source": data_sources,
            "turnrl.v1.RolloutPrompt.tool_names": st.lists(tool_names, max_size=2),
            "turnrl.v1.RolloutPrompt.interaction_name": interaction_names,
        },
    )


def weight_pushes(shapes: dict[str, list[int]]) -> st.SearchStrategy[list]:
    """PushWeights streams the service loads: a header naming one small parameter of the
    model, then random finite values for it in one or two chunks. (Not NaN: see
    test_a_push_of_non_finite_weights_leaves_the_engine_serving.)"""
    small = sorted(name for name, shape in shapes.items() if math.prod(shape) <= 4096)

    @st.composite
    def push(draw) -> list:
        name = draw(st.sampled_from(small))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        seed, scale = draw(st.integers(0, 2**32)), draw(st.sampled_from([0.0, 0.01, 1.0, 3.0]))
        values = torch.randn(shapes[name], generator=torch.Generator().manual_seed(seed))
        data = tensor_bytes(values * scale, DTYPES[dtype])
        cut = draw(st.integers(0, len(data)))
        header = rollout_pb2.PushWeightsHeader(
            tensors=[rollout_pb2.TensorSpec(name=name, dtype=dtype, shape=shapes[name])],
            policy_version=draw(st.integers(1, 2**62)),
        )
        chunks = [(0, data[:cut]), (cut, data[cut:])]
        return [
            rollout_pb2.PushWeightsRequest(header=header),
            *(
                rollout_pb2.PushWeightsRequest(
                    chunk=rollout_pb2.TensorChunk(tensor_index=0, offset_bytes=offset, data=part)
                )
                for offset, part in chunks
                if part
            ),
        ]

    return push()


def tensor_bytes(values: torch.Tensor, dtype: torch.dtype) -> bytes:
    return values.to(dtype).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _struct(values: dict) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def _joins_briefly_on_loopback(data: bytes) -> bool:
    """Whether InitWeightSync with these bytes could at most wait MAX_JOIN_SECONDS for a
    rendezvous on loopback: a damaged request could name another host (a DNS lookup, traffic
    off this machine) or lose its timeout (a wait of minutes)."""
    try:
        request = rollout_pb2.InitWeightSyncRequest.FromString(data)
    except DecodeError:
        return True
    seconds = request.timeout.seconds + request.timeout.nanos / 1e9
    return (
        request.master_address in LOOPBACK
        and request.HasField("timeout")
        and seconds <= MAX_JOIN_SECONDS
    )


def _generates_little(data: bytes) -> bool:
    """Whether Generate with these bytes rolls out at most 4 trajectories: a damaged `n` could
    ask for billions, which the service would start."""
    try:
        request = rollout_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return True
    return len(request.prompts) * max(request.n, 1) <= 4


# For the RPCs whose damaged requests could be unsafe or slow: whether some bytes are not.
SAFE_TO_SEND = {"InitWeightSync": _joins_briefly_on_loopback, "Generate": _generates_little}


def _durations() -> st.SearchStrategy[duration_pb2.Duration]:
    """Up to MAX_JOIN_SECONDS; or none at all, or more than a Duration may hold, which are
    refused."""
    short = st.builds(
        duration_pb2.Duration,
        seconds=st.just(0),
        nanos=st.integers(0, int(MAX_JOIN_SECONDS * 1e9)),
    )
    not_positive = st.builds(
        duration_pb2.Duration,
        seconds=st.integers(-(2**63), 0),
        nanos=st.integers(-(2**31), 0),
    )
    too_long = st.builds(
        duration_pb2.Duration,
        seconds=st.integers(rpc.MAX_DURATION_SECONDS + 1, 2**63 - 1),
        nanos=st.integers(-999_999_999, 999_999_999),
    )
    return short | not_positive | too_long


def _path_safe_texts() -> st.SearchStrategy[str]:
    # Run names become folders. The service refuses one with a separator, but should that ever
    # break, a fuzzed run must still stay under the temporary folder.
    return TEXTS.filter(lambda name: "/" not in name)


def _trainer_configs() -> st.SearchStrategy[str]:
    """YAML of a trainer section with a few of its keys, each valid or not."""
    section = st.fixed_dictionaries(
        {},
        optional={
            "steps": st.integers(-2, 3) | TEXTS,
            "mode": st.sampled_from(["rl", "sft"]) | TEXTS,
            "loop": st.sampled_from(["sync", "async"]) | TEXTS,
            "ranks": st.integers(-1, 3),
            "run_name": _path_safe_texts(),
            "eval_every": st.integers(-1, 3),
            "checkpoint": st.fixed_dictionaries(
                {"every": st.integers(-1, 3), "keep_last": st.integers(-1, 3)}
            ),
            "model_path": st.none() | TEXTS,
        },
    )
    unknown_keys = st.dictionaries(TEXTS, TEXTS, max_size=1)
    sections = st.tuples(section, unknown_keys).map(lambda parts: {**parts[1], **parts[0]})
    return st.fixed_dictionaries({"trainer": sections}).map(yaml.safe_dump)
