"""gRPC skin of the rollout service: proto -> plain types, await RolloutService, plain -> proto.

Errors are raised as `turnrl.errors` exceptions and mapped to status codes by `turnrl.rpc`.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from google.protobuf import duration_pb2

from rollout_svc.agent_loop import PromptSpec
from rollout_svc.config import RolloutConfig
from rollout_svc.engines.base import SamplingParams
from rollout_svc.gateway import GATEWAY_LINE
from rollout_svc.gateway.app import serve_gateway
from rollout_svc.metrics import rollout_metrics
from rollout_svc.service import RolloutService
from turnrl import rpc, service_main
from turnrl.errors import InvalidArgumentError
from turnrl.messages import message_to_dict
from turnrl.metrics import loop_registry
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from turnrl.weights import LAYOUTS, LoraAdapter, TensorMeta

log = logging.getLogger(__name__)

BACKEND_NAMES = {
    rollout_pb2.InitWeightSyncRequest.BACKEND_GLOO: "gloo",
    rollout_pb2.InitWeightSyncRequest.BACKEND_NCCL: "nccl",
}
# An update's WeightLayout by its name in turnrl.weights.LAYOUTS; unset reads as aligned buckets.
LAYOUT_NAMES = {
    rollout_pb2.WEIGHT_LAYOUT_UNSPECIFIED: "aligned_buckets",
    **{wire: name for name, wire in LAYOUTS.items()},
}
DEFAULT_JOIN_TIMEOUT_SECONDS = 300.0
MAX_PORT = 65_535


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Implements turnrl.v1.RolloutService over a RolloutService."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    async def Generate(self, request, context):
        prompts = [_prompt_spec(p, i) for i, p in enumerate(request.prompts)]
        limits = self._service.limits(
            request.limits.max_model_len,
            request.limits.max_response_length,
            request.limits.max_new_tokens,
            request.max_turns,
        )
        trajectories = self._service.generate(
            prompts,
            request.n or 1,
            _sampling(request.sampling, limits.max_new_tokens),
            limits,
            request.enable_scoring,
            request.request_id,
        )
        async for trajectory in trajectories:
            yield rollout_pb2.GenerateResponse(trajectory=trajectory.to_proto())

    async def Abort(self, request, context):
        aborted = await self._service.abort(request.request_id)
        return rollout_pb2.AbortResponse(aborted_trajectories=aborted)

    async def Pause(self, request, context):
        in_flight, version = await self._service.pause()
        return rollout_pb2.PauseResponse(in_flight_trajectories=in_flight, policy_version=version)

    async def Resume(self, request, context):
        return rollout_pb2.ResumeResponse(policy_version=await self._service.resume())

    async def InitWeightSync(self, request, context):
        if request.backend not in BACKEND_NAMES:
            raise InvalidArgumentError("backend is not set; use BACKEND_GLOO or BACKEND_NCCL")
        if not 0 < request.master_port <= MAX_PORT:
            raise InvalidArgumentError(
                f"master_port must be in 1..{MAX_PORT}, got {request.master_port}"
            )
        timeout = (
            rpc.positive_seconds(request.timeout, "timeout")
            if request.HasField("timeout")
            else DEFAULT_JOIN_TIMEOUT_SECONDS
        )
        ranks, layout = await self._service.init_weight_sync(
            request.master_address,
            request.master_port,
            request.world_size,
            request.rank_offset,
            BACKEND_NAMES[request.backend],
            request.group_name,
            timeout,
        )
        return rollout_pb2.InitWeightSyncResponse(ranks_joined=ranks, layout=LAYOUTS[layout])

    async def UpdateWeights(self, request, context):
        if request.layout not in LAYOUT_NAMES:
            raise InvalidArgumentError(f"layout {request.layout} is not a WeightLayout")
        version, size, seconds = await self._service.update_weights(
            request.group_name,
            _metas(request.tensors),
            request.bucket_size_bytes,
            request.policy_version,
            LAYOUT_NAMES[request.layout],
        )
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=version, bytes_received=size, elapsed_seconds=seconds
        )

    async def PushWeights(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgumentError("the first PushWeights message must be the header")

        async def chunks() -> AsyncIterator[tuple[int, int, bytes]]:
            async for message in request_iterator:
                if not message.HasField("chunk"):
                    raise InvalidArgumentError("only chunks may follow the header")
                chunk = message.chunk
                yield chunk.tensor_index, chunk.offset_bytes, chunk.data

        header = first.header
        version, size = await self._service.push_weights(
            _metas(header.tensors),
            chunks(),
            header.policy_version,
            _adapter(header.lora_adapter) if header.HasField("lora_adapter") else None,
        )
        return rollout_pb2.PushWeightsResponse(policy_version=version, bytes_received=size)

    async def GetStats(self, request, context):
        stats = self._service.stats()
        uptime = duration_pb2.Duration()
        uptime.FromNanoseconds(int(stats["uptime_seconds"] * 1e9))
        return rollout_pb2.GetStatsResponse(
            engine=stats["engine"],
            policy_version=stats["policy_version"],
            paused=stats["paused"],
            running_trajectories=stats["running_trajectories"],
            finished_trajectories=stats["finished_trajectories"],
            uptime=uptime,
            weight_sync_ranks=stats["weight_sync_ranks"],
            weights_incomplete_reason=stats["weights_incomplete_reason"],
            loads_lora_adapters=stats["loads_lora_adapters"],
            metrics={k: float(v) for k, v in stats["metrics"].items()},
        )


async def serve(config: RolloutConfig) -> None:
    """Starts the engine, then serves the rollout service until SIGTERM or SIGINT, and its
    OpenAI-compatible gateway beside it when `rollout.gateway.enabled` (printing
    `gateway of RolloutService on http://HOST:PORT`, https:// with `server.tls`, once it
    listens, before the gRPC line), through which the configured agent plays Generate's
    samples when `rollout.agent` is set."""
    service = await RolloutService.create(config)
    try:
        async with contextlib.AsyncExitStack() as gateway:
            if config.gateway.enabled:
                url = await gateway.enter_async_context(
                    serve_gateway(config.gateway, config.server, service.chat_sessions)
                )
                log.info("OpenAI gateway on %s", url)
                print(f"{GATEWAY_LINE}{url}", flush=True)
                if config.agent is not None:
                    # The openai client refuses an empty key, so one that opens nothing.
                    service.serve_agents(url, config.server.auth_token() or "no-key")
            await rpc.serve(
                config.server,
                rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
                lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                    RolloutServicer(service), server
                ),
                metrics=loop_registry(lambda: rollout_metrics(service.stats())),
                watch=service.watch_engine,
            )
    finally:
        await service.close()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m rollout_svc`: serves the `rollout:` section of `--config F` with its overrides
    (turnrl.service_main); `turnrl serve rollout` ends in `serve` too."""
    service_main.run("rollout", serve, service_main.load_config("rollout", RolloutConfig, argv))


def _prompt_spec(prompt: rollout_pb2.RolloutPrompt, index: int) -> PromptSpec:
    try:
        messages = [message_to_dict(m) for m in prompt.messages]
    except ValueError as e:
        raise InvalidArgumentError(f"prompts[{index}].messages: {e}") from None
    if not messages:
        raise InvalidArgumentError(f"prompts[{index}].messages is empty")
    return PromptSpec(
        prompt_id=prompt.prompt_id or f"prompt-{index}",
        messages=messages,
        tool_names=list(prompt.tool_names),
        tools_kwargs=rpc.json_value(prompt.tools_kwargs, f"prompts[{index}].tools_kwargs"),
        interaction_name=prompt.interaction_name,
        interaction_kwargs=rpc.json_value(
            prompt.interaction_kwargs, f"prompts[{index}].interaction_kwargs"
        ),
        data_source=prompt.data_source,
        ground_truth=(
            rpc.json_value(prompt.ground_truth, f"prompts[{index}].ground_truth")
            if prompt.HasField("ground_truth")
            else None
        ),
        extra_info=rpc.json_value(prompt.extra_info, f"prompts[{index}].extra_info"),
        chat_template_kwargs=rpc.json_value(
            prompt.chat_template_kwargs, f"prompts[{index}].chat_template_kwargs"
        ),
    )


def _sampling(sampling: common_pb2.SamplingParams, max_new_tokens: int) -> SamplingParams:
    fields = {
        name: getattr(sampling, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
        if sampling.HasField(name)
    }
    return SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=tuple(sampling.stop_token_ids), **fields
    )


def _metas(specs) -> list[TensorMeta]:
    try:
        return [TensorMeta.from_proto(spec) for spec in specs]
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def _adapter(adapter: rollout_pb2.LoraAdapter) -> LoraAdapter:
    try:
        return LoraAdapter.from_proto(adapter)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
