"""The trainer's end of weight sync (DESIGN "Weight sync"): rank 0 pushes the policy to every
rollout replica.

`WeightPusher.connect` forms the weight-sync group (`turnrl.weight_group`, as SGLang forms
its): this process hosts the group's TCPStore and joins as rank 0 while each replica joins
through InitWeightSync with the ranks it asks for (GetStats' `weight_sync_ranks`: one for an hf
replica, an SGLang server's tensor-parallel size), in order. `push` pauses every replica, sends
one update, and resumes them, also when the push fails. An update is `BucketedWeights`, the
tensors laid out as they travel: one broadcast per bucket, straight from its memory as soon
as `BucketedWeights.pack` has copied it in (the copy of the next bucket runs meanwhile),
or one per tensor when a member receives only that (an SGLang server), while every replica's
UpdateWeights call receives it; when no group could be formed, a PushWeights stream of chunks
to each replica.

A LoRA adapter (`push(..., adapter=...)`, `trainer.lora.push: adapter`) always goes as a
PushWeights stream, even where a group formed: it is megabytes, not gigabytes, so a stream
costs next to nothing, and every engine loads it the same way (an SGLang or vLLM server loads
an adapter from a folder, which the rollout service writes; broadcasting to its ranks would gain
nothing).

Collectives block, so they run in a worker thread. A failed broadcast leaves the ranks out of
step: the group is dropped and later pushes go over gRPC.
"""

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
import torch.distributed as dist
from google.protobuf import duration_pb2

from trainer_svc.config import WeightSyncConfig
from turnrl import errors
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc
from turnrl.weight_group import broadcast, form_group, host_store, leave_group
from turnrl.weights import LAYOUTS, BucketedWeights, LoraAdapter

log = logging.getLogger(__name__)

BACKENDS = {
    "gloo": rollout_pb2.InitWeightSyncRequest.BACKEND_GLOO,
    "nccl": rollout_pb2.InitWeightSyncRequest.BACKEND_NCCL,
}
# PushWeights chunk size: well under the channels' 64 MiB message limit.
CHUNK_SIZE_BYTES = 4 * 1024 * 1024
# Deadline of Pause and Resume; Pause returns at the engine's next decode step.
CONTROL_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class PushResult:
    """What one push moved, and how long it took from Pause to Resume."""

    total_bytes: int
    seconds: float
    policy_versions: list[int]  # each replica's version after the push, in stub order
    mode: Literal["broadcast", "grpc"]

    @property
    def gib_per_second(self) -> float:
        return self.total_bytes / 2**30 / self.seconds


class WeightPusher:
    """Rank 0 of the weight-sync group with a fixed list of rollout replicas. Build it with
    `await WeightPusher.connect(stubs, ...)`; `mode` says how pushes travel."""

    def __init__(
        self, stubs: Sequence[rollout_pb2_grpc.RolloutServiceStub], device: torch.device
    ) -> None:
        self._stubs = list(stubs)
        self._device = device
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._layout = "aligned_buckets"  # the group's: `group_layout`

    @property
    def mode(self) -> Literal["broadcast", "grpc"]:
        return "grpc" if self._group is None else "broadcast"

    @classmethod
    async def connect(
        cls,
        rollout_stubs: Sequence[rollout_pb2_grpc.RolloutServiceStub],
        *,
        backend: Literal["gloo", "nccl"] = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "turnrl-weights",
        timeout_seconds: float = WeightSyncConfig().timeout_seconds,
        mode: Literal["broadcast", "grpc"] = "broadcast",
    ) -> Self:
        """Forms the group with every replica (`mode="grpc"` skips it); `master_port` 0 picks
        a free port. When the group cannot be formed within `timeout_seconds` (a replica's
        error, a timeout), logs why and pushes over gRPC; that takes up to the whole timeout.

        `timeout_seconds` (the run's `weight_sync.timeout_seconds`) is the group's timeout at
        every member: this process's store and rank, and each replica's ranks, which
        InitWeightSync gives it. It bounds the group's forming and each of its broadcasts."""
        if backend not in BACKENDS:
            raise errors.InvalidArgumentError(f"backend {backend!r} is not one of {list(BACKENDS)}")
        if mode not in ("broadcast", "grpc"):
            raise errors.InvalidArgumentError(f"mode {mode!r} is not 'broadcast' or 'grpc'")
        if not rollout_stubs:
            raise errors.InvalidArgumentError("no rollout replicas to push weights to")
        pusher = cls(rollout_stubs, push_device(backend))
        if mode == "broadcast":
            try:
                pusher._group, pusher._layout = await pusher._form_group(
                    backend, master_address, master_port, group_name, timeout_seconds
                )
                pusher._group_name = group_name
            except (RuntimeError, errors.TurnrlError) as e:
                log.warning("no weight-sync group (%s); pushing weights as gRPC streams", e)
        return pusher

    async def push(
        self,
        weights: BucketedWeights,
        policy_version: int,
        *,
        adapter: LoraAdapter | None = None,
        timeout_seconds: float = 300.0,
    ) -> PushResult:
        """Pauses every replica, sends `weights` (build them with `BucketedWeights.pack`, in
        bfloat16 to halve the bytes, float32 to keep them exact; the replicas are paused once
        pack has copied the first bucket in, and each bucket goes as soon as it is in), checks
        that every replica took `policy_version`, and resumes them. With `adapter`, `weights`
        are a LoRA adapter under peft's saved names that replaces each replica's, sent as a
        PushWeights stream (module docstring). Returns, or raises, once
        pack has read the tensors it packs. Raises
        FailedPreconditionError, before sending anything, when `policy_version` is not newer
        than a replica's; a replica's error as the turnrl error of its status code, naming the
        replica."""
        # Nothing can be sent before the first bucket is in: it is copied before the pause.
        await asyncio.to_thread(weights.wait_packed, 0)
        started = time.perf_counter()
        try:
            paused = await _all(
                stub.Pause(rollout_pb2.PauseRequest(), timeout=CONTROL_TIMEOUT_SECONDS)
                for stub in self._stubs
            )
            for index, reply in enumerate(paused):
                if policy_version <= reply.policy_version:
                    raise errors.FailedPreconditionError(
                        f"policy_version {policy_version} is not newer than rollout replica "
                        f"{index}'s {reply.policy_version}; nothing was sent"
                    )
            if adapter is not None:
                replies = await self._stream(weights, policy_version, timeout_seconds, adapter)
            elif self._group is None:
                replies = await self._stream(weights, policy_version, timeout_seconds)
            else:
                replies = await self._broadcast(weights, policy_version, timeout_seconds)
        finally:
            resume_failure = await self._resume_all()
            # A push that failed before sending every bucket: pack may still be copying. (A
            # copy that failed has failed the push already.)
            with contextlib.suppress(RuntimeError):
                await asyncio.to_thread(weights.wait_packed)
        if resume_failure is not None:
            raise resume_failure
        versions = [reply.policy_version for reply in replies]
        if versions != [policy_version] * len(versions):
            raise errors.TurnrlError(
                f"rollout replicas report policy_version {versions} after pushing {policy_version}"
            )
        seconds = time.perf_counter() - started
        mode = "grpc" if adapter is not None else self.mode
        return PushResult(weights.nbytes, seconds, versions, mode)

    def close(self) -> None:
        """Leaves the group. Replicas keep their end until they join another group."""
        if self._group is not None:
            leave_group(self._group)
            self._group = None

    async def _form_group(
        self, backend: str, address: str, port: int, group_name: str, timeout_seconds: float
    ) -> tuple[dist.ProcessGroup, str]:
        """Hosts the store and joins as rank 0 while every replica joins with the ranks it
        asks for (GetStats' weight_sync_ranks: an SGLang server's tensor-parallel ranks);
        returns the group and the layout updates travel in (`group_layout`)."""
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        stats = await _all(
            stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=CONTROL_TIMEOUT_SECONDS)
            for stub in self._stubs
        )
        ranks = [reply.weight_sync_ranks or 1 for reply in stats]
        world_size = 1 + sum(ranks)
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = await asyncio.to_thread(host_store, address, port, world_size, timeout)
        join_timeout = duration_pb2.Duration()
        join_timeout.FromTimedelta(timeout)
        requests = [
            rollout_pb2.InitWeightSyncRequest(
                master_address=address, master_port=store.port, world_size=world_size,
                rank_offset=1 + sum(ranks[:index]), backend=BACKENDS[backend],
                group_name=group_name, timeout=join_timeout,
            )
            for index in range(len(self._stubs))
        ]  # fmt: skip
        # A little longer than the group's timeout, so that a replica reports its own.
        calls = [
            stub.InitWeightSync(request, timeout=timeout_seconds + 5)
            for stub, request in zip(self._stubs, requests, strict=True)
        ]
        joining = asyncio.to_thread(form_group, store, 0, world_size, backend, group_name, timeout)
        group, *results = await asyncio.gather(joining, *calls, return_exceptions=True)
        try:
            replies = _replies(results)
            for index, reply in enumerate(replies):
                if reply.ranks_joined != ranks[index]:
                    raise RuntimeError(
                        f"rollout replica {index} joined with {reply.ranks_joined} ranks, not "
                        f"{ranks[index]}"
                    )
            if isinstance(group, BaseException):
                raise group
        except BaseException:
            # A group formed beside a replica that failed is left, not leaked: the replicas
            # leave their end when they join the next group.
            if isinstance(group, dist.ProcessGroup):
                leave_group(group)
            raise
        return group, group_layout([reply.layout for reply in replies])

    async def _broadcast(
        self, weights: BucketedWeights, policy_version: int, timeout_seconds: float
    ) -> list[rollout_pb2.UpdateWeightsResponse]:
        request = rollout_pb2.UpdateWeightsRequest(
            group_name=self._group_name,
            tensors=[meta.to_proto() for meta in weights.metas],
            bucket_size_bytes=weights.bucket_size_bytes,
            policy_version=policy_version,
            layout=LAYOUTS[self._layout],
        )
        # The replicas receive while rank 0 sends. Every call and the sender run to their end
        # (a replica that fails early leaves the sender waiting out the group's timeout), so
        # no thread is left broadcasting into the next push.
        calls = [stub.UpdateWeights(request, timeout=timeout_seconds) for stub in self._stubs]
        sending = asyncio.to_thread(self._send_buckets, weights)
        try:
            *results, sent = await asyncio.gather(*calls, sending, return_exceptions=True)
        except asyncio.CancelledError:
            self._drop_group("a push was cancelled during its broadcast")
            raise
        if isinstance(sent, BaseException):
            self._drop_group(f"a broadcast failed: {sent}")
        replies = _replies(results)
        if isinstance(sent, BaseException):
            raise sent
        return replies

    def _send_buckets(self, weights: BucketedWeights) -> None:
        """Broadcasts the buckets in order, each as soon as pack has copied it in, from where
        it lies, whole or tensor by tensor as the group's layout says (in a worker thread).
        Over NCCL each piece is copied to the GPU on a stream of its own, so that the copy of
        piece k + 1 runs while piece k is broadcast: on the sending stream it would wait for
        that broadcast, which `broadcast`'s wait puts before whatever that stream does next.
        (The NCCL path is untested on the CPU-only machines the tests run on.)"""
        pieces = (
            piece
            for index in range(len(weights.buckets))
            for piece in weights.broadcast_pieces(index, self._layout)
        )
        if self._device.type == "cpu":
            for piece in pieces:
                broadcast(self._group, piece)
            return
        copying = torch.cuda.Stream(self._device)
        sending = torch.cuda.current_stream(self._device)
        for piece in pieces:
            with torch.cuda.stream(copying):
                on_device = piece.to(self._device, non_blocking=True)
            sending.wait_stream(copying)
            # Made on the copying stream, read by the sending one: without this, the next
            # piece's copy could reuse its memory before NCCL has sent it.
            on_device.record_stream(sending)
            broadcast(self._group, on_device)

    async def _stream(
        self,
        weights: BucketedWeights,
        policy_version: int,
        timeout_seconds: float,
        adapter: LoraAdapter | None = None,
    ) -> list[rollout_pb2.PushWeightsResponse]:
        header = rollout_pb2.PushWeightsHeader(
            tensors=[meta.to_proto() for meta in weights.metas],
            policy_version=policy_version,
            lora_adapter=None if adapter is None else adapter.to_proto(),
        )
        await asyncio.to_thread(weights.wait_packed)  # the chunks are read on the event loop

        async def requests() -> AsyncIterator[rollout_pb2.PushWeightsRequest]:
            yield rollout_pb2.PushWeightsRequest(header=header)
            for index in range(len(weights.metas)):
                data = weights.tensor(index).view(-1).view(torch.uint8).cpu().numpy()
                for offset in range(0, data.size, CHUNK_SIZE_BYTES):
                    chunk = rollout_pb2.TensorChunk(
                        tensor_index=index,
                        offset_bytes=offset,
                        data=data[offset : offset + CHUNK_SIZE_BYTES].tobytes(),
                    )
                    yield rollout_pb2.PushWeightsRequest(chunk=chunk)

        return await _all(
            stub.PushWeights(requests(), timeout=timeout_seconds) for stub in self._stubs
        )

    async def _resume_all(self) -> BaseException | None:
        """Resumes every replica; logs each failure and returns the first, or None."""
        request = rollout_pb2.ResumeRequest()
        results = await asyncio.gather(
            *(stub.Resume(request, timeout=CONTROL_TIMEOUT_SECONDS) for stub in self._stubs),
            return_exceptions=True,
        )
        failures = [_replica_error(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
        for failure in failures:
            log.error("could not resume after a weight push: %s", failure)
        return failures[0] if failures else None

    def _drop_group(self, reason: str) -> None:
        log.warning("dropping the weight-sync group (%s); pushing as gRPC streams from now", reason)
        self.close()


def push_device(backend: str) -> torch.device:
    """Where rank 0 broadcasts from: CPU for gloo; for NCCL, this trainer rank's own GPU, the
    node's GPU of LOCAL_RANK, as `FsdpModel` picks it. Not plain "cuda": that is the calling
    thread's current device, cuda:0 in a fresh thread (collectives run in one), which may be a
    rollout server's GPU, and NCCL refuses two ranks of a group on one device."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", dist.get_node_local_rank(fallback_rank=0))


def group_layout(layouts: Sequence[int]) -> str:
    """The layout a group's updates travel in, given what each member receives best
    (InitWeightSyncResponse.layout): the one that all of them take. Per tensor when one member
    takes only that (every SGLang server does), flattened buckets when one takes those (hf
    replicas take every layout), else turnrl's aligned buckets."""
    for name in ("per_tensor", "flattened_buckets"):
        if LAYOUTS[name] in layouts:
            return name
    return "aligned_buckets"


async def _all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Awaits one call per replica, every one to its end; the replies, or the first failure."""
    return _replies(await asyncio.gather(*calls, return_exceptions=True))


def _replies(results: list[Any]) -> list[Any]:
    """The results of one call per replica; raises the first failure, as `_replica_error`."""
    for index, result in enumerate(results):
        if isinstance(result, errors.RpcError):
            raise _replica_error(index, result) from result
        if isinstance(result, BaseException):
            raise result
    return results


def _replica_error(index: int, error: BaseException) -> BaseException:
    """A replica's failed call as the same `errors.RpcError`, naming the replica."""
    if not isinstance(error, errors.RpcError):
        return error
    return type(error)(
        f"rollout replica {index}: {error.status}: {error.details}",
        method=error.method,
        address=error.address,
        status=error.status,
        details=error.details,
    )
