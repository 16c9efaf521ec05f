"""The `hf` engine: a transformers causal LM with continuous batching, for CPU and small GPUs.

One worker thread owns the model; the event loop only enqueues requests and awaits futures the
worker settles with `loop.call_soon_threadsafe`, so no torch work ever runs on the loop. Each
worker iteration, in order:

1. applies aborts and runs control commands (pause, resume, update_weights);
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

Running requests share one left-padded cache (`hf_cache.BatchKv`): row i holds its request's KV
right-aligned, a 2-D attention mask hides the padding and `position_ids` carry each row's true
position, so a row's numbers do not depend on its batch mates (up to float rounding). The price
is that every row attends over the longest row's width, the usual cost of padded batching. A
prefill batch pads the other way round, each row's cached prefix left and its new tokens right,
so its tokens are contiguous and every query attends to at least itself.
"""

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from rollout_svc.engines.base import FinishReason, GenerateOutput, SamplingParams
from rollout_svc.engines.hf_cache import BatchKv, Kv, SessionKvStore
from turnrl.config import StrictModel
from turnrl.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from turnrl.weights import BucketedWeights, TensorMeta

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_SECONDS = 60.0
# Requests admitted together whose prompts start alike (a system prompt) compute the common
# part once when it is at least this long.
MIN_SHARED_PREFIX_TOKENS = 32


class HfEngineOptions(StrictModel):
    """Settings of the `hf` engine (the rollout config's `engine_kwargs`)."""

    model_path: str = Field(
        min_length=1, description="Directory of a transformers causal LM (config + weights)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Weight and activation dtype; float32 on CPU, bfloat16 on a GPU. Logprobs "
        "are always computed in float32.",
    )
    device: str = Field(default="cpu", description="Torch device of the model: cpu, cuda, cuda:1.")
    max_batch_size: int = Field(
        default=8, ge=1, description="Requests decoded together; more wait in a queue."
    )
    max_model_len: int = Field(
        default=2048,
        ge=2,
        description="Most tokens (prompt + response) of one request; a longer prompt is "
        "rejected and generation ends with LENGTH on reaching it.",
    )
    max_prefill_tokens: int = Field(
        default=8192,
        ge=1,
        description="Most tokens one prefill forward runs, padding included: the requests "
        "admitted together times the longest prompt suffix among them. Bounds the prefill's "
        "activations and how long decoding waits for it; a longer prompt is prefilled alone.",
    )
    kv_cache_budget_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description="Bytes of KV cache kept for finished requests' sessions, so a session's next "
        "turn computes only its new tokens; least recently used sessions are evicted beyond it. "
        "Running requests' KV is not counted (it is bounded by max_batch_size * max_model_len).",
    )
    seed: int = Field(
        default=0, description="Seeds the per-request generators of requests that set no seed."
    )


@dataclass(eq=False)
class _Request:
    """One generate() call: its inputs, its future, and its state in the worker."""

    request_id: str
    session_id: str
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    generator: torch.Generator | None  # None: greedy
    future: asyncio.Future[GenerateOutput]
    loop: asyncio.AbstractEventLoop
    submitted_at: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading token_ids whose KV the worker holds for this request
    reused_kv: Kv | None = None  # KV of token_ids[:kv_len] found at admission, not yet batched
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0  # prefill tokens run through the model, recomputes included


class _RunningBatch:
    """The running requests and their KV, row i of `kv` being requests[i]. Every request here has
    its last token (its prompt's last, or its latest sample) not yet fed:
    kv_len == len(token_ids) - 1."""

    def __init__(self, model: PreTrainedModel, max_rows: int, max_columns: int):
        self._model = model
        self._max_rows, self._max_columns = max_rows, max_columns
        self.requests: list[_Request] = []
        self._kv_layout: Kv | None = None
        self._kv: BatchKv | None = None

    def kv_layout(self) -> Kv:
        """One token's KV per layer: the heads, head size, dtype and device of the model's KV,
        from a forward run on first use (in the worker thread)."""
        if self._kv_layout is None:
            cache = DynamicCache(config=self._model.config)
            input_ids = torch.zeros((1, 1), dtype=torch.long, device=self._model.device)
            self._model(input_ids=input_ids, cache=cache, use_cache=True)
            self._kv_layout = [(layer.keys, layer.values) for layer in cache.layers]
        return self._kv_layout

    def kv_bytes(self) -> int:
        return self._kv.nbytes() if self._kv is not None else 0

    def extend(self, joining: list[tuple[_Request, Kv | None]]) -> None:
        """Adds requests with their own KV (None: none yet)."""
        if self._kv is None:
            self._kv = BatchKv(self.kv_layout(), self._max_rows, self._max_columns)
        self._kv.append([kv for _, kv in joining])
        self.requests += [request for request, _ in joining]

    def remove(self, rows: list[int]) -> list[tuple[_Request, Kv]]:
        """Takes requests out; returns each with a copy of its KV, unpadded. The last rows move
        into the freed ones."""
        if not rows:
            return []
        width = self._kv.width
        removed = []
        for row in rows:
            request = self.requests[row]
            kv = self._kv.row_kv(row, slice(width - request.kv_len, width))
            removed.append((request, [(keys.clone(), values.clone()) for keys, values in kv]))
        kept = [request for row, request in enumerate(self.requests) if row not in rows]
        order = self._kv.remove(rows, max((request.kv_len for request in kept), default=0))
        self.requests = [self.requests[row] for row in order]
        return removed

    def clear(self) -> list[_Request]:
        """Drops every request's KV; returns the requests."""
        requests, self.requests = self.requests, []
        if self._kv is not None:
            self._kv.clear()
        return requests

    def decode(self) -> torch.Tensor:
        """Feeds every request its last token; returns the next-token logits, [rows, vocab]."""
        device = self._model.device
        self._kv.reserve(0, 1)
        width = self._kv.width
        kv_lens = torch.tensor([request.kv_len for request in self.requests], device=device)
        attention_mask = (
            torch.arange(width + 1, device=device)[None, :] >= (width - kv_lens)[:, None]
        )
        output = self._model(
            input_ids=torch.tensor([[r.token_ids[-1]] for r in self.requests], device=device),
            attention_mask=attention_mask,
            position_ids=kv_lens[:, None],
            cache=self._kv.cache,
            use_cache=True,
        )
        for request in self.requests:
            request.kv_len += 1
        return output.logits[:, -1, :].float()


def _common_prefix_len(sequences: list[list[int]]) -> int:
    """Length of the longest prefix of all the sequences: that of the least and the greatest."""
    first, last = min(sequences), max(sequences)
    return next(
        (i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), len(first)
    )


def _next_token(logits: torch.Tensor, request: _Request) -> int:
    """Picks the next token from one row of float32 logits under the request's sampling params:
    repetition penalty, then greedy argmax or temperature, top-k, top-p and min-p sampling."""
    sampling = request.sampling
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(request.token_ids, device=logits.device)
        scores = logits.gather(0, seen)
        penalized = torch.where(
            scores > 0, scores / sampling.repetition_penalty, scores * sampling.repetition_penalty
        )
        logits = logits.scatter(0, seen, penalized)
    if request.generator is None:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if 0 < sampling.top_k < probs.numel():
        probs = torch.where(probs >= probs.topk(sampling.top_k).values[-1], probs, 0.0)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest head whose mass reaches top_p: drop a token once the mass before it does.
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        probs = probs.scatter(0, order[mass_before >= sampling.top_p * probs.sum()], 0.0)
    if sampling.min_p > 0.0:
        probs = torch.where(probs >= sampling.min_p * probs.max(), probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=request.generator))


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome: object) -> None:
    """Sets `outcome` (an exception is raised to the awaiter) on a future of another thread's loop."""

    def settle() -> None:
        if future.done():  # the awaiter was cancelled
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    # A closed loop means nobody is awaiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)


def _outcome_of(command: Callable[[], object]) -> object:
    """The command's result, or the exception it raised (for its caller to see)."""
    try:
        return command()
    except Exception as error:
        return error


def _validate(
    input_ids: list[int], sampling: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    if not input_ids:
        raise InvalidArgumentError("input_ids is empty; a prompt needs at least one token")
    if len(input_ids) >= max_model_len:
        raise InvalidArgumentError(
            f"prompt of {len(input_ids)} tokens leaves no room under max_model_len={max_model_len}"
        )
    bad = [token for token in input_ids if not 0 <= token < vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"token ids {bad[:5]!r} are outside the vocabulary [0, {vocab_size})"
        )
    checks = {
        "max_new_tokens": sampling.max_new_tokens >= 1,
        "temperature": sampling.temperature >= 0,
        "top_p": 0 < sampling.top_p <= 1,
        "top_k": sampling.top_k >= 0,
        "min_p": 0 <= sampling.min_p <= 1,
        "repetition_penalty": sampling.repetition_penalty > 0,
    }
    for name, ok in checks.items():
        if not ok:
            raise InvalidArgumentError(f"bad sampling {name}={getattr(sampling, name)!r}")


def _load_model(options: HfEngineOptions) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        options.model_path, dtype=getattr(torch, options.dtype)
    )
    model = model.to(options.device).eval()
    layer_types = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    if layer_types != {DynamicLayer.__name__}:
        raise InvalidArgumentError(
            f"model {options.model_path!r} has cache layers {sorted(layer_types)!r}; the hf engine "
            "supports full-attention layers only (no sliding window or linear attention)"
        )
    return model


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """EOS ids from the model's config and generation config (the latter lists the chat
    template's end-of-turn token too, e.g. Qwen's <|im_end|>)."""
    ids: set[int] = set()
    for value in (model.config.eos_token_id, model.generation_config.eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


class HfEngine:
    """A transformers causal LM serving concurrent requests with continuous batching and a
    per-session KV cache. Build it with `await HfEngine.create(options)`.

    Logprobs are those of the raw model distribution, log_softmax of the unscaled float32
    logits, whatever the temperature, top-p or penalty that picked the token: that is what the
    trainer recomputes (verl and slime define the rollout logprob the same way), so the
    importance ratio is 1 when the weights have not changed.
    """

    def __init__(self, model: PreTrainedModel, options: HfEngineOptions):
        self._model = model
        self._options = options
        self._eos_token_ids = _eos_token_ids(model)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._seeds = random.Random(options.seed)
        self._policy_version = 0
        # The parameters' home once a weight push has laid them out as it travels.
        self._weight_buffer: BucketedWeights | None = None
        # Shared with the event loop, guarded by _lock.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._requests: dict[str, _Request] = {}
        self._incoming: list[_Request] = []
        self._abort_ids: set[str] = set()
        self._commands: list[
            tuple[Callable[[], object], asyncio.Future, asyncio.AbstractEventLoop]
        ] = []
        self._sessions = SessionKvStore(options.kv_cache_budget_bytes)
        self._closed = False  # no new requests or commands
        self._closing = False  # the worker ends everything and exits
        # Owned by the worker thread.
        self._waiting: deque[_Request] = deque()
        self._batch = _RunningBatch(model, options.max_batch_size, options.max_model_len)
        self._paused = False
        # Replies to send after this iteration's stats are published: (loop, future, outcome).
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, object]] = []
        self._counters = {
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "prefill_forwards": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_tokens": 0,
        }
        self._stats: dict[str, float] = {}
        self._publish_stats()
        self._worker = threading.Thread(target=self._work, name="hf-engine", daemon=True)
        self._worker.start()

    @classmethod
    async def create(cls, options: HfEngineOptions) -> Self:
        """Loads the model (in a thread) and starts the worker."""
        model = await asyncio.to_thread(_load_model, options)
        return cls(model, options)

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for the initial weights."""
        return self._policy_version

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str, session_id: str = ""
    ) -> GenerateOutput:
        """Samples a continuation of `input_ids` (see the `Engine` protocol). Raises
        InvalidArgumentError for an empty or too long prompt, an id outside the vocabulary or a
        bad sampling value; AlreadyExistsError when `request_id` is running; FailedPrecondition
        after close(). Cancelling the call aborts the request."""
        _validate(input_ids, sampling, self._vocab_size, self._options.max_model_len)
        loop = asyncio.get_running_loop()
        greedy = sampling.temperature == 0
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        request = _Request(
            request_id=request_id,
            session_id=session_id,
            sampling=sampling,
            stop_token_ids=self._eos_token_ids | frozenset(sampling.stop_token_ids),
            token_ids=list(input_ids),
            prompt_len=len(input_ids),
            generator=None if greedy else torch.Generator(self._model.device).manual_seed(seed),
            future=loop.create_future(),
            loop=loop,
        )
        with self._lock:
            if self._closed:
                raise FailedPreconditionError("the hf engine is closed")
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
        await self._call_in_worker(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        """Continues decoding after pause()."""
        await self._call_in_worker(lambda: setattr(self, "_paused", False))

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copies tensors into the model's parameters by name and takes `policy_version`.

        Runs between two decode steps (the caller pauses first). Every tensor is checked before
        any is copied: an unknown name or a wrong shape raises InvalidArgumentError naming the
        parameter, and the model is unchanged. On success every cached session KV is dropped,
        and running requests recompute their KV from their tokens under the new weights.
        """
        await self._call_in_worker(lambda: self._load_weights(list(named_tensors), policy_version))

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """The parameters, moved into one buffer laid out as this update travels (a copy, the
        first time a layout is asked for; the engine must be paused), so that a broadcast
        received into it is the load. None when an update tensor's dtype differs from its
        parameter's or two names share a parameter (tied embeddings sent twice). Raises
        InvalidArgumentError as check_weights does."""
        return await self._call_in_worker(
            lambda: self._lay_out_parameters(list(metas), bucket_size_bytes)
        )

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor the model has no parameter
        for, or whose parameter has another shape."""
        self._check_shapes((meta.name, meta.shape) for meta in metas)

    def _check_shapes(
        self, shapes: Iterable[tuple[str, tuple[int, ...]]]
    ) -> dict[str, torch.nn.Parameter]:
        """The model's parameters by name, once every (name, shape) is checked against them."""
        parameters = dict(self._model.named_parameters(remove_duplicate=False))
        for name, shape in shapes:
            if name not in parameters:
                raise InvalidArgumentError(
                    f"unknown parameter {name!r}; the model has no such name"
                )
            if tuple(shape) != tuple(parameters[name].shape):
                raise InvalidArgumentError(
                    f"parameter {name!r} has shape {tuple(parameters[name].shape)}, "
                    f"got {tuple(shape)}"
                )
        return parameters

    def stats(self) -> dict[str, float]:
        """running, waiting, paused (0/1), policy_version, cached_sessions, session_kv_bytes,
        running_kv_bytes (allocated), session_evictions, and the running totals
        tokens_generated, prefill_tokens (computed), prefill_forwards, prefix_cache_hits and
        prefix_cache_hit_tokens (reused)."""
        with self._lock:
            return {
                **self._stats,
                "waiting": self._stats["waiting"] + len(self._incoming),
                "cached_sessions": len(self._sessions),
                "session_kv_bytes": self._sessions.nbytes,
                "session_evictions": self._sessions.evictions,
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

    def _work(self) -> None:
        try:
            with torch.no_grad():
                while self._iterate():
                    pass
        except Exception as error:  # a bug: every caller hears of it instead of hanging
            logger.exception("hf engine worker failed")
            self._finish_all(error)
            self._flush()

    def _has_work(self) -> bool:
        if self._commands or self._abort_ids or self._closing:
            return True
        return not self._paused and bool(self._incoming or self._waiting or self._batch.requests)

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
        if closing:
            self._finish_all(FinishReason.ABORT)
        elif not self._paused:
            self._admit()
            if self._batch.requests:
                self._decode_step()
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
        rows = [row for row, r in enumerate(self._batch.requests) if r.request_id in abort_ids]
        for request, kv in self._batch.remove(rows):
            self._finish(request, FinishReason.ABORT, kv)

    def _admit(self) -> None:
        """Prefills the next waiting requests, first come first served, as many as fit in the
        free batch slots and in max_prefill_tokens together, and adds them to the batch."""
        admitted: list[_Request] = []
        longest = 0  # the most tokens one of them computes
        while (
            self._waiting
            and len(self._batch.requests) + len(admitted) < self._options.max_batch_size
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
            kvs = self._prefill(admitted)
        except Exception as error:  # e.g. out of memory on long prompts: fail these only
            logger.exception("prefill of %d requests failed", len(admitted))
            for request in admitted:
                self._finish(request, error, None)
            return
        self._batch.extend(list(zip(admitted, kvs, strict=True)))

    def _prefill(self, requests: list[_Request]) -> list[Kv | None]:
        """Computes the KV of each request's tokens but the last, after the session KV it
        reuses, in one forward; returns each one's KV (None: no tokens before its last). The
        decode step feeds the last token and samples the first new one from its logits."""
        self._share_prompt_prefix(requests)
        kvs = [request.reused_kv for request in requests]
        for request in requests:
            computed = len(request.token_ids) - request.kv_len  # the last token's included
            request.computed_prompt_tokens += computed
            self._counters["prefill_tokens"] += computed
            request.reused_kv = None
        rows = [row for row, r in enumerate(requests) if r.kv_len < len(r.token_ids) - 1]
        if rows:
            computed_kvs = self._prefill_forward(
                [kvs[row] for row in rows],
                [requests[row].token_ids[requests[row].kv_len : -1] for row in rows],
            )
            for row, kv in zip(rows, computed_kvs, strict=True):
                kvs[row] = kv
        for request in requests:
            request.kv_len = len(request.token_ids) - 1
        return kvs

    def _prefill_forward(self, past_kvs: list[Kv | None], new_ids: list[list[int]]) -> list[Kv]:
        """Runs `new_ids[i]` after the KV `past_kvs[i]` (None: none) for every row i in one
        forward; returns each row's KV, past and new, as views of one batch cache.

        Row i holds its past left-padded to the longest past and its new tokens right-padded,
        so its KV is one run of columns; the right padding is invisible to it (causal)."""
        device = self._model.device
        past_lens = [kv[0][0].shape[-2] if kv else 0 for kv in past_kvs]
        new_lens = [len(ids) for ids in new_ids]
        past_width, new_width = max(past_lens), max(new_lens)
        cache = BatchKv(self._batch.kv_layout(), len(new_ids), past_width + new_width)
        cache.reserve(past_width, new_width)
        cache.append(past_kvs)
        past = torch.tensor(past_lens, device=device)[:, None]
        is_new = (
            torch.arange(new_width, device=device)[None, :]
            < torch.tensor(new_lens, device=device)[:, None]
        )
        is_past = torch.arange(past_width, device=device)[None, :] >= past_width - past
        # Padding gets position 0, a position every model has.
        position_ids = torch.where(is_new, past + torch.arange(new_width, device=device), 0)
        self._model(
            input_ids=torch.tensor(
                [ids + [0] * (new_width - len(ids)) for ids in new_ids], device=device
            ),
            attention_mask=torch.cat([is_past, is_new], dim=1),
            position_ids=position_ids,
            cache=cache.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._counters["prefill_forwards"] += 1
        return [
            cache.row_kv(row, slice(past_width - past_len, past_width + new_len))
            for row, (past_len, new_len) in enumerate(zip(past_lens, new_lens, strict=True))
        ]

    def _share_prompt_prefix(self, requests: list[_Request]) -> None:
        """Computes once, in a forward of its own, the prefix that the prompts of the requests
        without reused KV all share (a system prompt), and hands each its KV as if cached: a
        prefix's KV is the same whoever computes it (up to float rounding). A prefix shorter
        than MIN_SHARED_PREFIX_TOKENS is left to the batched forward."""
        fresh = [request for request in requests if request.kv_len == 0]
        if len(fresh) < 2:
            return
        shared = min(
            _common_prefix_len([request.token_ids for request in fresh]),
            *(len(request.token_ids) - 1 for request in fresh),
        )
        if shared < MIN_SHARED_PREFIX_TOKENS:
            return
        (kv,) = self._prefill_forward([None], [fresh[0].token_ids[:shared]])
        self._counters["prefill_tokens"] += shared
        for request in fresh:
            request.reused_kv = kv
            request.kv_len = request.cached_prompt_tokens = shared

    def _take_session_kv(self, request: _Request) -> None:
        """Reuses the session's KV over the longest common prefix with this request's tokens,
        leaving at least one token to compute (its logits pick the first new token)."""
        with self._lock:
            entry = self._sessions.pop(request.session_id)
        if entry is None:
            return
        limit = min(len(entry.token_ids), len(request.token_ids) - 1)
        reused = next(
            (i for i in range(limit) if entry.token_ids[i] != request.token_ids[i]), limit
        )
        if reused == 0:
            return
        request.reused_kv = [
            (keys[:, :, :reused], values[:, :, :reused]) for keys, values in entry.kv
        ]
        request.kv_len = request.cached_prompt_tokens = reused
        self._counters["prefix_cache_hits"] += 1
        self._counters["prefix_cache_hit_tokens"] += reused

    def _decode_step(self) -> None:
        requests = list(self._batch.requests)
        try:
            logits = self._batch.decode()
        except Exception as error:  # e.g. out of memory: fail the batch, keep serving
            logger.exception("decode step failed")
            self._batch.clear()
            for request in requests:
                self._finish(request, error, None)
            return
        self._sample(requests, logits)
        done = [(row, self._finish_reason(r)) for row, r in enumerate(requests)]
        done = [(row, reason) for row, reason in done if reason is not None]
        removed = self._batch.remove([row for row, _ in done])
        for (request, kv), (_, reason) in zip(removed, done, strict=True):
            self._finish(request, reason, kv)

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> None:
        """Appends one token per request (row of `logits`) with its raw-distribution logprob."""
        tokens = [_next_token(row, request) for row, request in zip(logits, requests, strict=True)]
        index = torch.tensor(tokens, device=logits.device)[:, None]
        logprobs = logits.log_softmax(-1).gather(1, index)[:, 0].tolist()
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            request.token_ids.append(token)
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.policy_versions.append(self._policy_version)
        self._counters["tokens_generated"] += len(tokens)

    def _finish_reason(self, request: _Request) -> FinishReason | None:
        if request.output_ids[-1] in request.stop_token_ids:
            return FinishReason.STOP
        if (
            len(request.output_ids) >= request.sampling.max_new_tokens
            or len(request.token_ids) >= self._options.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _finish(self, request: _Request, outcome: FinishReason | Exception, kv: Kv | None) -> None:
        """Hands the request's result (or error) to its caller and keeps its session's KV."""
        with self._lock:
            self._requests.pop(request.request_id, None)
            if kv is not None and request.session_id and not isinstance(outcome, Exception):
                self._sessions.put(request.session_id, request.token_ids[: request.kv_len], kv)
        if isinstance(outcome, Exception):
            self._outbox.append((request.loop, request.future, outcome))
            return
        result = GenerateOutput(
            output_ids=request.output_ids,
            logprobs=request.logprobs,
            policy_versions=request.policy_versions,
            finish_reason=outcome,
            metrics={
                "prompt_tokens": request.prompt_len,
                "cached_prompt_tokens": request.cached_prompt_tokens,
                "computed_prompt_tokens": request.computed_prompt_tokens,
                "latency_seconds": time.monotonic() - request.submitted_at,
            },
        )
        self._outbox.append((request.loop, request.future, result))

    def _finish_all(self, outcome: FinishReason | Exception) -> None:
        """Ends every request and command (at close, or when the worker broke)."""
        with self._lock:
            self._closed = True
            commands, self._commands = self._commands, []
            self._waiting.extend(self._incoming)
            self._incoming = []
            self._sessions.clear()
        for _, future, loop in commands:
            self._outbox.append((loop, future, FailedPreconditionError("the hf engine is closed")))
        for request in [*self._batch.clear(), *self._waiting]:
            self._finish(request, outcome, None)
        self._waiting.clear()

    def _lay_out_parameters(
        self, metas: list[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        current = self._weight_buffer
        if current is not None and current.matches(metas, bucket_size_bytes):
            return current
        parameters = self._check_shapes((meta.name, meta.shape) for meta in metas)
        targets = [parameters[meta.name] for meta in metas]
        if not targets or len({id(p) for p in targets}) < len(targets):
            return None
        if any(p.dtype != meta.dtype for p, meta in zip(targets, metas, strict=True)):
            return None
        layout = BucketedWeights(metas, bucket_size_bytes, device=targets[0].device)
        for index, parameter in enumerate(targets):
            place = layout.tensor(index)
            place.copy_(parameter)
            parameter.data = place
        self._weight_buffer = layout
        return layout

    def _load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        parameters = self._check_shapes((name, tuple(t.shape)) for name, t in named_tensors)
        for name, tensor in named_tensors:
            if tensor.data_ptr() != parameters[name].data_ptr():  # else received in place
                parameters[name].copy_(tensor)
        self._policy_version = policy_version
        with self._lock:
            self._sessions.clear()
        # Their KV came from the old weights: recompute it from their tokens, first in line.
        self._waiting.extendleft(reversed(self._batch.clear()))
        for request in self._waiting:
            request.kv_len, request.reused_kv = 0, None

    def _publish_stats(self) -> None:
        with self._lock:
            self._stats = {
                "running": len(self._batch.requests),
                "waiting": len(self._waiting),
                "paused": float(self._paused),
                "policy_version": self._policy_version,
                "running_kv_bytes": self._batch.kv_bytes(),
                **self._counters,
            }
