"""The `hf` engine: a transformers causal LM with continuous batching, for CPU and small GPUs.

This module is its scheduler and its `Engine` face; the model compute (prefill, decode,
sampling, weights) is `hf_compute`, the KV caches `hf_cache`. One worker thread owns the model;
the event loop only enqueues requests and awaits futures the worker settles with
`loop.call_soon_threadsafe`, so no torch work ever runs on the loop. Each worker iteration, in
order:

1. applies aborts and runs control commands (pause, resume, update_weights); while a weight
   update is incomplete (it broke off part-way) and the engine is not paused, ends every
   request with `broken_push_error` instead of computing with a mix of two versions;
2. admits the next waiting requests that fit in the free batch slots and `max_prefill_tokens`:
   one batched prefill forward computes the KV of each one's prompt but its last token, over the
   suffix that the session's cached KV does not already cover (a prefix that all the admitted
   prompts share, such as a system prompt, is computed once, in a forward of its own);
3. runs one decode forward over every running request, feeding each its last token (for a
   request just admitted, its prompt's last) and sampling one token each; a request that ends
   leaves at once, a new one joins in the next iteration (no batch barrier);
4. publishes stats, then answers the callers whose request or command completed.

A large wave of arrivals is thus prefilled a budget's worth per iteration, with a decode step
between, so running requests keep decoding and the first admitted start theirs early.
"""

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Self

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rollout_svc.engines.base import (
    EngineImage,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    broken_push_error,
)
from rollout_svc.engines.hf_cache import Kv, SessionKvStore
from rollout_svc.engines.hf_compute import ModelRunner, load_model
from rollout_svc.engines.hf_options import HfEngineOptions, validate_request
from rollout_svc.engines.hf_request import Request
from rollout_svc.engines.hf_vision import check_images
from rollout_svc.engines.stop_strings import ends_on_stop_string
from turnrl.errors import AlreadyExistsError, FailedPreconditionError, UnavailableError
from turnrl.weights import BucketedWeights, LoraAdapter, TensorMeta

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_SECONDS = 60.0


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: object) -> None:
    """Calls `callback(*args)` on another thread's loop; a closed loop means nobody is
    waiting any more."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome: object) -> None:
    """Sets `outcome` (an exception is raised to the awaiter) on a future of another thread's loop."""

    def settle() -> None:
        if future.done():  # the awaiter was cancelled
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    _call_soon(loop, settle)


def _outcome_of(command: Callable[[], object]) -> object:
    """The command's result, or the exception it raised (for its caller to see)."""
    try:
        return command()
    except Exception as error:
        return error


class HfEngine:
    """A transformers causal LM serving concurrent requests with continuous batching and a
    per-session KV cache. Build it with `await HfEngine.create(options, model_path,
    max_model_len)`.

    Logprobs are those of the raw model distribution, log_softmax of the unscaled float32
    logits, whatever the temperature, top-p or penalty that picked the token: that is what the
    trainer recomputes (verl and slime define the rollout logprob the same way), so the
    importance ratio is 1 when the weights have not changed.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        options: HfEngineOptions,
        max_model_len: int,
    ):
        """`max_model_len`: most tokens (prompt + response) of one request; a longer prompt is
        rejected and generation ends with LENGTH on reaching it. `tokenizer` decodes outputs
        to find stop strings."""
        self._tokenizer = tokenizer
        self._options = options
        self._max_model_len = max_model_len
        self._runner = ModelRunner(model, options.max_batch_size, max_model_len)
        self._seeds = random.Random(options.seed)
        # Shared with the event loop, guarded by _lock.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._requests: dict[str, Request] = {}
        self._incoming: list[Request] = []
        self._abort_ids: set[str] = set()
        self._commands: list[
            tuple[Callable[[], object], asyncio.Future, asyncio.AbstractEventLoop]
        ] = []
        self._sessions = SessionKvStore(options.kv_cache_budget_bytes)
        self._closed = False  # no new requests or commands
        self._incomplete_update: int | None = None  # `broken_push_version`
        self._failure: UnavailableError | None = None  # why the worker broke
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closing = False  # the worker ends everything and exits
        self._paused = False  # set by the worker (pause and resume are worker commands)
        # Owned by the worker thread.
        self._waiting: deque[Request] = deque()
        # Replies to send after this iteration's stats are published: (loop, future, outcome).
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, object]] = []
        # busy_seconds: time spent prefilling and decoding, the engine's share of the machine.
        self._counters = {"prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0, "busy_seconds": 0.0}
        self._stats: dict[str, float] = {}
        self._publish_stats()
        self._worker = threading.Thread(target=self._work, name="hf-engine", daemon=True)
        self._worker.start()

    @classmethod
    async def create(cls, options: HfEngineOptions, model_path: str, max_model_len: int) -> Self:
        """Loads the model and its tokenizer in `model_path` (in a thread) and starts the
        worker."""
        model = await asyncio.to_thread(load_model, model_path, options.dtype, options.device)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_path)
        return cls(model, tokenizer, options, max_model_len)

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for the initial weights."""
        return self._runner.policy_version

    @property
    def broken_push_version(self) -> int | None:
        """The version of a weight update that began and did not complete before the engine
        resumed (see the `Engine` protocol); None while the weights are one version or an
        update is under way (paused)."""
        with self._lock:
            return None if self._paused else self._incomplete_update

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
        """Samples a continuation of `input_ids` (see the `Engine` protocol), calling
        `on_tokens` with each id as the step that samples it ends. Raises
        InvalidArgumentError for an empty or too long prompt, an id outside the vocabulary, a
        bad sampling value, images for a text model or off their tokens; AlreadyExistsError
        when `request_id` is running; FailedPrecondition
        after close(), and `broken_push_error` while a weight update is incomplete (also for
        a request in flight when it broke off). Cancelling the call aborts the request."""
        validate_request(input_ids, sampling, self._runner.vocab_size, self._max_model_len)
        if images:
            check_images(input_ids, images, self._runner.image_token_id)
        loop = asyncio.get_running_loop()
        greedy = sampling.temperature == 0
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        device = self._runner.model.device
        request = Request(
            request_id=request_id,
            session_id=session_id,
            sampling=sampling,
            stop_token_ids=self._runner.eos_token_ids | frozenset(sampling.stop_token_ids),
            token_ids=list(input_ids),
            prompt_len=len(input_ids),
            generator=None if greedy else torch.Generator(device).manual_seed(seed),
            future=loop.create_future(),
            loop=loop,
            on_tokens=on_tokens,
            images=list(images),
        )
        with self._lock:
            if self._closed:
                raise FailedPreconditionError("the hf engine is closed")
            if self._incomplete_update is not None and not self._paused:
                raise broken_push_error(self._incomplete_update)
            if request_id in self._requests:
                raise AlreadyExistsError(f"request {request_id!r} is already running")
            self._requests[request_id] = request
            self._incoming.append(request)
            self._wakeup.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            await self.abort(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """Ends a request at the next step with FinishReason.ABORT and the tokens sampled so
        far; an unknown or finished request is ignored."""
        with self._lock:
            if request_id in self._requests:
                self._abort_ids.add(request_id)
                self._wakeup.notify()

    async def end_session(self, session_id: str) -> None:
        """Frees the session's cached KV, if any."""
        with self._lock:
            self._sessions.pop(session_id)

    async def pause(self) -> None:
        """Stops decoding at the next step boundary and returns once it has; running requests
        keep their KV and tokens and their generate() calls stay pending, as do new ones."""
        await self._call_in_worker(lambda: self._set_paused(True))

    async def resume(self) -> None:
        """Continues decoding after pause()."""
        await self._call_in_worker(lambda: self._set_paused(False))

    async def begin_weight_update(self, policy_version: int) -> None:
        """Marks the weights incomplete before an update to `policy_version` lands in them
        (the caller pauses first): until update_weights takes that version or a newer one,
        generate refuses, and on resume the requests in flight end with `broken_push_error`."""
        with self._lock:
            self._incomplete_update = policy_version

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copies tensors into the model's parameters by name and takes `policy_version`
        (which ends begin_weight_update's mark when it is that version or a newer one).

        Runs between two decode steps (the caller pauses first). Every tensor is checked before
        any is copied: an unknown name or a wrong shape raises InvalidArgumentError naming the
        parameter, and the model is unchanged. On success every cached session KV is dropped,
        and running requests recompute their KV from their tokens under the new weights.
        """
        await self._call_in_worker(lambda: self._load_weights(list(named_tensors), policy_version))

    @property
    def lora_adapters_refusal(self) -> str:
        """Empty: the engine loads LoRA adapters (`load_lora_adapter`)."""
        return ""

    async def load_lora_adapter(
        self,
        adapter: LoraAdapter,
        named_tensors: list[tuple[str, torch.Tensor]],
        policy_version: int,
    ) -> None:
        """Copies the adapter into the model's LoRA layers, put on by the first adapter, and
        takes `policy_version` (`ModelRunner.load_adapter`: its errors, its limits). Runs
        between two decode steps (the caller pauses first); on success every cached session
        KV is dropped, and running requests recompute their KV under the new adapter."""
        await self._call_in_worker(
            lambda: self._load_adapter(adapter, named_tensors, policy_version)
        )

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """The parameters, moved into one buffer laid out as this update travels (a copy, the
        first time a layout is asked for; the engine must be paused), so that a broadcast
        received into it is the load. None when an update tensor's dtype differs from its
        parameter's or two names share a parameter (tied embeddings sent twice). Raises
        InvalidArgumentError as check_weights does."""
        return await self._call_in_worker(
            lambda: self._runner.lay_out_parameters(list(metas), bucket_size_bytes)
        )

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor the model has no parameter
        for, or whose parameter has another shape."""
        self._runner.check_shapes((meta.name, meta.shape) for meta in metas)

    async def watch(self) -> None:
        """Waits while the worker runs; raises UnavailableError once it has broken (a bug:
        a failed forward or sample fails its own requests only, and the worker goes on)."""
        loop = asyncio.get_running_loop()
        broken = loop.create_future()
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._watchers.append((loop, broken))
        await broken

    def stats(self) -> dict[str, float]:
        """running, waiting, paused and weights_incomplete (0/1; 1 also while an update is
        under way), policy_version, cached_sessions, session_kv_bytes, running_kv_bytes
        (allocated), session_evictions, and the running totals
        tokens_generated, prefill_tokens (computed), prefill_forwards, prefix_cache_hits,
        prefix_cache_hit_tokens (reused) and busy_seconds (prefilling and decoding)."""
        with self._lock:
            return {
                **self._stats,
                "waiting": self._stats["waiting"] + len(self._incoming),
                "cached_sessions": len(self._sessions),
                "session_kv_bytes": self._sessions.nbytes,
                "session_evictions": self._sessions.evictions,
                "weights_incomplete": float(self._incomplete_update is not None),
            }

    async def close(self) -> None:
        """Ends every request with ABORT, stops the worker and frees the model's caches."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
            self._wakeup.notify()
        await asyncio.to_thread(self._worker.join, CLOSE_TIMEOUT_SECONDS)
        if self._worker.is_alive():
            logger.warning("hf engine worker still busy %.0fs after close", CLOSE_TIMEOUT_SECONDS)

    # The worker thread.

    async def _call_in_worker(self, command: Callable[[], object]) -> object:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise FailedPreconditionError("the hf engine is closed")
            self._commands.append((command, future, loop))
            self._wakeup.notify()
        return await future

    def _set_paused(self, paused: bool) -> None:
        with self._lock:
            self._paused = paused

    def _work(self) -> None:
        try:
            with torch.no_grad():
                while self._iterate():
                    pass
        except Exception as error:  # a bug: every caller hears of it instead of hanging
            logger.exception("hf engine worker failed")
            self._finish_all(error)
            self._flush()
            with self._lock:
                self._failure = UnavailableError(f"the hf engine's worker failed: {error!r}")
                watchers, self._watchers = self._watchers, []
            for loop, broken in watchers:
                _settle(loop, broken, self._failure)

    def _has_work(self) -> bool:
        if self._commands or self._abort_ids or self._closing:
            return True
        return not self._paused and bool(
            self._incoming or self._waiting or self._runner.batch.requests
        )

    def _iterate(self) -> bool:
        with self._lock:
            self._wakeup.wait_for(self._has_work)
            commands, self._commands = self._commands, []
            self._waiting.extend(self._incoming)
            self._incoming = []
            abort_ids, self._abort_ids = self._abort_ids, set()
            closing = self._closing
        self._apply_aborts(abort_ids)
        for command, future, loop in commands:
            self._outbox.append((loop, future, _outcome_of(command)))
        if commands:
            # Answered before this iteration's compute: a Resume after a weight load would
            # otherwise wait for the re-prefill of the whole batch.
            self._flush()
        with self._lock:
            incomplete_update = self._incomplete_update
        if closing:
            self._finish_all(FinishReason.ABORT)
        elif not self._paused and incomplete_update is not None:
            self._fail_requests(broken_push_error(incomplete_update))
        elif not self._paused:
            started = time.perf_counter()
            self._admit()
            if self._runner.batch.requests:
                self._decode_step()
            self._counters["busy_seconds"] += time.perf_counter() - started
        self._flush()
        return not closing

    def _flush(self) -> None:
        """Publishes stats, then answers callers: whoever awaited a result or a command sees
        its effect in stats()."""
        self._publish_stats()
        outbox, self._outbox = self._outbox, []
        for loop, future, outcome in outbox:
            _settle(loop, future, outcome)

    def _apply_aborts(self, abort_ids: set[str]) -> None:
        if not abort_ids:
            return
        for request in [r for r in self._waiting if r.request_id in abort_ids]:
            self._waiting.remove(request)
            self._finish(request, FinishReason.ABORT, request.reused_kv)
        rows = [
            row for row, r in enumerate(self._runner.batch.requests) if r.request_id in abort_ids
        ]
        for request, kv in self._runner.batch.remove(rows):
            self._finish(request, FinishReason.ABORT, kv)

    def _admit(self) -> None:
        """Prefills the next waiting requests, first come first served, as many as fit in the
        free batch slots and in max_prefill_tokens together, and adds them to the batch."""
        admitted: list[Request] = []
        longest = 0  # the most tokens one of them computes
        while (
            self._waiting
            and len(self._runner.batch.requests) + len(admitted) < self._options.max_batch_size
        ):
            request = self._waiting[0]
            if request.kv_len == 0 and request.session_id:
                self._take_session_kv(request)
            new_tokens = len(request.token_ids) - 1 - request.kv_len
            padded_tokens = (len(admitted) + 1) * max(longest, new_tokens)
            if admitted and padded_tokens > self._options.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
            longest = max(longest, new_tokens)
        if not admitted:
            return
        try:
            kvs = self._runner.prefill(admitted)
        except Exception as error:  # e.g. out of memory on long prompts: fail these only
            logger.exception("prefill of %d requests failed", len(admitted))
            for request in admitted:
                self._finish(request, error, None)
            return
        self._runner.batch.extend(list(zip(admitted, kvs, strict=True)))

    def _take_session_kv(self, request: Request) -> None:
        """Reuses the session's KV over the longest common prefix with this request's tokens
        and images, leaving at least one token to compute (its logits pick the first new
        token)."""
        with self._lock:
            entry = self._sessions.pop(request.session_id)
        if entry is None:
            return
        reused = entry.shared_prefix(request.token_ids[:-1], request.image_keys)
        if reused == 0:
            return
        request.reused_kv = [
            (keys[:, :, :reused], values[:, :, :reused]) for keys, values in entry.kv
        ]
        request.kv_len = request.cached_prompt_tokens = reused
        self._counters["prefix_cache_hits"] += 1
        self._counters["prefix_cache_hit_tokens"] += reused

    def _decode_step(self) -> None:
        requests = list(self._runner.batch.requests)
        try:
            logits = self._runner.batch.decode()
        except Exception as error:  # e.g. out of memory: fail the batch, keep serving
            logger.exception("decode step failed")
            self._runner.batch.clear()
            for request in requests:
                self._finish(request, error, None)
            return
        failed = self._runner.sample(requests, logits)
        for row, request in enumerate(requests):
            if request.on_tokens is not None and row not in failed:
                # Queued on the loop before the request's result is (`_flush`), so in order.
                _call_soon(request.loop, request.on_tokens, request.output_ids[-1:])
        done = [(row, failed.get(row) or self._finish_reason(r)) for row, r in enumerate(requests)]
        done = [(row, outcome) for row, outcome in done if outcome is not None]
        removed = self._runner.batch.remove([row for row, _ in done])
        for (request, kv), (_, outcome) in zip(removed, done, strict=True):
            self._finish(request, outcome, kv)

    def _finish_reason(self, request: Request) -> FinishReason | None:
        if request.output_ids[-1] in request.stop_token_ids or ends_on_stop_string(
            self._tokenizer.decode, request.output_ids, request.sampling.stop_strings
        ):
            return FinishReason.STOP
        if (
            len(request.output_ids) >= request.sampling.max_new_tokens
            or len(request.token_ids) >= self._max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, outcome: FinishReason | Exception, kv: Kv | None) -> None:
        """Hands the request's result (or error) to its caller and keeps its session's KV."""
        with self._lock:
            self._requests.pop(request.request_id, None)
            if kv is not None and request.session_id and not isinstance(outcome, Exception):
                covered = request.token_ids[: request.kv_len]
                images = tuple(key for key in request.image_keys if key[0] < request.kv_len)
                self._sessions.put(request.session_id, covered, kv, images)
        result = outcome if isinstance(outcome, Exception) else request.output(outcome)
        self._outbox.append((request.loop, request.future, result))

    def _finish_all(self, outcome: FinishReason | Exception) -> None:
        """Ends every request and command (at close, or when the worker broke)."""
        with self._lock:
            self._closed = True
            commands, self._commands = self._commands, []
            self._sessions.clear()
        for _, future, loop in commands:
            self._outbox.append((loop, future, FailedPreconditionError("the hf engine is closed")))
        self._fail_requests(outcome)

    def _fail_requests(self, outcome: FinishReason | Exception) -> None:
        """Ends every running and waiting request with `outcome`."""
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming = []
        for request in [*self._runner.batch.clear(), *self._waiting]:
            self._finish(request, outcome, None)
        self._waiting.clear()

    def _load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        self._runner.load_weights(named_tensors, policy_version)
        self._after_load(policy_version)

    def _load_adapter(
        self,
        adapter: LoraAdapter,
        named_tensors: list[tuple[str, torch.Tensor]],
        policy_version: int,
    ) -> None:
        self._runner.load_adapter(adapter, named_tensors, policy_version)
        self._after_load(policy_version)

    def _after_load(self, policy_version: int) -> None:
        """What follows loading weights of `policy_version`: the cached KV is stale."""
        with self._lock:
            self._sessions.clear()
            if self._incomplete_update is not None and policy_version >= self._incomplete_update:
                self._incomplete_update = None
        # Their KV came from the old weights: recompute it from their tokens, first in line.
        self._waiting.extendleft(reversed(self._runner.batch.clear()))
        for request in self._waiting:
            request.kv_len, request.reused_kv = 0, None
            if request.vision is not None:
                request.vision.forget_features()  # the old vision tower's

    def _publish_stats(self) -> None:
        with self._lock:
            self._stats = {
                "running": len(self._runner.batch.requests),
                "waiting": len(self._waiting),
                "paused": float(self._paused),
                "policy_version": self._runner.policy_version,
                "running_kv_bytes": self._runner.batch.kv_bytes(),
                **self._runner.counters,
                **self._counters,
            }
