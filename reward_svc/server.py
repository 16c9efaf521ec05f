"""gRPC skin of the reward service: proto -> plain types, await RewardService, plain -> proto.

Errors are raised as `turnrl.errors` exceptions and mapped to status codes by `turnrl.rpc`.
"""

import contextlib
import json
from collections.abc import AsyncIterator, Sequence

from google.protobuf import struct_pb2

from reward_svc.config import RewardConfig
from reward_svc.scorers.base import ScoringRequest
from reward_svc.service import RewardService, ScoringResult
from turnrl import rpc, service_main
from turnrl.errors import InvalidArgumentError
from turnrl.messages import message_to_dict
from turnrl.rpc.http_json import serve_http_json
from turnrl.trajectory import TurnReward, TurnRewardSource
from turnrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Implements turnrl.v1.RewardService over a RewardService."""

    def __init__(self, service: RewardService) -> None:
        self._service = service

    async def Score(self, request, context):
        item = _scoring_request(request.input)
        self._service.check_data_source(item.data_source)
        result = await self._service.score(item)
        return reward_pb2.ScoreResponse(result=_result_proto(result))

    async def ScoreBatch(self, request_iterator, context):
        async def items() -> AsyncIterator[tuple[str, ScoringRequest]]:
            async for request in request_iterator:
                yield request.item_id, _scoring_request(request.input)

        async for item_id, result in self._service.score_stream(items()):
            yield reward_pb2.ScoreBatchResponse(item_id=item_id, result=_result_proto(result))

    async def ListScorers(self, request, context):
        return reward_pb2.ListScorersResponse(
            scorers=[
                reward_pb2.ScorerInfo(
                    name=route.name,
                    data_sources=sources,
                    description=route.description,
                    generative=route.generative,
                )
                for route, sources in self._service.list_scorers()
            ]
        )


async def serve(config: RewardConfig) -> None:
    """Starts the scorer workers, then serves the reward service until SIGTERM or SIGINT, and
    its methods as JSON over HTTP beside it with `server.http_port` (turnrl.rpc.http_json)."""
    service = await RewardService.create(config)
    servicer = RewardServicer(service)
    descriptor = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
    try:
        async with contextlib.AsyncExitStack() as http_json:
            if config.server.http_port is not None:
                await http_json.enter_async_context(
                    serve_http_json(config.server, descriptor, servicer)
                )
            await rpc.serve(
                config.server,
                descriptor,
                lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(
                    servicer, server
                ),
                metrics=service.metrics.registry,
            )
    finally:
        await service.close()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m reward_svc`: serves the `reward:` section of `--config F` with its overrides
    (turnrl.service_main); `turnrl serve reward` ends in `serve` too."""
    service_main.run("reward", serve, service_main.load_config("reward", RewardConfig, argv))


def _scoring_request(scoring_input: reward_pb2.ScoringInput) -> ScoringRequest:
    if not scoring_input.data_source:
        raise InvalidArgumentError("input.data_source is required")
    try:
        messages = [message_to_dict(m) for m in scoring_input.messages]
    except ValueError as e:
        raise InvalidArgumentError(f"input.messages: {e}") from None
    ground_truth = (
        rpc.json_value(scoring_input.ground_truth, "input.ground_truth")
        if scoring_input.HasField("ground_truth")
        else None
    )
    return ScoringRequest(
        data_source=scoring_input.data_source,
        response_text=scoring_input.response_text,
        messages=messages,
        ground_truth=ground_truth,
        extra_info=rpc.json_value(scoring_input.extra_info, "input.extra_info"),
    )


def _result_proto(result: ScoringResult) -> reward_pb2.ScoringResult:
    extras = struct_pb2.Struct()
    # Round-trip through JSON: scorers may return numbers of other types (numpy, Decimal).
    extras.update(json.loads(json.dumps(result.score.extras, default=str)))
    return reward_pb2.ScoringResult(
        reward=common_pb2.Reward(
            score=result.score.score,
            extras=extras,
            # Only the system's failures: the model's are the reward it earned.
            error=result.system_failed,
            error_message=result.score.extras["error"] if result.system_failed else "",
            turn_rewards=[
                TurnReward(
                    int(turn), float(value), TurnRewardSource.SCORER, result.scorer
                ).to_proto()
                for turn, value in sorted(result.score.turn_rewards.items())
            ],
        ),
        scorer=result.scorer,
        elapsed_seconds=result.elapsed_seconds,
        failure=result.failure.value if result.failure else None,
    )
