"""SGLang as the rollout engine, through the native HTTP API of an SGLang server.

The engine either connects to a running server (`url`) or starts one itself (`launch`: runs
`python -m sglang.launch_server` bound to 127.0.0.1 with `--context-length max_model_len`,
waits until it is healthy, stops it on close: `server_process`). Either way it refuses, at
start, a server whose context is shorter than `max_model_len`. The release it is written
against is SGLang 0.5.23 (paths in comments: its wheel's, under `sglang/srt/`). Token in,
token out: `/generate` gets `input_ids` and answers each
sampled token with its logprob (`meta_info.output_token_logprobs`, [logprob, token_id, text]
triples); the ids and logprobs are both read from those triples, so they cannot fall out of
step. Request and reply shapes are `sglang_api`'s.

- Lengths: SGLang's scheduler keeps `SCHEDULER_RESERVED_TOKENS` of its context back, so it
  admits prompts up to max_model_len - 7 tokens (the engine refuses longer ones itself, with
  that limit in the message), and ends a generation 2 tokens short of max_model_len; each
  request's max_new_tokens is cut to the room left under `max_model_len`, as SGLang refuses
  a request whose prompt and max_new_tokens pass its context.
- Request ids: each request runs under `sglang_rid(request_id)`, since SGLang aborts every
  request whose rid starts with the one given.
- Sessions: SGLang's radix cache finds the prefix a session's requests share by itself, so
  `session_id` is not sent and `end_session` has nothing to free.
- Pause: `/pause_generation` in "retract" mode. Running requests go back to the waiting queue
  with their tokens and are prefilled again on resume, under the weights then loaded. The
  "in_place" mode would keep KV computed by the old weights, and SGLang asserts an idle cache
  when it flushes after a weight update, so it is not offered. (Servers older than the mode
  field abort the running requests instead.)
- Weights: the server, which holds them, joins the trainer's weight-sync group itself (with
  all its tensor-parallel ranks) and receives each update there, inside a weight-update
  session, or from a safetensors folder without a group; the rollout service's process stays
  out of the group (`sglang_weight_sync`). Servers that report
  per-token `weight_versions` spans let a generation that spans a push carry both versions.
- A weight call that fails leaves the server's weights partly updated: the engine then refuses
  to generate (`broken_push_error`) until an update completes, and on resume aborts the
  requests that were in flight.
- LoRA adapters (`engine_options.lora`: the server starts with `--enable-lora` and its
  limits): each is written as a peft folder and loaded with `/load_lora_adapter` under a
  name of its version; every later `/generate` names it as `lora_path`, and its tokens carry
  that version (the server's `weight_version` counts whole-weight updates only). The adapter
  it replaces is unloaded with `/unload_lora_adapter` (`ServerEngine.load_lora_adapter`).
- Images (a vision-language model's): sent with the request as `image_data`, their encoded
  bytes, which the server processes itself (its processor, not turnrl's PIL one: pixel values
  may differ in the last bits); each image's run of tokens goes as one pad, which 0.5.23
  expands by its own count, and the prompt it made (`return_prompt_token_ids`) must equal
  turnrl's (`server_images`). A session's requests carry all its images so far: the prompt is
  whole each time.
- Calls, their deadlines and retries, and how failures map onto turnrl errors: `engine_http`.
"""

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Literal, Self

import torch
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
from rollout_svc.engines.sglang_api import (
    SCHEDULER_RESERVED_TOKENS,
    GenerateReply,
    ModelInfo,
    ServerInfo,
    request_metrics,
    sampling_params,
    sglang_rid,
    token_versions,
)
from rollout_svc.engines.sglang_weight_sync import ServerWeights
from rollout_svc.engines.weight_versions import version_number
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TurnrlError,
)

log = logging.getLogger(__name__)

SGLANG_SERVER_MODULE = "sglang.launch_server"


class SglangEngineOptions(ServerEngineOptions):
    """Settings of the SGLang engine (the rollout config's `engine_options` when the engine is
    "sglang"): the server's (`ServerEngineOptions`) and how it takes weight updates."""

    weight_layout: Literal["per_tensor", "flattened_buckets"] = Field(
        default="per_tensor",
        description="How the server takes weight updates: per_tensor (one broadcast per "
        "tensor; every SGLang version) or flattened_buckets (one per bucket of one dtype, "
        "load_format flattened_bucket: far fewer broadcasts; only servers whose "
        "update_weights_from_distributed takes load_format).",
    )


def lora_server_flags(lora: ServerLoraOptions | None) -> list[str]:
    """The flags that start an SGLang server able to load adapters at run time (0.5.23's
    `server_args.py`); at most 2 adapters serve a batch, the new one and the one it replaces."""
    if lora is None:
        return []
    return [
        "--enable-lora",
        *("--max-lora-rank", str(lora.max_rank)),
        *("--lora-target-modules", *lora.target_modules),
        *("--max-loras-per-batch", "2"),
    ]


class SglangEngine(ServerEngine):
    """The `Engine` protocol over an SGLang server's HTTP API (see the module docstring)."""

    LOAD_ADAPTER_PATH = "/load_lora_adapter"
    UNLOAD_ADAPTER_PATH = "/unload_lora_adapter"

    def __init__(
        self,
        options: SglangEngineOptions,
        model_path: str,
        max_model_len: int,
        url: str,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        """Use `create()`, which also starts the server and checks it."""
        http = EngineHttp(
            "SGLang",
            url,
            options.max_concurrent_requests,
            options.control_timeout_seconds,
            options.max_retries,
            health_path="/health_generate",  # runs a one-token generation
        )
        weights = ServerWeights(
            http,
            model_path,
            options.weight_layout,
            options.weight_sync_timeout_seconds,
            options.control_timeout_seconds,
        )
        super().__init__(http, weights, options, model_path, max_model_len, process)
        self.weights: ServerWeights = weights
        self._max_prompt_len = max_model_len - 1  # the server's own limit, read at start
        self._running: set[str] = set()

    @classmethod
    async def create(
        cls, options: SglangEngineOptions, model_path: str, max_model_len: int
    ) -> Self:
        """Starts a server of `model_path` with --context-length `max_model_len` when
        `options.launch` is set (a server given by `url` serves its own); waits until it is
        healthy and checks that it serves a generation model with a context of at least
        `max_model_len`; the engine takes the version the server reports. Prompts longer than
        the server's scheduler admits (max_model_len - 7 tokens at its context's least) are
        refused.

        Raises UnavailableError when the server is unreachable or its process exits during
        start-up (an unknown flag in `launch.extra_args` ends it so), DeadlineExceededError
        when it is not healthy in `startup_timeout_seconds`, and InvalidArgumentError when it
        serves an embedding model or its context is too short for `max_model_len`.
        """
        process = None
        if options.launch is None:
            assert options.url is not None  # the options validator ensures one of the two
            engine = cls(options, model_path, max_model_len, options.url)
        else:
            arguments = [
                *("--model-path", model_path, "--context-length", str(max_model_len)),
                *lora_server_flags(options.lora),
            ]
            process, url = await start_server(options.launch, SGLANG_SERVER_MODULE, arguments)
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
            engine._check_context(server)
            engine.weights.ranks = server.tp_size
            engine.weights.data_parallel_size = server.dp_size
        except BaseException:
            await engine.close()
            raise
        return engine

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
        abort the request before the error propagates. `images` go as `image_data` (their
        bytes: the server processes them itself), each image's tokens as one pad, which the
        server expands; the prompt it made is checked against ours (`server_images`).

        Raises InvalidArgumentError for empty `input_ids` or a prompt longer than the server
        admits (at most max_model_len - 1 tokens), a `request_id` already running, or a
        request the server refuses with HTTP 400 (sampling values out of its ranges);
        FailedPreconditionError (`broken_push_error`) while the weights are incomplete, also
        for a request in flight when a weight update broke off, and when the server expanded
        the images to other tokens than turnrl's processor.
        """
        self._check_weights_complete()
        check_prompt(input_ids, self._max_model_len)
        if len(input_ids) > self._max_prompt_len:
            raise InvalidArgumentError(
                f"prompt of {len(input_ids)} tokens is longer than the {self._max_prompt_len} "
                f"the {self._http.name} admits under max_model_len={self._max_model_len} (its "
                f"scheduler keeps {SCHEDULER_RESERVED_TOKENS} tokens of the context back)"
            )
        if request_id in self._running:
            raise InvalidArgumentError(f"request_id {request_id!r} is already running")
        room = self._max_model_len - len(input_ids)
        body = {
            "rid": sglang_rid(request_id),
            "input_ids": one_pad_per_image(input_ids, images),
            "sampling_params": sampling_params(sampling, min(sampling.max_new_tokens, room)),
            "return_logprob": True,
            "logprob_start_len": -1,  # logprobs of the output tokens only
            "stream": False,
        }
        if images:
            body["image_data"] = [image.image.data_url() for image in images]
            body["return_prompt_token_ids"] = True  # to check its expansion against ours
        adapter = self.adapter  # the request keeps it to its end, pushes or not
        if adapter is not None:
            body["lora_path"] = adapter[0]
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
        parsed = self._http.parse(reply, GenerateReply)
        if images:
            check_served_prompt(self._http.name, parsed.prompt_token_ids, input_ids, images)
        meta = parsed.meta_info
        output = GenerateOutput(
            output_ids=[token_id for _, token_id, _ in meta.output_token_logprobs],
            logprobs=[logprob for logprob, _, _ in meta.output_token_logprobs],
            policy_versions=token_policy_versions(
                adapter, token_versions(meta, self.weights.policy_version)
            ),
            finish_reason=FinishReason(meta.finish_reason.type),
            metrics=request_metrics(meta),
        )
        if on_tokens is not None:
            on_tokens(output.output_ids)
        return self._count(output)

    async def abort(self, request_id: str) -> None:
        """Ends a running request early; its generate() returns the tokens sampled so far with
        FinishReason.ABORT. A request that is not running (finished, unknown) is left alone."""
        if request_id in self._running:
            await self._abort(request_id)

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
                await self._abort(request_id)
        await self._http.call("POST", "/continue_generation", {}, idempotent=True)
        self._paused = False

    async def flush_cache(self) -> None:
        """Empties the radix cache. Raises FailedPreconditionError while requests run."""
        await self._http.call(
            "POST", "/flush_cache", idempotent=True, rejected_error=FailedPreconditionError
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
        """Has the server receive one bucket broadcast on the group
        (`ServerWeights.update_from_distributed`); pass `flush_cache=False` for every bucket
        of a push but the last. Raises FailedPreconditionError when the engine is not paused,
        and as that does."""
        self._check_paused()
        await self.weights.update_from_distributed(
            names, dtypes, shapes, policy_version, group_name=group_name,
            flush_cache=flush_cache, flattened=flattened,
        )  # fmt: skip

    def _check_context(self, server: ServerInfo) -> None:
        """Takes the longest prompt the server admits; raises InvalidArgumentError when its
        context (or its KV cache) is shorter than max_model_len."""
        if server.max_req_input_len is None:
            log.warning(
                "%s does not report max_req_input_len: prompts near max_model_len=%d may be "
                "refused by the server",
                self._http.name,
                self._max_model_len,
            )
            return
        context = server.max_req_input_len + SCHEDULER_RESERVED_TOKENS
        if context < self._max_model_len:
            raise InvalidArgumentError(
                f"{self._http.name} serves a context of {context} tokens (max_req_input_len "
                f"{server.max_req_input_len}), less than max_model_len={self._max_model_len}; "
                f"start it with --context-length {self._max_model_len} or more (and room for "
                "it in its KV cache), or lower max_model_len"
            )
        self._max_prompt_len = min(self._max_prompt_len, server.max_req_input_len - 1)

    async def _abort(self, request_id: str) -> None:
        body = {"rid": sglang_rid(request_id)}
        await self._http.call("POST", "/abort_request", body, idempotent=True)

    async def _abort_abandoned(self, request_id: str) -> None:
        """Tells the server to drop a request whose caller gave up. Failures are logged only:
        the server also aborts a request once its connection closes."""
        try:
            await self._abort(request_id)
        except TurnrlError as e:
            log.warning("could not abort abandoned request %r: %s", request_id, e)
