"""The engine interface: token ids in, token ids and their logprobs out.

An engine is given no text. The agent loop hands it the exact ids of the conversation so far
and keeps the ids it returns as they are (token-in, token-out), so the trainer trains on
precisely the tokens the policy sampled. It decodes text only to find stop strings, which end
a generation but cut nothing from its ids (`stop_strings.py`).
"""

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.images import LoadedImage
from turnrl.vision import ProcessedImage
from turnrl.weights import BucketedWeights, LoraAdapter, TensorMeta


@dataclass(frozen=True)
class EngineImage:
    """An image among a request's tokens: the index of its first token, its bytes (for an
    engine that processes images itself) and what turnrl's processor made of them (its
    patches, grid and token count, which the ids were expanded by)."""

    token_offset: int
    image: LoadedImage
    processed: ProcessedImage


@dataclass(frozen=True)
class SamplingParams:
    """How one model turn is sampled."""

    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Ids that end the turn (kept in the output), besides the engine's own EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # Text that ends the turn once the output spells it (OpenAI's `stop`); the ids that spell
    # it are kept in the output.
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


class FinishReason(enum.StrEnum):
    """Why one generation ended."""

    # A stop or EOS token was sampled (it is the last output id), or the last id completed a
    # stop string.
    STOP = "stop"
    LENGTH = "length"  # max_new_tokens was reached
    ABORT = "abort"  # abort() was called; the output holds the tokens sampled until then


@dataclass
class GenerateOutput:
    """The sampled ids, the logprob of each under the policy that sampled it, and that
    policy's version per token (a generation paused for a weight push spans two versions)."""

    output_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    metrics: dict[str, float] = field(default_factory=dict)


def check_prompt(input_ids: Sequence[int], max_model_len: int) -> None:
    """Raises InvalidArgumentError for an empty prompt or one that leaves no room for a token
    under `max_model_len`, the engine's context (the rollout config's, handed to the engine)."""
    if not input_ids:
        raise InvalidArgumentError("input_ids is empty; a prompt needs at least one token")
    if len(input_ids) >= max_model_len:
        raise InvalidArgumentError(
            f"prompt of {len(input_ids)} tokens leaves no room under max_model_len={max_model_len}"
        )


def broken_push_error(policy_version: int) -> FailedPreconditionError:
    """What generate raises while the weights are a mix of two versions: an update to
    `policy_version` broke off part-way (the sender died, a bucket failed, the group timed out).
    A complete update clears it; so does a restart, which loads the model afresh."""
    return FailedPreconditionError(
        f"weights incomplete after a broken push to version {policy_version}; push again "
        "(UpdateWeights or PushWeights) or restart the rollout service to reload its model"
    )


@runtime_checkable
class ServerHeldWeights(Protocol):
    """An engine whose weights live in a server of its own (SGLang): the server joins the
    trainer's weight-sync group with its own ranks and receives updates there, tensor by
    tensor (per_tensor) or in flattened buckets where the server takes them. Weights an engine
    holds in the service's process are received by the service (`rollout_svc.weight_sync`, in
    any layout) and loaded with `update_weights`."""

    weight_sync_ranks: int  # the ranks the server joins a group with
    weight_layout: str  # the layout it receives best (turnrl.weights.LAYOUTS)

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
        """Has the server join the group with ranks `rank_offset` onwards, leaving the group it
        was in; returns once every rank joined."""

    async def receive_weights(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has the server receive one update broadcast on the group in `layout` (engine
        paused by the caller) and take `policy_version`."""


class Engine(Protocol):
    """An inference engine serving many concurrent requests."""

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for the initial weights."""

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
        """Samples a continuation of `input_ids`. Requests of one `session_id` (one trajectory)
        extend each other; an engine may keep the session's KV cache between them and
        recompute only the new suffix. A prompt that `check_prompt` refuses is refused.
        `images` are the images among `input_ids`, in order (a vision-language model's); an
        engine that cannot take them refuses them with InvalidArgumentError.

        `on_tokens` is called on the caller's event loop with each run of newly sampled ids,
        before generate returns: the runs, joined in order, are the output's `output_ids`.
        The hf engine calls it per decode step (one id); the server engines (SGLang, vLLM)
        do not stream from their servers and call it once, with the whole output, when the
        request returns."""

    async def abort(self, request_id: str) -> None:
        """Ends a running request early: its generate() returns with FinishReason.ABORT."""

    async def end_session(self, session_id: str) -> None:
        """Frees what the engine keeps for a session (its KV cache)."""

    async def pause(self) -> None:
        """Stops decoding at the next step; running requests keep their tokens and wait."""

    async def resume(self) -> None:
        """Continues decoding after pause()."""

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError when update_weights would refuse these tensors (a name
        the model lacks, another shape), before any is sent."""

    @property
    def broken_push_version(self) -> int | None:
        """The version of a weight update that began and did not complete before the engine
        resumed (it broke off part-way), so the weights are a mix of two versions; None while
        they are one, or while an update is under way (paused). While set, generate raises
        `broken_push_error`, also for the requests that were in flight."""

    async def begin_weight_update(self, policy_version: int) -> None:
        """Marks the weights incomplete before an update to `policy_version` starts to land in
        them (engine paused by the caller); update_weights ends the mark when it takes that
        version or a newer one, and an engine resumed before that is `broken_push_version`."""

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """The engine's own parameters laid out as this update travels (engine paused by the
        caller), so that receiving the broadcast into it loads the weights with no copy; None
        where the engine cannot keep them that way (another dtype, a parameter named twice)."""

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Loads new weights (engine paused by the caller) and takes `policy_version`. An
        update may come in several calls, one per bucket as it arrives, after
        begin_weight_update: all but the last pass the version loaded now, the last the new
        one. Tensors that are views of `weight_buffer` are in place already."""

    @property
    def lora_adapters_refusal(self) -> str:
        """Why the engine does not load LoRA adapters (load_lora_adapter), with how to make it;
        empty when it does."""

    async def load_lora_adapter(
        self,
        adapter: LoraAdapter,
        named_tensors: list[tuple[str, torch.Tensor]],
        policy_version: int,
    ) -> None:
        """Applies `named_tensors`, a LoRA adapter under peft's saved names, in place of the
        adapter applied so far (engine paused by the caller), with the base weights unchanged,
        and takes `policy_version`; running requests recompute their KV as after
        update_weights. Raises FailedPreconditionError for an adapter of another rank, alpha
        or target modules than the engine can apply, InvalidArgumentError for a tensor that is
        no adapter tensor of the model, or a set that leaves one out."""

    async def watch(self) -> None:
        """Waits while the engine can serve; raises UnavailableError, with the cause, once it
        cannot (its worker broke, its server process exited), so the service stops and is
        restarted instead of refusing every request while reporting itself healthy."""

    def stats(self) -> dict[str, float]:
        """Current engine metrics: running requests, queued requests, KV cache use, ..."""

    async def close(self) -> None:
        """Stops the engine and frees its memory."""
