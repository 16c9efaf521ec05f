"""Receiving new policy weights: bucketed broadcasts over a torch.distributed group joined
with the trainer's rank 0 (gloo on CPU, NCCL on GPU), or a gRPC stream of chunks.

The group is a process group of its own (`turnrl.weight_group`, formed as SGLang forms its),
not the default `init_process_group` one, so an engine that uses torch.distributed itself is
unaffected. Collective calls block, so they run in a worker thread, never on the event loop.
"""

import asyncio
import datetime
from collections.abc import AsyncIterator

import torch
import torch.distributed as dist

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.weight_group import BACKENDS, broadcast, form_group, join_store, leave_group
from turnrl.weights import BucketedWeights, TensorMeta


class WeightReceiver:
    """This replica's membership of the weight-sync group; one rank per replica."""

    def __init__(self) -> None:
        self._device = "cpu"  # where staged updates land: NCCL's collectives need CUDA memory
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        # Receives updates that have no place of their own, kept from push to push: fresh
        # memory costs a page fault per 4 KiB.
        self._staging = torch.empty(0, dtype=torch.uint8)

    async def join(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> None:
        """Joins the group as `rank`, leaving the one it was in. Raises InvalidArgumentError for
        bad ranks or backend, TimeoutError when the others do not join within
        `timeout_seconds`."""
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"backend {backend!r} is not one of {list(BACKENDS)}")
        if not 0 < rank < world_size:
            raise InvalidArgumentError(
                f"rank {rank} must be in 1..{world_size - 1} (rank 0 is the trainer)"
            )
        timeout = datetime.timedelta(seconds=timeout_seconds)

        def connect() -> dist.ProcessGroup:
            store = join_store(master_address, master_port, world_size, timeout)
            return form_group(store, rank, world_size, backend, group_name, timeout)

        # The trainer formed a new group (its replicas changed, or it was restarted).
        self.leave()
        try:
            self._group = await asyncio.to_thread(connect)
        except RuntimeError as e:
            raise TimeoutError(
                f"could not join weight-sync group {group_name!r} at "
                f"{master_address}:{master_port} within {timeout_seconds:g}s: {e}"
            ) from e
        self._group_name = group_name
        self._device = "cuda" if backend == "nccl" else "cpu"

    def leave(self) -> None:
        """Leaves the group this replica is in, if any."""
        if self._group is not None:
            leave_group(self._group)
            self._group = None

    def receive(
        self,
        group_name: str,
        metas: list[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        into: BucketedWeights | None = None,
    ) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        """Receives one update broadcast by rank 0 in `layout` (turnrl.weights.LAYOUTS) and
        yields it bucket by bucket, in `metas` order: each bucket as soon as it has arrived,
        while the next one is received, so that loading one overlaps receiving the next.

        The update lands in `into` (an engine's own parameters, laid out for this update) or,
        without it, in a staging buffer that the next update overwrites: load (copy) those
        tensors before receiving again. A caller that stops early still receives the rest
        (unyielded), so the trainer's broadcast completes.

        Raises at once, before anything lands: FailedPreconditionError without a group of
        that name, ValueError when `into` is laid out for another update. While receiving:
        FailedPreconditionError when the broadcast breaks off (the sender went away, the group
        timed out), naming how many buckets had landed.
        """
        if self._group is None or group_name != self._group_name:
            raise FailedPreconditionError(
                f"no weight-sync group {group_name!r}; call InitWeightSync first"
            )
        if into is None:
            into = BucketedWeights(
                metas, bucket_size_bytes, device=self._device, reuse=self._staging
            )
            if into.data.numel() > self._staging.numel():
                self._staging = into.data
        elif not into.matches(metas, bucket_size_bytes):
            raise ValueError("`into` is laid out for another update")
        return self._receive_buckets(self._group, into, layout)

    async def _receive_buckets(
        self, group: dist.ProcessGroup, into: BucketedWeights, layout: str
    ) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[int | None] = asyncio.Queue()  # None: the broadcast failed
        group_name, count = self._group_name, len(into.buckets)

        def receive_all() -> None:
            """Receives the buckets in turn (in a worker thread), announcing each as it lands:
            the next one is posted at once, not when the event loop gets round to it."""
            index = 0
            try:
                for index in range(count):
                    pieces = into.broadcast_pieces(index, layout)
                    for piece in pieces:
                        broadcast(group, piece)
                    if layout == "flattened_buckets":
                        into.unflatten(index, pieces)
                    loop.call_soon_threadsafe(arrived.put_nowait, index)
            except RuntimeError as e:  # torch's DistBackendError: a peer left, a timeout
                loop.call_soon_threadsafe(arrived.put_nowait, None)
                raise FailedPreconditionError(
                    f"the weight broadcast on group {group_name!r} broke off after {index} of "
                    f"{count} buckets: {e}"
                ) from e
            except BaseException:
                loop.call_soon_threadsafe(arrived.put_nowait, None)
                raise

        receiving = asyncio.ensure_future(asyncio.to_thread(receive_all))
        try:
            for _ in into.buckets:
                index = await arrived.get()
                if index is None:
                    break
                yield into.named_tensors(index)
        finally:
            await receiving  # the whole update, also for a caller that stopped; or its failure


class ChunkAssembler:
    """Rebuilds tensors from the PushWeights stream: a header of specs, then byte chunks."""

    def __init__(self, metas: list[TensorMeta]) -> None:
        self._metas = metas
        self._buffers = [bytearray() for _ in metas]
        self.bytes_received = 0

    def add(self, tensor_index: int, offset_bytes: int, data: bytes) -> None:
        """Appends a chunk. Raises InvalidArgumentError for an unknown index, a chunk out of
        order, or bytes past the tensor's end."""
        if not 0 <= tensor_index < len(self._metas):
            raise InvalidArgumentError(
                f"chunk for tensor {tensor_index}; the header has {len(self._metas)} tensors"
            )
        buffer, meta = self._buffers[tensor_index], self._metas[tensor_index]
        if offset_bytes != len(buffer):
            raise InvalidArgumentError(
                f"tensor {meta.name!r}: chunk at byte {offset_bytes}, expected {len(buffer)}"
            )
        if len(buffer) + len(data) > meta.nbytes:
            raise InvalidArgumentError(
                f"tensor {meta.name!r}: chunks exceed its {meta.nbytes} bytes"
            )
        buffer += data
        self.bytes_received += len(data)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The complete tensors. Raises InvalidArgumentError when one is short of bytes."""
        result = []
        for meta, buffer in zip(self._metas, self._buffers, strict=True):
            if len(buffer) != meta.nbytes:
                raise InvalidArgumentError(
                    f"tensor {meta.name!r}: got {len(buffer)} of its {meta.nbytes} bytes"
                )
            tensor = torch.empty(meta.shape, dtype=meta.dtype)
            if buffer:
                tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(buffer, dtype=torch.uint8))
            result.append((meta.name, tensor))
        return result
