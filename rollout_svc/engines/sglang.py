"""SGLang as the rollout engine, through the native HTTP API of an SGLang server.

The engine either connects to a running server (`url`) or starts one itself (`launch`: runs
`python -m sglang.launch_server` bound to 127.0.0.1, waits until it is healthy, stops it on
close: `sglang_server`). Token in, token out: `/generate` gets `input_ids` and answers each
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
- Weights: the server, which holds them, joins the trainer's weight-sync group itself
  (`join_weight_sync`: SGLang's `init_weights_update_group`, with its tensor-parallel ranks),
  and receives each update tensor by tensor (`receive_weights`: one
  `update_weights_from_distributed` call per bucket), or in flattened buckets where the
  server takes them (`weight_layout`); the rollout service's process stays out of the group. Names and shapes are checked against the model's checkpoint first. Each update
  names its `policy_version` as SGLang's `weight_version`; servers that report per-token
  `weight_versions` spans let a generation that spans a push carry both versions. Without a
  group (PushWeights), an update goes as a safetensors folder (`update_weights_from_disk`).
- Failures name the server URL and map onto turnrl errors: unreachable or HTTP 5xx/429 ->
  UnavailableError, too slow -> DeadlineExceededError, other HTTP errors -> InvalidArgumentError
  (FailedPreconditionError where the server refuses for its state); an answer of the wrong
  shape (an incompatible server version) is a RuntimeError. Only idempotent calls (health,
  model info, abort, pause, resume, flush) are retried, `max_retries` times.
"""

import asyncio
import logging
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, Self

import httpx
import tenacity
import torch
from pydantic import Field, model_validator

from rollout_svc.engines.base import FinishReason, GenerateOutput, SamplingParams, check_prompt
from rollout_svc.engines.sglang_api import (
    GenerateReply,
    ModelInfo,
    ServerInfo,
    WeightSyncReply,
    dtype_name,
    error_detail,
    parse_reply,
    request_metrics,
    sampling_params,
    token_versions,
    version_number,
)
from rollout_svc.engines.sglang_server import (
    SglangLaunchOptions,
    start_server,
    stop_process_group,
)
from rollout_svc.engines.sglang_weights import (
    check_against_checkpoint,
    checkpoint_shapes,
    write_update,
)
from turnrl.config import StrictModel
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TurnrlError,
    UnavailableError,
)
from turnrl.weights import BucketedWeights, TensorMeta, bucket_indices, dtype_runs

log = logging.getLogger(__name__)

RETRY_BASE_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0


class SglangEngineOptions(StrictModel):
    """Settings of the SGLang engine (the rollout config's `engine_options` when the engine is
    "sglang"). The model is the rollout config's `model_path`, the context `max_model_len`."""

    url: str | None = Field(
        default=None, description="Base URL of a running server, e.g. http://127.0.0.1:30000."
    )
    launch: SglangLaunchOptions | None = Field(
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
        self.url = url.rstrip("/")
        self._options = options
        self._model_path = model_path
        self._max_model_len = max_model_len
        self._process = process
        self.weight_sync_ranks = 1  # the server's tensor-parallel size, from create()
        self.weight_layout = options.weight_layout
        self._data_parallel_size = 1
        self._weight_group = ""  # the weight-sync group the server is in
        # The checkpoint's parameter shapes, read on the first update (None: not local).
        self._checkpoint_shapes: dict[str, tuple[int, ...]] | None = None
        limits = httpx.Limits(
            max_connections=options.max_concurrent_requests,
            max_keepalive_connections=options.max_concurrent_requests,
        )
        # Deadlines come from asyncio.timeout per call; no proxy from the environment.
        self._client = httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)
        self._policy_version = 0
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
        if options.launch is None:
            assert options.url is not None  # the options validator ensures one of the two
            engine = cls(options, model_path, max_model_len, options.url)
        else:
            process, url = await start_server(options.launch, model_path)
            engine = cls(options, model_path, max_model_len, url, process)
        try:
            await engine._wait_until_healthy()
            reply = await engine._call("GET", "/get_model_info", idempotent=True)
            info = parse_reply(reply, ModelInfo, engine.url)
            if not info.is_generation:
                raise InvalidArgumentError(
                    f"SGLang server at {engine.url!r} serves {info.model_path!r}, which is not "
                    "a generation model"
                )
            engine._policy_version = version_number(info.weight_version)
            reply = await engine._call("GET", "/get_server_info", idempotent=True)
            server = parse_reply(reply, ServerInfo, engine.url)
            engine.weight_sync_ranks = server.tp_size
            engine._data_parallel_size = server.dp_size
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for weights no push has named."""
        return self._policy_version

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str, session_id: str = ""
    ) -> GenerateOutput:
        """Samples a continuation of `input_ids` (`session_id` is not needed: see the module
        docstring). When the deadline passes or the caller cancels, the server is told to
        abort the request before the error propagates.

        Raises InvalidArgumentError for empty `input_ids` or a prompt of max_model_len tokens
        or more, a `request_id` already running, or a request the server rejects (ids outside
        the vocabulary, a prompt longer than its context).
        """
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
            reply = await self._call(
                "POST", "/generate", body, timeout_seconds=self._options.request_timeout_seconds
            )
        except (asyncio.CancelledError, DeadlineExceededError):
            await self._abort_abandoned(request_id)
            raise
        finally:
            self._running.discard(request_id)
        meta = parse_reply(reply, GenerateReply, self.url).meta_info
        output = GenerateOutput(
            output_ids=[token_id for _, token_id, _ in meta.output_token_logprobs],
            logprobs=[logprob for logprob, _, _ in meta.output_token_logprobs],
            policy_versions=token_versions(meta, self._policy_version),
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
            await self._call("POST", "/abort_request", {"rid": request_id}, idempotent=True)

    async def end_session(self, session_id: str) -> None:
        """Nothing to free: the radix cache evicts a session's prefix when it needs the room."""

    async def pause(self) -> None:
        """Stops decoding; running requests keep their tokens and wait in the server's queue."""
        await self._call("POST", "/pause_generation", {"mode": "retract"}, idempotent=True)
        self._paused = True

    async def resume(self) -> None:
        """Continues decoding after pause(); waiting requests are prefilled again first."""
        await self._call("POST", "/continue_generation", {}, idempotent=True)
        self._paused = False

    async def flush_cache(self) -> None:
        """Empties the radix cache. Raises FailedPreconditionError while requests run."""
        await self._call(
            "POST", "/flush_cache", idempotent=True, rejected_error=FailedPreconditionError
        )

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
        """Has the server join the trainer's weight-sync group (`init_weights_update_group`),
        its tensor-parallel ranks from `rank_offset` on, leaving the group it was in; returns
        once every rank joined, so the trainer must join at the same time.

        Raises FailedPreconditionError when the server cannot join (wrong address, a server of
        several data-parallel replicas, whose ranks would collide) and DeadlineExceededError
        after `timeout_seconds`.
        """
        if self._data_parallel_size > 1:
            raise FailedPreconditionError(
                f"SGLang server at {self.url!r} runs dp_size={self._data_parallel_size}: each "
                "data-parallel replica would join the weight-sync group with the same ranks; "
                "serve one replica per server (rollout.replicas) instead"
            )
        await self._leave_weight_group()
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._weight_sync_call("/init_weights_update_group", body, timeout_seconds)
        self._weight_group = group_name

    async def receive_weights(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has the server receive an update that the trainer broadcasts on the group in
        `layout`: tensor by tensor, one `update_weights_from_distributed` call per bucket of
        `bucket_size_bytes`, or in flattened buckets, one call per run of one dtype in each
        bucket (load_format flattened_bucket); the cache is flushed after the last call, which
        takes `policy_version`. The engine must be paused.

        Raises InvalidArgumentError, before the server receives anything, for a layout it does
        not take and for a tensor its model's checkpoint lacks or has in another shape
        (`check_weights`); FailedPreconditionError when not paused, not in `group_name`, or the
        server fails.
        """
        if layout not in ("per_tensor", self.weight_layout):
            raise InvalidArgumentError(
                f"the SGLang server takes per_tensor or {self.weight_layout} updates, not "
                f"{layout} (engine_options.weight_layout)"
            )
        self.check_weights(metas)
        if group_name != self._weight_group:
            raise FailedPreconditionError(
                f"the SGLang server is not in weight-sync group {group_name!r}; call "
                "InitWeightSync first"
            )
        calls = bucket_indices(metas, bucket_size_bytes)
        if layout == "flattened_buckets":
            calls = [run for bucket in calls for run in dtype_runs(metas, bucket)]
        for index, call in enumerate(calls):
            last = index == len(calls) - 1
            await self.update_weights_from_distributed(
                [metas[i].name for i in call],
                [metas[i].dtype for i in call],
                [metas[i].shape for i in call],
                policy_version if last else self._policy_version,
                group_name=group_name,
                flush_cache=last,
                flattened=layout == "flattened_buckets",
            )

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
        """Receives one bucket of parameters that the trainer broadcasts on the group, one
        broadcast per tensor in the order of `names` (or, `flattened`, one of them all end to
        end, one dtype), and takes `policy_version`. The engine must be paused. Pass
        `flush_cache=False` for every bucket of a push but the last.

        Raises InvalidArgumentError when the three lists differ in length or a dtype is not a
        torch dtype, FailedPreconditionError when the engine is not paused, the version is
        older than the loaded one, or the server fails to load the bucket.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidArgumentError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}"
            )
        self._check_update(policy_version)
        body = {
            "names": list(names),
            "dtypes": [dtype_name(dtype) for dtype in dtypes],
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": str(policy_version),
        }
        if flattened:  # servers before the field reject it
            body["load_format"] = "flattened_bucket"
        await self._weight_sync_call(
            "/update_weights_from_distributed", body, self._options.weight_sync_timeout_seconds
        )
        self._policy_version = policy_version

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor that the server's model
        checkpoint (the rollout config's `model_path`, when it is a local folder) lacks or
        has in another shape; with no local checkpoint the server's own load checks them."""
        if self._checkpoint_shapes is None:
            self._checkpoint_shapes = checkpoint_shapes(self._model_path) or {}
        if self._checkpoint_shapes:
            check_against_checkpoint(metas, self._checkpoint_shapes)

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """None: the server holds the weights, not this process."""
        return None

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Loads weights sent over gRPC (PushWeights, when no weight-sync group formed): they
        are written as a safetensors folder that the server loads (`update_weights_from_disk`),
        so the server must share this machine's disk, as a launched one does. The engine must
        be paused. Raises InvalidArgumentError, before the server sees them, for a tensor its
        checkpoint lacks or has in another shape, and FailedPreconditionError when the server
        fails to load them."""
        self._check_update(policy_version)
        named_tensors = list(named_tensors)
        self.check_weights([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named_tensors])
        with tempfile.TemporaryDirectory(prefix="turnrl-weights-") as folder:
            await asyncio.to_thread(write_update, named_tensors, self._model_path, Path(folder))
            body = {
                "model_path": folder,
                "flush_cache": True,
                "weight_version": str(policy_version),
            }
            await self._weight_sync_call(
                "/update_weights_from_disk", body, self._options.weight_sync_timeout_seconds
            )
        self._policy_version = policy_version

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
        """Counts kept by this client: requests running now, finished, aborted, tokens made."""
        return {
            "running_requests": float(len(self._running)),
            "paused": float(self._paused),
            "policy_version": float(self._policy_version),
            "requests_total": float(self._totals["requests"]),
            "generated_tokens_total": float(self._totals["generated_tokens"]),
            "aborted_total": float(self._totals["aborted"]),
        }

    async def close(self) -> None:
        """Closes the connections and stops the server this engine launched: SIGTERM to its
        process group, SIGKILL after `shutdown_timeout_seconds`. A server given by `url` keeps
        running."""
        await self._client.aclose()
        if self._process is not None and self._options.launch is not None:
            await stop_process_group(self._process, self._options.launch.shutdown_timeout_seconds)

    async def _wait_until_healthy(self) -> None:
        """Polls GET /health_generate (which runs a one-token generation) until it answers 200."""

        async def healthy() -> bool:
            if self._process is not None and self._process.returncode is not None:
                raise UnavailableError(
                    f"SGLang server process {self._process.pid} exited with code "
                    f"{self._process.returncode} before {self.url!r} became healthy; its log "
                    "is above"
                )
            try:
                response = await self._client.get(
                    f"{self.url}/health_generate", timeout=self._options.control_timeout_seconds
                )
            except httpx.TransportError:
                return False
            return response.status_code == 200

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_result(lambda is_healthy: not is_healthy),
            wait=tenacity.wait_exponential_jitter(
                multiplier=RETRY_BASE_SECONDS, max=RETRY_MAX_SECONDS, jitter=RETRY_BASE_SECONDS
            ),
        )
        timeout_seconds = self._options.startup_timeout_seconds
        log.info(
            "waiting up to %g s for the SGLang server at %s to be healthy",
            timeout_seconds,
            self.url,
        )
        try:
            async with asyncio.timeout(timeout_seconds):
                await retrying(healthy)
        except TimeoutError:
            raise DeadlineExceededError(
                f"SGLang server at {self.url!r} was not healthy within {timeout_seconds:g} s"
            ) from None

    async def _call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_seconds: float | None = None,
        idempotent: bool = False,
        rejected_error: type[TurnrlError] = InvalidArgumentError,
    ) -> httpx.Response:
        """Sends one request within `timeout_seconds` (default: control_timeout_seconds) and
        returns its 200 answer; the errors are those of the module docstring.

        Not `turnrl.http_json.post_json`: several SGLang endpoints are GETs or answer with an
        empty or plain-text body.
        """
        timeout_seconds = timeout_seconds or self._options.control_timeout_seconds
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(httpx.TransportError)
            | tenacity.retry_if_result(_is_retryable),
            stop=tenacity.stop_after_attempt(self._options.max_retries + 1 if idempotent else 1),
            wait=tenacity.wait_exponential_jitter(
                multiplier=RETRY_BASE_SECONDS, max=RETRY_MAX_SECONDS, jitter=RETRY_BASE_SECONDS
            ),
            # After the last attempt: its response, or its exception, as it came.
            retry_error_callback=lambda state: state.outcome.result(),
        )
        server = f"SGLang server at {self.url!r}"
        try:
            async with asyncio.timeout(timeout_seconds):
                response = await retrying(self._client.request, method, self.url + path, json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise DeadlineExceededError(
                f"{server} did not answer {method} {path} within {timeout_seconds:g} s"
            ) from None
        except httpx.TransportError as e:
            raise UnavailableError(
                f"{server} is unreachable for {method} {path} ({type(e).__name__}: {e})"
            ) from None
        if _is_retryable(response):
            raise UnavailableError(
                f"{server} failed {method} {path}: HTTP {response.status_code} "
                f"{error_detail(response)!r}"
            )
        if response.status_code != 200:
            raise rejected_error(
                f"{server} rejected {method} {path}: HTTP {response.status_code} "
                f"{error_detail(response)!r}"
            )
        return response

    def _check_update(self, policy_version: int) -> None:
        if not self._paused:
            raise FailedPreconditionError(
                "pause() the engine before updating its weights: SGLang flushes its cache after "
                "an update and fails while requests run"
            )
        if policy_version < self._policy_version:
            raise FailedPreconditionError(
                f"policy_version {policy_version} is older than the loaded version "
                f"{self._policy_version}"
            )

    async def _leave_weight_group(self) -> None:
        """Has the server leave its weight-sync group, if any, so its name and its
        communicators are free; a server without `/destroy_weights_update_group` keeps it."""
        if not self._weight_group:
            return
        try:
            await self._weight_sync_call(
                "/destroy_weights_update_group",
                {"group_name": self._weight_group},
                self._options.control_timeout_seconds,
            )
        except TurnrlError as e:
            log.warning("the SGLang server kept weight-sync group %r: %s", self._weight_group, e)
        self._weight_group = ""

    async def _weight_sync_call(self, path: str, body: dict, timeout_seconds: float) -> None:
        response = await self._call(
            "POST", path, body, timeout_seconds=timeout_seconds,
            rejected_error=FailedPreconditionError,
        )  # fmt: skip
        reply = parse_reply(response, WeightSyncReply, self.url)
        if not reply.success:
            raise FailedPreconditionError(
                f"SGLang server at {self.url!r} failed POST {path}: {reply.message!r}"
            )

    async def _abort_abandoned(self, request_id: str) -> None:
        """Tells the server to drop a request whose caller gave up. Failures are logged only:
        the server also aborts a request once its connection closes."""
        try:
            await self._call("POST", "/abort_request", {"rid": request_id}, idempotent=True)
        except TurnrlError as e:
            log.warning("could not abort abandoned request %r: %s", request_id, e)


def _is_retryable(response: httpx.Response) -> bool:
    return response.status_code == 429 or response.status_code >= 500
