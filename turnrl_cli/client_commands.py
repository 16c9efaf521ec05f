"""Thin shell clients of the services (`turnrl health`, `turnrl tool ...`, `turnrl score`).

Each prints JSON on stdout, errors on stderr, and returns the process exit code: 0 on success,
1 when the call fails or the tool reports an error.
"""

import argparse
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from turnrl import errors, rpc
from turnrl.config import ClientConfig, client_token_from_env
from turnrl.errors import ConfigError
from turnrl.v1 import reward_pb2, reward_pb2_grpc, tool_pb2, tool_pb2_grpc


async def health(args: argparse.Namespace) -> int:
    """Prints the server's health status; 0 when SERVING."""
    async with _open(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except errors.RpcError as e:
            return _report(e)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    _print_json({"address": args.addr, "service": args.service, "status": status})
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


async def tool_list(args: argparse.Namespace) -> int:
    """Prints every tool as an OpenAI tool definition, with the service's limits."""
    async with _open(args) as channel:
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        try:
            reply = await rpc.call_idempotent(
                stub.ListTools,
                tool_pb2.ListToolsRequest(),
                timeout_seconds=args.timeout,
                max_attempts=3,
            )
        except errors.RpcError as e:
            return _report(e)
    _print_json([_openai_tool(info) for info in reply.tools])
    return 0


async def tool_call(args: argparse.Namespace) -> int:
    """Runs one call (in a session when --session-kwargs is given); 1 on a tool error."""
    session_kwargs = _json_object(args.session_kwargs, "--session-kwargs")
    async with _open(args) as channel:
        stub = tool_pb2_grpc.ToolServiceStub(channel)
        session_id = ""
        try:
            if session_kwargs is not None:
                created = await stub.CreateSession(
                    tool_pb2.CreateSessionRequest(
                        tool_name=args.name, session_kwargs=session_kwargs
                    ),
                    timeout=args.timeout,
                )
                session_id = created.session_id
            reply = await stub.Execute(
                tool_pb2.ExecuteRequest(
                    tool_name=args.name, arguments=args.arguments, session_id=session_id
                ),
                timeout=args.timeout,
            )
        except errors.RpcError as e:
            return _report(e)
        finally:
            if session_id:
                await _release(stub, session_id, args.timeout)
    _print_json(_to_dict(reply.result))
    return 1 if reply.result.HasField("error") else 0


async def score(args: argparse.Namespace) -> int:
    """Scores --response, or every line of --input through ScoreBatch; prints one JSON per item."""
    async with _open(args) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        if args.response is not None:
            request = reward_pb2.ScoreRequest(input=_scoring_input(args, {}))
            try:
                reply = await stub.Score(request, timeout=args.timeout)
            except errors.RpcError as e:
                return _report(e)
            _print_json(_score_json(reply.result))
            return 0
        items = list(_read_jsonl(args.input))

        async def requests() -> AsyncIterator[reward_pb2.ScoreBatchRequest]:
            for item_id, item in items:
                yield reward_pb2.ScoreBatchRequest(
                    item_id=item_id, input=_scoring_input(args, item)
                )

        failed = False
        try:
            async for reply in stub.ScoreBatch(requests(), timeout=args.timeout):
                _print_json({"item_id": reply.item_id, **_score_json(reply.result)})
                failed |= reply.result.reward.error
        except errors.RpcError as e:
            return _report(e)
        return 1 if failed else 0


def ground_truth_arg(text: str) -> Any:
    """The value of `turnrl score --ground-truth`: the JSON value `text` spells (`42`,
    `["paris", "france"]`, `{"target": ["Paris"]}`), else `text` itself as a string (`Paris`,
    `#### 18`), so a bare answer needs no JSON quotes. Text that opens like a JSON string, list
    or object but does not parse is refused: it is a typo, and scoring it as an answer would
    give a wrong reward with no error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith(('"', "[", "{")):
            raise argparse.ArgumentTypeError(
                f"{text!r} opens like JSON but is not: {e.msg} at character {e.pos}"
            ) from None
        return text


def _open(args: argparse.Namespace) -> grpc.aio.Channel:
    try:
        config = ClientConfig(
            address=args.addr,
            timeout_seconds=args.timeout,
            tls_ca_file=args.tls_ca,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
        )
    except ValidationError as e:
        problems = "; ".join(err["msg"] for err in e.errors())
        raise ConfigError(f"bad client options: {problems}") from None
    return rpc.open_channel(config, token=client_token_from_env())


async def _release(
    stub: tool_pb2_grpc.ToolServiceStub, session_id: str, timeout_seconds: float
) -> None:
    try:
        await stub.ReleaseSession(
            tool_pb2.ReleaseSessionRequest(session_id=session_id), timeout=timeout_seconds
        )
    except errors.RpcError as e:
        _report(e)


def _report(error: errors.RpcError) -> int:
    """Prints a failed call, naming its method, address, status and details; returns 1."""
    print(f"turnrl: {error}", file=sys.stderr)
    return 1


def _openai_tool(info: tool_pb2.ToolInfo) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": info.schema.name,
            "description": info.schema.description,
            "parameters": json.loads(info.schema.parameters_json or "{}"),
            "strict": info.schema.strict,
        },
        "limits": {
            "max_concurrency": info.max_concurrency,
            "rate_limit_per_second": info.rate_limit_per_second,
            "call_timeout_seconds": info.call_timeout.ToTimedelta().total_seconds(),
            "requires_session": info.requires_session,
        },
    }


def _scoring_input(args: argparse.Namespace, item: dict[str, Any]) -> reward_pb2.ScoringInput:
    ground_truth = item.get("ground_truth", args.ground_truth)
    scoring_input = reward_pb2.ScoringInput(
        data_source=item.get("data_source", args.data_source),
        response_text=item.get("response", args.response or ""),
    )
    if ground_truth is not None:
        json_format.ParseDict(ground_truth, scoring_input.ground_truth)
    if "extra_info" in item:
        scoring_input.extra_info.update(item["extra_info"])
    return scoring_input


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read --input {str(path)!r}: {e.strerror}") from e
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid UTF-8 at byte {e.start}") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not JSON: {e.msg}") from None
        if not isinstance(item, dict) or "response" not in item:
            raise ConfigError(f"{path}:{number}: expected an object with a 'response' key")
        yield str(number), item


def _json_object(text: str | None, flag: str) -> struct_pb2.Struct | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not JSON: {e.msg} in {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text!r}")
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


def _score_json(result: reward_pb2.ScoringResult) -> dict[str, Any]:
    return {
        "score": result.reward.score,
        "extras": json_format.MessageToDict(result.reward.extras),
        "error": result.reward.error,
        "error_message": result.reward.error_message,
        # Why the item was not graded and whose fault that is (turnrl/failures.py).
        "failure": reward_pb2.ScoringResult.Failure.Name(result.failure),
        "scorer": result.scorer,
    }


def _to_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False), flush=True)
