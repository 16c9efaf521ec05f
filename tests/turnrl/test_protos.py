"""Checks the wire contracts in protos/turnrl/v1/ against our API style guide (AIP-191/192).

The checks are plain functions over a FileDescriptorSet (or a FileDescriptor) so that each
one can be exercised on a deliberately broken proto; the tests run them on the real protos.
"""

import re
from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from grpc_tools import protoc

from turnrl import protogen
from turnrl.v1 import reward_pb2, rollout_pb2, tool_pb2, trainer_pb2

PACKAGE = "turnrl.v1"
PROTO_DIR = "turnrl/v1"

# descriptor.proto field numbers, the steps of a SourceCodeInfo.Location path.
FILE_MESSAGE_TYPE, FILE_ENUM_TYPE, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED_TYPE, MESSAGE_ENUM_TYPE, MESSAGE_ONEOF_DECL = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2

FieldProto = descriptor_pb2.FieldDescriptorProto
LOWER_SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
UPPER_SNAKE = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*")
DURATION = ".google.protobuf.Duration"

# (client_streaming, server_streaming) of every RPC the foundation issue requires.
UNARY, SERVER_STREAM, CLIENT_STREAM, BIDI = (
    (False, False),
    (False, True),
    (True, False),
    (True, True),
)
REQUIRED_RPCS = {
    (tool_pb2, "ToolService"): {
        "ListTools": UNARY,
        "CreateSession": UNARY,
        "Execute": UNARY,
        "CalcReward": UNARY,
        "ReleaseSession": UNARY,
    },
    (reward_pb2, "RewardService"): {
        "Score": UNARY,
        "ScoreBatch": BIDI,
        "ListScorers": UNARY,
    },
    (rollout_pb2, "RolloutService"): {
        "Generate": SERVER_STREAM,
        "Abort": UNARY,
        "Pause": UNARY,
        "Resume": UNARY,
        "InitWeightSync": UNARY,
        "UpdateWeights": UNARY,
        "PushWeights": CLIENT_STREAM,
        "GetStats": UNARY,
    },
    (trainer_pb2, "TrainerService"): {
        "StartRun": UNARY,
        "GetRun": UNARY,
        "StreamProgress": SERVER_STREAM,
        "StopRun": UNARY,
        "SaveCheckpoint": UNARY,
    },
}


def build_descriptor_set(
    proto_root: Path, proto_paths: list[str], out: Path
) -> descriptor_pb2.FileDescriptorSet:
    """Compiles `proto_paths` (relative to `proto_root`) with source info (comments) kept."""
    code = protoc.main(
        [
            "protoc",
            f"-I{proto_root}",
            f"-I{files('grpc_tools') / '_proto'}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *proto_paths,
        ]
    )
    assert code == 0, f"protoc failed with exit code {code} on {proto_paths}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    """Every .proto under protos/, wherever it lies, so a stray file is checked too."""
    proto_paths = sorted(
        p.relative_to(protogen.PROTO_ROOT).as_posix() for p in protogen.PROTO_ROOT.rglob("*.proto")
    )
    out = tmp_path_factory.mktemp("protos") / "descriptor_set.pb"
    return build_descriptor_set(protogen.PROTO_ROOT, proto_paths, out)


def upper_snake(camel: str) -> str:
    """`Role` -> `ROLE`, `DType` -> `D_TYPE`, `SegmentSource` -> `SEGMENT_SOURCE`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", camel).upper()


def synthetic_oneofs(message: descriptor_pb2.DescriptorProto) -> set[int]:
    """Indices of the oneofs protoc makes up for proto3 `optional` fields."""
    return {f.oneof_index for f in message.field if f.proto3_optional}


def enum_elements(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], scope: str):
    """(location path, fully qualified name) of an enum and its values."""
    name = f"{scope}.{enum.name}"
    yield path, name
    for i, value in enumerate(enum.value):
        yield (*path, ENUM_VALUE, i), f"{name}.{value.name}"


def message_elements(message: descriptor_pb2.DescriptorProto, path: tuple[int, ...], scope: str):
    """(location path, fully qualified name) of a message and everything declared in it."""
    if message.options.map_entry:  # made up by protoc for a map<K, V> field: no source
        return
    name = f"{scope}.{message.name}"
    yield path, name
    for i, field in enumerate(message.field):
        yield (*path, MESSAGE_FIELD, i), f"{name}.{field.name}"
    synthetic = synthetic_oneofs(message)
    for i, oneof in enumerate(message.oneof_decl):
        if i not in synthetic:
            yield (*path, MESSAGE_ONEOF_DECL, i), f"{name}.{oneof.name}"
    for i, nested in enumerate(message.nested_type):
        yield from message_elements(nested, (*path, MESSAGE_NESTED_TYPE, i), name)
    for i, enum in enumerate(message.enum_type):
        yield from enum_elements(enum, (*path, MESSAGE_ENUM_TYPE, i), name)


def file_elements(file: descriptor_pb2.FileDescriptorProto):
    """(location path, fully qualified name) of every element of a file that needs a comment."""
    for i, message in enumerate(file.message_type):
        yield from message_elements(message, (FILE_MESSAGE_TYPE, i), file.package)
    for i, enum in enumerate(file.enum_type):
        yield from enum_elements(enum, (FILE_ENUM_TYPE, i), file.package)
    for i, service in enumerate(file.service):
        name = f"{file.package}.{service.name}"
        yield (FILE_SERVICE, i), name
        for j, method in enumerate(service.method):
            yield (FILE_SERVICE, i, SERVICE_METHOD, j), f"{name}.{method.name}"


def missing_comments(descriptor_set: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Fully qualified names of every element without a non-empty leading comment."""
    missing = []
    for file in descriptor_set.file:
        comments = {
            tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location
        }
        missing += [name for path, name in file_elements(file) if not comments.get(path)]
    return missing


def all_messages(descriptor_set: descriptor_pb2.FileDescriptorSet):
    """(fully qualified name, DescriptorProto) of every message, nested ones included."""

    def walk(message: descriptor_pb2.DescriptorProto, scope: str):
        name = f"{scope}.{message.name}"
        yield name, message
        for nested in message.nested_type:
            yield from walk(nested, name)

    for file in descriptor_set.file:
        for message in file.message_type:
            yield from walk(message, file.package)


def all_enums(descriptor_set: descriptor_pb2.FileDescriptorSet):
    """(fully qualified name, EnumDescriptorProto) of every enum, nested ones included."""
    for file in descriptor_set.file:
        for enum in file.enum_type:
            yield f"{file.package}.{enum.name}", enum
    for name, message in all_messages(descriptor_set):
        for enum in message.enum_type:
            yield f"{name}.{enum.name}", enum


def package_problems(descriptor_set: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Files outside protos/turnrl/v1/ or in a package other than turnrl.v1."""
    problems = []
    for file in descriptor_set.file:
        if file.package != PACKAGE:
            problems.append(f"{file.name}: package {file.package!r}, expected {PACKAGE!r}")
        if Path(file.name).parent.as_posix() != PROTO_DIR:
            problems.append(f"{file.name}: lies outside protos/{PROTO_DIR}/")
    return problems


def rpc_message_problems(descriptor_set: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """RPCs whose messages are not `<Rpc>Request`/`<Rpc>Response` of their own package."""
    problems = []
    uses: Counter[str] = Counter()
    for file in descriptor_set.file:
        for service in file.service:
            for method in service.method:
                rpc = f"{file.package}.{service.name}.{method.name}"
                for kind, actual in (
                    ("Request", method.input_type),
                    ("Response", method.output_type),
                ):
                    expected = f".{file.package}.{method.name}{kind}"
                    uses[actual] += 1
                    if actual != expected:
                        problems.append(
                            f"{rpc}: {kind.lower()} is {actual[1:]}, expected {expected[1:]}"
                        )
    problems += [f"{name[1:]} is used by {n} RPCs" for name, n in uses.items() if n > 1]
    return problems


def enum_problems(descriptor_set: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Enum values without the enum's UPPER_SNAKE prefix, or a value 0 not `<PREFIX>_UNSPECIFIED`."""
    problems = []
    for name, enum in all_enums(descriptor_set):
        prefix = f"{upper_snake(enum.name)}_"
        for value in enum.value:
            if value.number == 0 and value.name != f"{prefix}UNSPECIFIED":
                problems.append(f"{name}: value 0 is {value.name}, expected {prefix}UNSPECIFIED")
            if not value.name.startswith(prefix) or not UPPER_SNAKE.fullmatch(value.name):
                problems.append(f"{name}.{value.name}: expected UPPER_SNAKE_CASE with {prefix}")
    return problems


def field_problems(descriptor_set: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Fields that break the naming rules or the type that their name promises."""
    problems = []
    for message_name, message in all_messages(descriptor_set):
        if message.options.map_entry:
            continue
        for field in message.field:
            name = f"{message_name}.{field.name}"
            repeated = field.label == FieldProto.LABEL_REPEATED
            if not LOWER_SNAKE.fullmatch(field.name):
                problems.append(f"{name}: field names are lower_snake_case")
            if field.name.endswith("token_ids") and not (
                repeated and field.type == FieldProto.TYPE_INT32
            ):
                problems.append(f"{name}: token ids are `repeated int32`")
            if field.name == "logprobs" and not (repeated and field.type == FieldProto.TYPE_FLOAT):
                problems.append(f"{name}: logprobs are `repeated float`")
            if field.name.endswith("_seconds") and field.type not in (
                FieldProto.TYPE_DOUBLE,
                FieldProto.TYPE_FLOAT,
            ):
                problems.append(f"{name}: *_seconds fields are double or float")
            if field.type_name == DURATION and field.name.endswith("_seconds"):
                problems.append(f"{name}: a google.protobuf.Duration is not named *_seconds")
    return problems


def service_shape_problems(file: FileDescriptor, service: str, rpcs: dict) -> list[str]:
    """RPCs of `rpcs` that `service` in `file` lacks or streams differently."""
    if service not in file.services_by_name:
        return [f"{file.package}.{service} is missing from {file.name}"]
    methods = file.services_by_name[service].methods_by_name
    problems = []
    for rpc, shape in rpcs.items():
        method = methods.get(rpc)
        if method is None:
            problems.append(f"{file.package}.{service}.{rpc} is missing")
        elif (method.client_streaming, method.server_streaming) != shape:
            actual = (method.client_streaming, method.server_streaming)
            problems.append(
                f"{file.package}.{service}.{rpc}: (client, server) streaming is {actual}, "
                f"expected {shape}"
            )
    return problems


def stub_drift(generated: list[Path], stubs_dir: Path) -> list[str]:
    """Committed stubs that differ from, lack, or outlive the freshly `generated` ones."""
    problems = []
    for path in generated:
        committed = stubs_dir / path.name
        if not committed.exists():
            problems.append(f"{committed.name} is not committed")
        elif committed.read_bytes() != path.read_bytes():
            problems.append(f"{committed.name} differs from what the protos generate")
    names = {path.name for path in generated}
    problems += [
        f"{stale.name} is stale: no proto generates it"
        for stale in sorted(stubs_dir.glob("*_pb2*"))
        if stale.is_file() and stale.name not in names
    ]
    return problems


def report(problems: list[str]) -> str:
    """One problem a line, for an assertion message."""
    return "\n".join(["", *problems])


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    problems = stub_drift(protogen.generate(tmp_path), protogen.STUBS_DIR)
    assert not problems, report(problems) + "\nrun `make protos` to regenerate turnrl/v1/"


def test_every_element_has_a_leading_comment(descriptor_set) -> None:
    missing = missing_comments(descriptor_set)
    assert not missing, "elements without a leading comment:" + report(missing)


def test_files_are_in_package_turnrl_v1(descriptor_set) -> None:
    problems = package_problems(descriptor_set)
    assert not problems, report(problems)


def test_rpcs_take_and_return_their_own_messages(descriptor_set) -> None:
    problems = rpc_message_problems(descriptor_set)
    assert not problems, report(problems)


def test_enum_values_are_prefixed_and_zero_is_unspecified(descriptor_set) -> None:
    problems = enum_problems(descriptor_set)
    assert not problems, report(problems)


def test_field_names_and_types(descriptor_set) -> None:
    problems = field_problems(descriptor_set)
    assert not problems, report(problems)


@pytest.mark.parametrize(
    ("module", "service"), list(REQUIRED_RPCS), ids=[s for _, s in REQUIRED_RPCS]
)
def test_required_rpcs_exist_with_their_streaming(module, service: str) -> None:
    problems = service_shape_problems(module.DESCRIPTOR, service, REQUIRED_RPCS[module, service])
    assert not problems, report(problems)
