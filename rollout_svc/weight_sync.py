"""Receiving new policy weights: bucketed broadcasts over a torch.distributed group joined
with the trainer's rank 0 (gloo on CPU, NCCL on GPU), or a gRPC stream of chunks.

The group is a process group of its own on a separate TCPStore, not the default
`init_process_group` one, so an engine that uses torch.distributed itself is unaffected.
Collective calls block, so they run in a worker thread, never on the event loop.
"""

import asyncio
import datetime
from collections.abc import AsyncIterator

import torch
import torch.distributed as dist

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.weights import TensorMeta, plan_buckets, unpack

BACKENDS = ("gloo", "nccl")


class WeightReceiver:
    """This replica's membership of the weight-sync group; one rank per replica."""

    def __init__(self, device: str = "cpu") -> None:
        self._device = device
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        # Holds one update's buckets from push to push: fresh memory costs a page fault per 4 KiB.
        self._staging = torch.empty(0, dtype=torch.uint8, device=device)

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
        """Joins the group as `rank`. Raises InvalidArgumentError for bad ranks or backend,
        TimeoutError when the others do not join within `timeout_seconds`."""
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"backend {backend!r} is not one of {list(BACKENDS)}")
        if not 0 < rank < world_size:
            raise InvalidArgumentError(
                f"rank {rank} must be in 1..{world_size - 1} (rank 0 is the trainer)"
            )
        timeout = datetime.timedelta(seconds=timeout_seconds)

        def connect() -> dist.ProcessGroup:
            store = dist.TCPStore(master_address, master_port, world_size, False, timeout)
            if backend == "gloo":
                return dist.ProcessGroupGloo(store, rank, world_size, timeout)
            return dist.ProcessGroupNCCL(store, rank, world_size)

        try:
            self._group = await asyncio.to_thread(connect)
        except RuntimeError as e:
            raise TimeoutError(
                f"could not join weight-sync group {group_name!r} at "
                f"{master_address}:{master_port} within {timeout_seconds:g}s: {e}"
            ) from e
        self._group_name = group_name

    async def receive(
        self, group_name: str, metas: list[TensorMeta], bucket_size_bytes: int
    ) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        """Receives one update broadcast by rank 0 and yields it bucket by bucket, in `metas`
        order: each bucket as soon as it has arrived, while the next one is received, so that
        loading one overlaps receiving the next. The tensors are views of a staging buffer
        that the next update overwrites: load (copy) them before receiving again. A caller that
        stops early still receives the rest (unyielded), so the trainer's broadcast completes.
        """
        if self._group is None or group_name != self._group_name:
            raise FailedPreconditionError(
                f"no weight-sync group {group_name!r}; call InitWeightSync first"
            )
        if bucket_size_bytes <= 0:
            raise InvalidArgumentError(
                f"bucket_size_bytes must be positive, got {bucket_size_bytes}"
            )
        group = self._group
        buckets = [[metas[i] for i in bucket] for bucket in plan_buckets(metas, bucket_size_bytes)]
        sizes = [sum(meta.nbytes for meta in bucket) for bucket in buckets]
        # Every bucket starts 64-byte aligned, as a fresh buffer would, so its dtype views work.
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // 64) * 64)
        if self._staging.numel() < starts[-1]:
            self._staging = torch.empty(starts[-1], dtype=torch.uint8, device=self._device)
        flats = [
            self._staging[start : start + size]
            for start, size in zip(starts[:-1], sizes, strict=True)
        ]

        def receive(index: int) -> asyncio.Future | None:
            """Starts receiving bucket `index` in a worker thread; None past the last."""
            if index == len(flats):
                return None
            return asyncio.ensure_future(
                asyncio.to_thread(_broadcast_from_trainer, group, flats[index])
            )

        index, receiving = 0, receive(0)
        try:
            for index, bucket in enumerate(buckets):
                # Taken off `receiving` first: a broadcast that fails leaves nothing to drain.
                current, receiving = receiving, None
                await current
                receiving = receive(index + 1)
                yield list(zip((m.name for m in bucket), unpack(flats[index], bucket), strict=True))
        finally:
            while receiving is not None:
                current, receiving = receiving, None
                await current
                index += 1
                receiving = receive(index + 1)


def _broadcast_from_trainer(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


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
            flat = (
                torch.frombuffer(buffer, dtype=torch.uint8)
                if buffer
                else torch.empty(0, dtype=torch.uint8)
            )
            result.append((meta.name, unpack(flat, [meta])[0].clone()))
        return result
