"""RolloutService: request-level asynchronous multi-turn rollout, and the weight receiver.

A plain async class (no gRPC). Every (prompt, sample) of a Generate call is its own task
running the agent loop; trajectories are yielded as each finishes, so a fast one never waits
for a slow one. Aborting a call ends its trajectories at their next step; they still come
back, with FINISH_REASON_ABORTED and the tokens they had.
"""

import asyncio
import contextlib
import importlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from rollout_svc.agent_episodes import AgentEpisodes
from rollout_svc.agent_loop import AgentLoop, PromptSpec, RolloutLimits
from rollout_svc.agent_runner import AgentRunner
from rollout_svc.config import InteractionEntry, RolloutConfig
from rollout_svc.engines import ENGINES
from rollout_svc.engines.base import (
    Engine,
    SamplingParams,
    ServerHeldWeights,
    broken_push_error,
)
from rollout_svc.gateway.session_images import SessionImages
from rollout_svc.gateway.sessions import ChatSessions
from rollout_svc.interactions import INTERACTIONS
from rollout_svc.interactions.base import Interaction
from rollout_svc.parsers import PARSERS
from rollout_svc.tool_client import ToolClient
from rollout_svc.tool_schemas import ToolSchemas
from rollout_svc.weight_sync import ChunkAssembler, WeightReceiver
from turnrl.errors import (
    ConfigError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from turnrl.replicas import ReplicaSet
from turnrl.trajectory import Trajectory
from turnrl.v1 import reward_pb2_grpc
from turnrl.vision import VisionProcessor, vision_token_id
from turnrl.weights import LoraAdapter, TensorMeta

log = logging.getLogger(__name__)


class RolloutService:
    """Rolls out trajectories on one engine. Build with `await RolloutService.create(config)`."""

    def __init__(
        self,
        config: RolloutConfig,
        engine: Engine,
        loop: AgentLoop,
        tool_schemas: ToolSchemas,
    ) -> None:
        self._config = config
        # The OpenAI-compatible gateway's sessions, on the same engine (served by
        # rollout_svc.gateway.app when rollout.gateway.enabled).
        self.chat_sessions = ChatSessions(
            engine,
            loop.tokenizer,
            loop.chat_template,
            loop.parser,
            RolloutLimits(
                config.max_model_len,
                config.max_response_length,
                config.max_new_tokens,
                config.max_turns,  # not applied: the agent decides when its episode ends
            ),
            config.gateway.served_model_name or Path(config.model_path or "model").name,
            config.gateway.max_sessions,
            new_part_on_rewrite=config.gateway.history_rewrites == "new_part",
            images=SessionImages(loop.vision, loop.image_settings),
        )
        self._engine = engine
        self._loop = loop
        # The user's agent in place of the agent loop (`rollout.agent`), once the gateway it
        # calls listens (`serve_agents`).
        self._episodes: AgentEpisodes | None = None
        self._tool_schemas = tool_schemas
        self._slots = asyncio.Semaphore(config.max_concurrent_trajectories)
        self._running: dict[str, set[asyncio.Task]] = {}
        self._request_ids = itertools.count()
        self._paused = False
        self._receiver = WeightReceiver()
        self._started = time.monotonic()
        self._finished = 0
        self._weight_pushes = 0
        self._weight_push_bytes = 0
        self._last_weight_push_stall_seconds = 0.0

    @classmethod
    async def create(cls, config: RolloutConfig) -> "RolloutService":
        """Starts the engine and loads the tokenizer. Raises ConfigError naming what is wrong."""
        if config.engine not in ENGINES:
            raise ConfigError(f"rollout.engine {config.engine!r} unknown; known: {sorted(ENGINES)}")
        if config.tool_parser not in PARSERS:
            raise ConfigError(
                f"rollout.tool_parser {config.tool_parser!r} unknown; known: {sorted(PARSERS)}"
            )
        model_path = config.model_path
        if model_path is None:
            raise ConfigError(
                "rollout.model_path is null: set it to a Hugging Face folder (`turnrl serve`, "
                "`up` and `run` set a null one to the config's tiny_model)"
            )
        engine_class, options_class = ENGINES[config.engine]
        try:
            options = options_class.model_validate(config.engine_options)
        except ValidationError as e:
            raise ConfigError(f"rollout.engine_options: {e}") from None
        tokenizer_path = config.tokenizer_path or model_path
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_path)
        chat_template = (
            await asyncio.to_thread(Path(config.chat_template_path).read_text)
            if config.chat_template_path
            else None
        )
        interactions = {entry.name: _build_interaction(entry) for entry in config.interactions}
        engine = await engine_class.create(options, model_path, config.max_model_len)
        is_vision_model = await asyncio.to_thread(vision_token_id, model_path) is not None
        vision = await asyncio.to_thread(VisionProcessor, model_path) if is_vision_model else None
        tool_client = ToolClient(config.tool_service)
        loop = AgentLoop(
            engine=engine,
            tokenizer=tokenizer,
            chat_template=chat_template,
            parser=PARSERS[config.tool_parser],
            tool_client=tool_client,
            reward_replicas=ReplicaSet(config.reward_service, reward_pb2_grpc.RewardServiceStub),
            interactions=interactions,
            tool_call_timeout_seconds=config.tool_call_timeout_seconds,
            reward_timeout_seconds=config.reward_timeout_seconds,
            vision=vision,
            image_settings=config.images,
        )
        return cls(config, engine, loop, ToolSchemas(tool_client))

    def serve_agents(self, gateway_url: str, api_key: str) -> None:
        """Has Generate play its samples with the configured agent (`rollout.agent`) through
        the gateway at `gateway_url`, which takes `api_key` as its bearer token."""
        assert self._config.agent is not None, "only with rollout.agent set"
        self._episodes = AgentEpisodes(
            AgentRunner(self._config.agent), self.chat_sessions, self._loop, gateway_url, api_key
        )

    def limits(
        self, max_model_len: int, max_response_length: int, max_new_tokens: int, max_turns: int
    ) -> RolloutLimits:
        """A call's limits, with 0 meaning the configured default; InvalidArgumentError when
        they contradict each other or pass the engine's context (`rollout.max_model_len`)."""
        limits = RolloutLimits(
            max_model_len=max_model_len or self._config.max_model_len,
            max_response_length=max_response_length or self._config.max_response_length,
            max_new_tokens=max_new_tokens or self._config.max_new_tokens,
            max_turns=max_turns or self._config.max_turns,
        )
        if limits.max_model_len > self._config.max_model_len:
            raise InvalidArgumentError(
                f"max_model_len {limits.max_model_len} exceeds the engine's context, "
                f"rollout.max_model_len {self._config.max_model_len}"
            )
        if limits.max_new_tokens > limits.max_response_length:
            raise InvalidArgumentError(
                f"max_new_tokens {limits.max_new_tokens} exceeds max_response_length "
                f"{limits.max_response_length}"
            )
        if limits.max_response_length >= limits.max_model_len:
            raise InvalidArgumentError(
                f"max_response_length {limits.max_response_length} leaves no room for a prompt "
                f"in max_model_len {limits.max_model_len}"
            )
        return limits

    async def generate(
        self,
        prompts: list[PromptSpec],
        n: int,
        sampling: SamplingParams,
        limits: RolloutLimits,
        enable_scoring: bool,
        request_id: str = "",
    ) -> AsyncIterator[Trajectory]:
        """Rolls out `n` samples of every prompt; yields each trajectory as it finishes.
        Raises InvalidArgumentError, before any rollout, for a prompt that names a tool the
        tool service does not serve; FailedPreconditionError while the engine's weights are
        incomplete after a broken push."""
        if (broken := self._engine.broken_push_version) is not None:
            raise broken_push_error(broken)
        if not prompts:
            raise InvalidArgumentError("prompts is empty")
        if n < 1:
            raise InvalidArgumentError(f"n must be at least 1, got {n}")
        if len(prompts) * n > self._config.max_trajectories_per_call:
            raise InvalidArgumentError(
                f"{len(prompts)} prompts times n={n} is more trajectories than "
                f"rollout.max_trajectories_per_call={self._config.max_trajectories_per_call}"
            )
        # Files read and images decoded: off the event loop.
        prompts = await asyncio.to_thread(
            lambda: [
                self._loop.with_images(prompt, f"prompts[{index}].messages")
                for index, prompt in enumerate(prompts)
            ]
        )
        if self._episodes is not None and any(prompt.images for prompt in prompts):
            raise InvalidArgumentError(
                "prompts with images: the configured agent (rollout.agent) plays through the "
                "gateway, which does not take images yet"
            )
        # An agent brings its own tools (and calls them itself); the agent loop needs theirs.
        tools = [
            [] if self._episodes else await self._tool_schemas.resolve(prompt.tool_names)
            for prompt in prompts
        ]
        request_id = request_id or f"generate-{next(self._request_ids)}"
        if request_id in self._running:
            raise InvalidArgumentError(f"request_id {request_id!r} is already running")
        tasks: set[asyncio.Task] = set()
        self._running[request_id] = tasks

        async def one(prompt: PromptSpec, prompt_tools: list[dict], index: int) -> Trajectory:
            async with self._slots:
                if self._episodes is not None:
                    return await self._episodes.run(
                        prompt, index, sampling, limits, enable_scoring, request_id
                    )
                return await self._loop.run(
                    prompt, prompt_tools, index, sampling, limits, enable_scoring, request_id
                )

        for prompt, prompt_tools in zip(prompts, tools, strict=True):
            for index in range(n):
                tasks.add(asyncio.create_task(one(prompt, prompt_tools, index)))
        try:
            for finished in asyncio.as_completed(list(tasks)):
                trajectory = await finished
                self._finished += 1
                yield trajectory
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del self._running[request_id]
            self._loop.forget(request_id)
            if self._episodes is not None:
                self._episodes.forget(request_id)

    async def abort(self, request_id: str) -> int:
        """Aborts the running trajectories of one call ("" for every call); how many."""
        request_ids = list(self._running) if not request_id else [request_id]
        aborted = 0
        for rid in request_ids:
            aborted += sum(not task.done() for task in self._running.get(rid, ()))
            await self._loop.abort(rid)
            if self._episodes is not None:
                await self._episodes.abort(rid)
        return aborted

    async def pause(self) -> tuple[int, int]:
        """Pauses the engine; (trajectories in flight, policy version)."""
        await self._engine.pause()
        self._paused = True
        return self.in_flight, self._engine.policy_version

    async def resume(self) -> int:
        await self._engine.resume()
        self._paused = False
        return self._engine.policy_version

    async def init_weight_sync(
        self, master_address: str, master_port: int, world_size: int, rank_offset: int,
        backend: str, group_name: str, timeout_seconds: float,
    ) -> tuple[int, str]:  # fmt: skip
        """Joins the trainer's weight-sync group: the engine's server with its own ranks, or
        this process with one rank; returns the ranks joined and the layout they receive
        (turnrl.weights.LAYOUTS). Raises DeadlineExceededError when the group does not form
        within `timeout_seconds`."""
        if isinstance(self._engine, ServerHeldWeights):
            await self._engine.join_weight_sync(
                master_address, master_port, world_size, rank_offset, backend, group_name,
                timeout_seconds,
            )  # fmt: skip
            return self._engine.weight_sync_ranks, self._engine.weight_layout
        try:
            await self._receiver.join(
                master_address,
                master_port,
                world_size,
                rank_offset,
                backend,
                group_name,
                timeout_seconds,
            )
        except TimeoutError as e:
            raise DeadlineExceededError(str(e)) from e
        return 1, "aligned_buckets"

    async def update_weights(
        self,
        group_name: str,
        metas: list[TensorMeta],
        bucket_size_bytes: int,
        policy_version: int,
        layout: str,
    ) -> tuple[int, int, float]:
        """Receives weights the trainer broadcasts in `layout` and loads each bucket while the
        next one arrives (or has the engine's server receive them); (version, bytes, seconds).

        The engine takes `policy_version` with the last bucket. A broadcast that breaks off
        (FailedPreconditionError) leaves the weights a mix of two versions: the engine refuses
        to generate until a complete push (`Engine.begin_weight_update`). Tensors an engine in
        this process would refuse are received and dropped, so the trainer's broadcast still
        completes, and the refusal is raised after.
        """
        self._check_version(policy_version)
        if bucket_size_bytes <= 0:
            raise InvalidArgumentError(
                f"bucket_size_bytes must be positive, got {bucket_size_bytes}"
            )
        if not metas:
            raise InvalidArgumentError("tensors is empty; an update names at least one")
        started = time.monotonic()
        size = sum(meta.nbytes for meta in metas)
        if isinstance(self._engine, ServerHeldWeights):
            async with self._paused_engine():
                await self._engine.receive_weights(
                    group_name, metas, bucket_size_bytes, layout, policy_version
                )
            self._count_push(size)
            return self._engine.policy_version, size, time.monotonic() - started
        try:
            self._engine.check_weights(metas)
            refusal = None
        except InvalidArgumentError as e:
            refusal = e
        async with self._paused_engine():
            # Into the engine's own parameters where it can hold them in the update's layout.
            place = None
            if refusal is None:
                place = await self._engine.weight_buffer(metas, bucket_size_bytes)
            buckets = self._receiver.receive(group_name, metas, bucket_size_bytes, layout, place)
            if refusal is None:  # from here the broadcast may land in the engine's weights
                await self._engine.begin_weight_update(policy_version)
            old_version, loaded = self._engine.policy_version, 0
            try:
                async for bucket in buckets:
                    if refusal is None:
                        loaded += len(bucket)
                        version = policy_version if loaded == len(metas) else old_version
                        await self._load(bucket, version)
            except Exception as e:
                if refusal is None:  # else the engine's weights were never touched
                    log.error(
                        "weight push to version %d broke off (%s); generation is refused "
                        "until a complete push",
                        policy_version,
                        e,
                    )
                raise
        if refusal is not None:
            raise refusal
        self._count_push(size)
        return self._engine.policy_version, size, time.monotonic() - started

    async def push_weights(
        self,
        metas: list[TensorMeta],
        chunks: AsyncIterator[tuple[int, int, bytes]],
        policy_version: int,
        adapter: LoraAdapter | None = None,
    ) -> tuple[int, int]:
        """Loads weights sent as chunks (the fallback path), or with `adapter` the LoRA
        adapter they are, in place of the engine's; (version, bytes). Raises
        FailedPreconditionError for an adapter when the engine does not load adapters."""
        self._check_version(policy_version)
        refusal = self._engine.lora_adapters_refusal
        if adapter is not None and refusal:
            raise FailedPreconditionError(
                f"the {self._config.engine} engine does not load LoRA adapters: {refusal}"
            )
        assembler = ChunkAssembler(metas)
        async for index, offset, data in chunks:
            assembler.add(index, offset, data)
        async with self._paused_engine():
            if adapter is None:
                await self._load(assembler.tensors(), policy_version)
            else:
                await self._engine.load_lora_adapter(adapter, assembler.tensors(), policy_version)
        self._count_push(assembler.bytes_received)
        return self._engine.policy_version, assembler.bytes_received

    async def watch_engine(self) -> None:
        """Waits while the engine can serve; raises UnavailableError once it cannot."""
        await self._engine.watch()

    def stats(self) -> dict[str, Any]:
        broken = self._engine.broken_push_version
        return {
            "engine": self._config.engine,
            "policy_version": self._engine.policy_version,
            "weights_incomplete_reason": "" if broken is None else str(broken_push_error(broken)),
            "loads_lora_adapters": not self._engine.lora_adapters_refusal,
            "paused": self._paused,
            "running_trajectories": self.in_flight,
            "finished_trajectories": self._finished,
            "uptime_seconds": time.monotonic() - self._started,
            "weight_sync_ranks": (
                self._engine.weight_sync_ranks if isinstance(self._engine, ServerHeldWeights) else 1
            ),
            "metrics": {
                **self._engine.stats(),
                # Tries again are why these did not fail their trajectories: the faults that
                # were ridden out, counted.
                "tool_unavailable_answers": self._loop.tool_client.unavailable_answers,
                "reward_unavailable_answers": self._loop.reward_replicas.unavailable_answers,
                "weight_pushes": self._weight_pushes,
                "weight_push_bytes": self._weight_push_bytes,
                "last_weight_push_stall_seconds": self._last_weight_push_stall_seconds,
                # Episodes of the user's agent the system failed, per kind.
                **(self._episodes.failures if self._episodes is not None else {}),
            },
        }

    @property
    def in_flight(self) -> int:
        return sum(not t.done() for tasks in self._running.values() for t in tasks)

    async def close(self) -> None:
        for tasks in self._running.values():
            for task in tasks:
                task.cancel()
        if self._episodes is not None:
            await self._episodes.close()
        await self._engine.close()
        for interaction in self._loop.interactions.values():
            await interaction.close()
        await self._loop.tool_client.close()
        await self._loop.reward_replicas.close()

    def _check_version(self, policy_version: int) -> None:
        if policy_version <= self._engine.policy_version:
            raise FailedPreconditionError(
                f"policy_version {policy_version} is not newer than the engine's "
                f"{self._engine.policy_version}"
            )

    def _count_push(self, nbytes: int) -> None:
        self._weight_pushes += 1
        self._weight_push_bytes += nbytes

    @contextlib.asynccontextmanager
    async def _paused_engine(self) -> AsyncIterator[None]:
        """The engine paused for a weight load, unless a Pause call paused it already; how long
        it stalled generation is kept for `stats`."""
        was_paused = self._paused
        paused_at = time.monotonic()
        if not was_paused:
            await self._engine.pause()
        try:
            yield
        finally:
            if not was_paused:
                await self._engine.resume()
            self._last_weight_push_stall_seconds = time.monotonic() - paused_at

    async def _load(self, tensors: list[tuple[str, torch.Tensor]], policy_version: int) -> None:
        try:
            await self._engine.update_weights(tensors, policy_version)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from e


def _build_interaction(entry: InteractionEntry) -> Interaction:
    if entry.class_name in INTERACTIONS:
        interaction_class = INTERACTIONS[entry.class_name]
    else:
        module_name, _, attribute = entry.class_name.rpartition(":")
        try:
            interaction_class = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(
                f"rollout.interactions {entry.name!r}: unknown class_name {entry.class_name!r}; "
                f"built-in: {sorted(INTERACTIONS)}, or 'package.module:Class' ({e})"
            ) from e
    try:
        return interaction_class(interaction_class.Options.model_validate(entry.config))
    except ValidationError as e:
        raise ConfigError(f"rollout.interactions {entry.name!r}: bad config: {e}") from None
