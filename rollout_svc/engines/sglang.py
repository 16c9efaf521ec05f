"""SGLang as the rollout engine, through the native HTTP API of an SGLang server.

The engine either connects to a running server (`url`) or starts one itself (`launch`: runs
`python -m sglang.launch_server` bound to 127.0.0.1, waits until it is healthy, stops it on
close: `server_process`). Token in, token out: `/generate` gets `input_ids` and answers each
sampled token with its logprob (`meta_info.output_token_logprobs`, [logprob, token_id, text]
triples); the ids and logprobs are both read from those triples, so they cannot fall out of
step. Request and reply shapes are `sglang_api`'s.

- Sessions: SGLang's radix cache finds the prefix a session's requests share by itself, so
  `session_id` is not sent and `end_session` has nothing to free.
- Pause: `/pause_generation` in "retract" mode. Running requests go back to the waiting queue
  with their tokens and are prefilled again on resume, under the weights then loaded. The
  "in_place" mode would keep KV computed by the old weights, and SGLang asserts an idle cache
  when it flushes after a weight update, so it is not offered. (Servers older than the mode
  field abort the running requests instead.)
- Weights: the server, which holds them, joins the trainer's weight-sync group itself and
  receives each update there, or from a safetensors folder without a group; the rollout
  service's process stays out of the group (`sglang_weight_sync`). Servers that report
  per-token `weight_versions` spans let a generation that spans a push carry both versions.
- A weight call that fails leaves the server's weights partly updated: the engine then refuses
  to generate (`broken_push_error`) until an update completes, and on resume aborts the
  requests that were in flight.
- Calls, their deadlines and retries, and how failures map onto turnrl errors: `engine_http`.
"""

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Literal, Self

import torch
from pydantic import Field, model_validator

from rollout_svc.engines.base import (
    FinishReason,
    GenerateOutput,
    SamplingParams,
    broken_push_error,
    check_prompt,
)
from rollout_svc.engines.engine_http import EngineHttp
from rollout_svc.engines.server_process import LaunchOptions, start_server, stop_process_group
from rollout_svc.engines.sglang_api import (
    GenerateReply,
    ModelInfo,
    ServerInfo,
    request_metrics,
    sampling_params,
    token_versions,
    version_number,
)
from rollout_svc.engines.sglang_weight_sync import ServerWeights
from turnrl.config import StrictModel
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TurnrlError,
    UnavailableError,
)
from turnrl.weights import BucketedWeights, TensorMeta

log = logging.getLogger(__name__)

SGLANG_SERVER_MODULE = "sglang.launch_server"


class SglangEngineOptions(StrictModel):
    """Settings of the SGLang engine (the rollout config's `engine_options` when the engine is
    "sglang"). The model is the rollout config's `model_path`, the context `max_model_len`."""

    url: str | None = Field(
        default=None, description="Base URL of a running server, e.g. http://127.0.0.1:30000."
    )
    launch: LaunchOptions | None = Field(
        default=None,
        description="Start a server of the rollout config's `model_path` instead of "
        "connecting to `url`.",
    )
    startup_timeout_seconds: float = Field(
        default=900.0,
        gt=0,
        description="Seconds to wait for the server to answer its health check at start.",
    )
    request_timeout_seconds: float = Field(
        default=900.0, gt=0, description="Deadline of one generate request, in seconds."
    )
    control_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of abort, pause, resume, flush, health and model-info calls.",
    )
    weight_sync_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Deadline of joining the weight group and of receiving one bucket.",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of an idempotent call that failed to connect or got HTTP 5xx/429.",
    )
    max_concurrent_requests: int = Field(
        default=1024, gt=0, description="HTTP connections to the server, so requests at once."
    )
    weight_layout: Literal["per_tensor", "flattened_buckets"] = Field(
        default="per_tensor",
        description="How the server takes weight updates: per_tensor (one broadcast per "
        "tensor; every SGLang version) or flattened_buckets (one per bucket of one dtype, "
        "load_format flattened_bucket: far fewer broadcasts; only servers whose "
        "update_weights_from_distributed takes load_format).",
    )

    @model_validator(mode="after")
    def _one_server(self) -> Self:
        if (self.url is None) == (self.launch is None):
            raise ValueError("set exactly one of url (a running server) and launch")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self


class SglangEngine:
    """The `Engine` protocol over an SGLang server's HTTP API (see the module docstring)."""

    def __init__(
        self,
        options: SglangEngineOptions,
        model_path: str,
        max_model_len: int,
        url: str,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        """Use `create()`, which also starts the server and checks it."""
        self._http = EngineHttp(
            "SGLang",
            url,
            options.max_concurrent_requests,
            options.control_timeout_seconds,
            options.max_retries,
            health_path="/health_generate",  # runs a one-token generation
        )
        self.url = self._http.url
        self._options = options
        self._model_path = model_path
        self._max_model_len = max_model_len
        self._process = process
        self.weights = ServerWeights(
            self._http,
            model_path,
            options.weight_layout,
            options.weight_sync_timeout_seconds,
            options.control_timeout_seconds,
        )
        self._running: set[str] = set()
        self._paused = False
        self._totals = {"requests": 0, "generated_tokens": 0, "aborted": 0}

    @classmethod
    async def create(
        cls, options: SglangEngineOptions, model_path: str, max_model_len: int
    ) -> Self:
        """Starts a server of `model_path` when `options.launch` is set (a server given by
        `url` serves its own), waits until it is healthy and checks that it serves a generation
        model; the engine takes the version the server reports. Prompts of `max_model_len`
        tokens or more are refused.

        Raises UnavailableError when the server is unreachable or its process exits during
        start-up, DeadlineExceededError when it is not healthy in `startup_timeout_seconds`,
        and InvalidArgumentError when it serves an embedding model.
        """
        process = None
        if options.launch is None:
            assert options.url is not None  # the options validator ensures one of the two
            engine = cls(options, model_path, max_model_len, options.url)
        else:
            process, url = await start_server(
                options.launch, SGLANG_SERVER_MODULE, ["--model-path", model_path]
            )
            engine = cls(options, model_path, max_model_len, url, process)
        try:
            await engine._http.wait_until_healthy(options.startup_timeout_seconds, process)
            reply = await engine._http.call("GET", "/get_model_info", idempotent=True)
            info = engine._http.parse(reply, ModelInfo)
            if not info.is_generation:
                raise InvalidArgumentError(
                    f"SGLang server at {engine.url!r} serves {info.model_path!r}, which is not "
                    "a generation model"
                )
            engine.weights.policy_version = version_number(info.weight_version)
            reply = await engine._http.call("GET", "/get_server_info", idempotent=True)
            server = engine._http.parse(reply, ServerInfo)
            engine.weights.ranks = server.tp_size
            engine.weights.data_parallel_size = server.dp_size
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for weights no push has named."""
        return self.weights.policy_version

    @property
    def broken_push_version(self) -> int | None:
        """The version of a weight update that began and did not complete before the engine
        resumed; None while the server's weights are one version or an update is under way
        (paused). See the `Engine` protocol."""
        return None if self._paused else self.weights.incomplete_update

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str, session_id: str = ""
    ) -> GenerateOutput:
        """Samples a continuation of `input_ids` (`session_id` is not needed: see the module
        docstring). When the deadline passes or the caller cancels, the server is told to
        abort the request before the error propagates.

        Raises InvalidArgumentError for empty `input_ids` or a prompt of max_model_len tokens
        or more, a `request_id` already running, or a request the server rejects (ids outside
        the vocabulary, a prompt longer than its context); FailedPreconditionError
        (`broken_push_error`) while the weights are incomplete, also for a request in flight
        when a weight update broke off.
        """
        self._check_weights_complete()
        check_prompt(input_ids, self._max_model_len)
        if request_id in self._running:
            raise InvalidArgumentError(f"request_id {request_id!r} is already running")
        body = {
            "rid": request_id,
            "input_ids": list(input_ids),
            "sampling_params": sampling_params(sampling),
            "return_logprob": True,
            "logprob_start_len": -1,  # logprobs of the output tokens only
            "stream": False,
        }
        self._running.add(request_id)
        try:
            reply = await self._http.call(
                "POST", "/generate", body, timeout_seconds=self._options.request_timeout_seconds
            )
        except (asyncio.CancelledError, DeadlineExceededError):
            await self._abort_abandoned(request_id)
            raise
        finally:
            self._running.discard(request_id)
        self._check_weights_complete()  # its tokens would span weights of two versions
        meta = self._http.parse(reply, GenerateReply).meta_info
        output = GenerateOutput(
            output_ids=[token_id for _, token_id, _ in meta.output_token_logprobs],
            logprobs=[logprob for logprob, _, _ in meta.output_token_logprobs],
            policy_versions=token_versions(meta, self.weights.policy_version),
            finish_reason=FinishReason(meta.finish_reason.type),
            metrics=request_metrics(meta),
        )
        self._totals["requests"] += 1
        self._totals["generated_tokens"] += len(output.output_ids)
        self._totals["aborted"] += output.finish_reason is FinishReason.ABORT
        return output

    async def abort(self, request_id: str) -> None:
        """Ends a running request early; its generate() returns the tokens sampled so far with
        FinishReason.ABORT. A request that is not running (finished, unknown) is left alone."""
        if request_id in self._running:
            await self._http.call("POST", "/abort_request", {"rid": request_id}, idempotent=True)

    async def end_session(self, session_id: str) -> None:
        """Nothing to free: the radix cache evicts a session's prefix when it needs the room."""

    async def pause(self) -> None:
        """Stops decoding; running requests keep their tokens and wait in the server's queue."""
        await self._http.call("POST", "/pause_generation", {"mode": "retract"}, idempotent=True)
        self._paused = True

    async def resume(self) -> None:
        """Continues decoding after pause(); waiting requests are prefilled again first. While
        a weight update is incomplete, the requests in flight are aborted first: they would
        go on under a mix of two versions (their generate() raises `broken_push_error`)."""
        if self.weights.incomplete_update is not None:
            self._paused = False  # the update is over, broken: generate refuses from here on
            for request_id in list(self._running):
                await self._http.call(
                    "POST", "/abort_request", {"rid": request_id}, idempotent=True
                )
        await self._http.call("POST", "/continue_generation", {}, idempotent=True)
        self._paused = False

    async def flush_cache(self) -> None:
        """Empties the radix cache. Raises FailedPreconditionError while requests run."""
        await self._http.call(
            "POST", "/flush_cache", idempotent=True, rejected_error=FailedPreconditionError
        )

    # The weight path: `sglang_weight_sync.ServerWeights`, which checks and sends the calls.

    @property
    def weight_sync_ranks(self) -> int:
        """The ranks the server joins a weight-sync group with: its tensor-parallel size."""
        return self.weights.ranks

    @property
    def weight_layout(self) -> str:
        """The layout the server receives best (`engine_options.weight_layout`)."""
        return self.weights.layout

    async def join_weight_sync(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> None:
        """Has the server join the trainer's weight-sync group (`ServerWeights.join`); returns
        once every rank joined, so the trainer must join at the same time."""
        await self.weights.join(
            master_address, master_port, world_size, rank_offset, backend, group_name,
            timeout_seconds,
        )  # fmt: skip

    async def receive_weights(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has the server receive an update broadcast on the group (`ServerWeights.receive`).
        Raises FailedPreconditionError when the engine is not paused, and as that does."""
        self._check_paused()
        await self.weights.receive(group_name, metas, bucket_size_bytes, layout, policy_version)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str | torch.dtype],
        shapes: Sequence[Sequence[int]],
        policy_version: int,
        *,
        group_name: str,
        flush_cache: bool = True,
        flattened: bool = False,
    ) -> None:
        """Has the server receive one bucket broadcast on the group
        (`ServerWeights.update_from_distributed`); pass `flush_cache=False` for every bucket
        of a push but the last. Raises FailedPreconditionError when the engine is not paused,
        and as that does."""
        self._check_paused()
        await self.weights.update_from_distributed(
            names, dtypes, shapes, policy_version, group_name=group_name,
            flush_cache=flush_cache, flattened=flattened,
        )  # fmt: skip

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError for a tensor the server's checkpoint lacks or has in
        another shape (`ServerWeights.check`)."""
        self.weights.check(metas)

    async def begin_weight_update(self, policy_version: int) -> None:
        """Marks the weights incomplete until an update takes `policy_version` or a newer one
        (receive_weights does this itself)."""
        self.weights.incomplete_update = policy_version

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """None: the server holds the weights, not this process."""
        return None

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Loads weights sent over gRPC (PushWeights, when no weight-sync group formed) as a
        safetensors folder the server reads (`ServerWeights.update_from_disk`), so the server
        must share this machine's disk, as a launched one does. Raises
        FailedPreconditionError when the engine is not paused, and as that does."""
        self._check_paused()
        await self.weights.update_from_disk(named_tensors, policy_version)

    async def watch(self) -> None:
        """Waits while the server this engine launched runs; raises UnavailableError once its
        process exits. A server given by `url` is another's to supervise: this waits forever,
        and its failures reach callers as the errors of their requests."""
        if self._process is None:
            await asyncio.Event().wait()
        returncode = await self._process.wait()
        raise UnavailableError(
            f"SGLang server process {self._process.pid} exited with code {returncode}; its log "
            "is above"
        )

    def stats(self) -> dict[str, float]:
        """Counts kept by this client: requests running now, finished, aborted, tokens made;
        whether the engine is paused and its weights incomplete (0/1), and their version."""
        return {
            "running_requests": float(len(self._running)),
            "paused": float(self._paused),
            "policy_version": float(self.weights.policy_version),
            "weights_incomplete": float(self.weights.incomplete_update is not None),
            "requests_total": float(self._totals["requests"]),
            "generated_tokens_total": float(self._totals["generated_tokens"]),
            "aborted_total": float(self._totals["aborted"]),
        }

    async def close(self) -> None:
        """Closes the connections and stops the server this engine launched: SIGTERM to its
        process group, SIGKILL after `shutdown_timeout_seconds`. A server given by `url` keeps
        running."""
        await self._http.close()
        if self._process is not None and self._options.launch is not None:
            await stop_process_group(self._process, self._options.launch.shutdown_timeout_seconds)

    def _check_paused(self) -> None:
        if not self._paused:
            raise FailedPreconditionError(
                "pause() the engine before updating its weights: SGLang flushes its cache after "
                "an update and fails while requests run"
            )

    def _check_weights_complete(self) -> None:
        if self.broken_push_version is not None:
            raise broken_push_error(self.broken_push_version)

    async def _abort_abandoned(self, request_id: str) -> None:
        """Tells the server to drop a request whose caller gave up. Failures are logged only:
        the server also aborts a request once its connection closes."""
        try:
            await self._http.call("POST", "/abort_request", {"rid": request_id}, idempotent=True)
        except TurnrlError as e:
            log.warning("could not abort abandoned request %r: %s", request_id, e)
