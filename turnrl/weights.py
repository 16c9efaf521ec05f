"""Weight updates on the wire: tensor specs and the memory layout of an update, on which the
trainer (sender) and every rollout engine (receiver) must agree byte for byte.

A push sends tensors in spec order, in flat buckets of at most `bucket_size_bytes` (a tensor
larger than that gets a bucket of its own), one broadcast per bucket: far more bytes per
second than one per tensor, which is what SGLang receives (`LAYOUTS`' per_tensor; the same
memory, each tensor broadcast from where it lies). Inside a bucket every tensor starts at a
multiple of 64 bytes, so a bucket's bytes can be the tensors themselves: `BucketedWeights`
keeps an update in exactly that layout. The trainer copies its weights into one (`pack`, bucket
by bucket in a thread of its own, so that a push sends each bucket while the next is copied)
and broadcasts its buckets as they lie, and an engine whose parameters live in one receives
the broadcast straight into them; no side packs or unpacks anything else.
"""

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Self

import torch

from turnrl.v1 import rollout_pb2

DTYPES = {
    rollout_pb2.TensorSpec.D_TYPE_FLOAT32: torch.float32,
    rollout_pb2.TensorSpec.D_TYPE_BFLOAT16: torch.bfloat16,
    rollout_pb2.TensorSpec.D_TYPE_FLOAT16: torch.float16,
}
WIRE_DTYPES = {dtype: wire for wire, dtype in DTYPES.items()}
# Where each tensor may start: a multiple of every element size, and of a cache line.
ALIGNMENT_BYTES = 64
# How an update travels on the weight-sync group (rollout.proto's WeightLayout): one broadcast
# per bucket in the layout below, or one per tensor, which SGLang's servers receive.
LAYOUTS = {
    "aligned_buckets": rollout_pb2.WEIGHT_LAYOUT_ALIGNED_BUCKETS,
    "per_tensor": rollout_pb2.WEIGHT_LAYOUT_PER_TENSOR,
    "flattened_buckets": rollout_pb2.WEIGHT_LAYOUT_FLATTENED_BUCKETS,
}


@dataclass(frozen=True)
class TensorMeta:
    """Name, element type and shape of one tensor of an update."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def to_proto(self) -> rollout_pb2.TensorSpec:
        return rollout_pb2.TensorSpec(
            name=self.name, dtype=WIRE_DTYPES[self.dtype], shape=self.shape
        )

    @classmethod
    def from_proto(cls, spec: rollout_pb2.TensorSpec) -> "TensorMeta":
        """Raises ValueError for an UNSPECIFIED dtype or a negative dimension."""
        if spec.dtype not in DTYPES:
            raise ValueError(f"tensor {spec.name!r}: dtype {spec.dtype!r} is not set or unknown")
        if any(size < 0 for size in spec.shape):
            raise ValueError(f"tensor {spec.name!r}: negative dimension in {list(spec.shape)}")
        return cls(spec.name, DTYPES[spec.dtype], tuple(spec.shape))


@dataclass(frozen=True)
class LoraAdapter:
    """What makes an update a LoRA adapter (rollout.proto's LoraAdapter): its tensors are
    peft's saved adapter tensors (`PEFT_PREFIX` + module + `.lora_A.weight` / `.lora_B.weight`),
    which replace the adapter an engine applies on its unchanged base weights."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def to_proto(self) -> rollout_pb2.LoraAdapter:
        return rollout_pb2.LoraAdapter(
            rank=self.rank, alpha=self.alpha, target_modules=self.target_modules
        )

    @classmethod
    def from_proto(cls, adapter: rollout_pb2.LoraAdapter) -> "LoraAdapter":
        """Raises ValueError for a rank or alpha that is not positive, or no target module."""
        if adapter.rank <= 0 or adapter.alpha <= 0:
            raise ValueError(
                f"a LoRA adapter needs a positive rank and alpha, got {adapter.rank} and "
                f"{adapter.alpha}"
            )
        if not adapter.target_modules:
            raise ValueError("a LoRA adapter names at least one target module")
        return cls(adapter.rank, adapter.alpha, tuple(adapter.target_modules))


# How peft's saved adapter names start: the wrapped model's own module names follow.
PEFT_PREFIX = "base_model.model."


class BucketedWeights:
    """The tensors of one update in one flat uint8 buffer, laid out as they travel: bucket
    after bucket, each tensor at a 64-byte-aligned offset. `bucket(k)` is bucket k's bytes
    (what one broadcast sends or receives), `tensor(i)` a typed view of tensor i in it. Of an
    update `pack` is still copying in, every method that reads a bucket's bytes waits until
    that bucket is in (on an event loop, await `asyncio.to_thread(weights.wait_packed)` first).

    `reuse` is a buffer to lay the update out in when it is large enough (an earlier update's
    `data`, once nothing reads or packs it any more): fresh memory costs a page fault per 4 KiB
    on its first write."""

    def __init__(
        self,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        *,
        device: torch.device | str = "cpu",
        reuse: torch.Tensor | None = None,
    ) -> None:
        self.metas = list(metas)
        self.bucket_size_bytes = bucket_size_bytes
        layout = _Layout(self.metas, bucket_size_bytes)
        self.buckets = layout.buckets  # indices of `metas`, in order
        self._offsets = layout.offsets  # each tensor's first byte in `data`
        self._bounds = layout.bounds  # each bucket's first and past-last byte
        self._bucket_of = [k for k, indices in enumerate(self.buckets) for _ in indices]
        self._packing: _Packing | None = None  # the copy `pack` started, until it is done
        cursor = layout.nbytes
        device = torch.device(device)
        if reuse is not None and reuse.device == device and reuse.numel() >= cursor:
            self.data = reuse[:cursor]
        else:
            self.data = torch.empty(cursor, dtype=torch.uint8, device=device)

    @classmethod
    def pack(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_size_bytes: int,
        *,
        dtype: torch.dtype | None = None,
        reuse: torch.Tensor | None = None,
    ) -> Self:
        """`named_tensors` copied into a new layout on CPU, cast to `dtype` when given. A
        tensor that is an earlier one (tied embeddings) goes once, under the earlier name: the
        receiving model ties them too.

        Returns as the copy starts: a thread copies the tensors in bucket by bucket, and what
        reads a bucket waits for it, so a push sends bucket k while bucket k + 1 is copied. The
        tensors are read until `wait_packed` returns: leave them unchanged until then
        (`WeightPusher.push` returns after it)."""
        items, seen = [], set()
        for name, tensor in named_tensors:
            same = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.numel() == 0 or same not in seen:
                seen.add(same)
                items.append((name, tensor.detach()))
        metas = [TensorMeta(name, dtype or t.dtype, tuple(t.shape)) for name, t in items]
        weights = cls(metas, bucket_size_bytes, reuse=reuse)
        weights._packing = _Packing(weights, [tensor for _, tensor in items])
        return weights

    @property
    def nbytes(self) -> int:
        """The tensors' bytes, padding not counted."""
        return sum(meta.nbytes for meta in self.metas)

    def matches(self, metas: Sequence[TensorMeta], bucket_size_bytes: int) -> bool:
        """Whether an update of `metas` in buckets of `bucket_size_bytes` has this layout."""
        return bucket_size_bytes == self.bucket_size_bytes and list(metas) == self.metas

    def wait_packed(self, bucket: int = -1) -> None:
        """Returns once `pack` has copied bucket `bucket` (by default the last) and those
        before it in, at once for an update it did not pack; raises its error if the copy
        failed."""
        if self.buckets:
            self._wait_packed(range(len(self.buckets))[bucket])

    def bucket(self, index: int) -> torch.Tensor:
        self._wait_packed(index)
        start, end = self._bounds[index]
        return self.data[start:end]

    def tensor(self, index: int) -> torch.Tensor:
        self._wait_packed(self._bucket_of[index])
        return self._place(index)

    def broadcast_pieces(self, bucket: int, layout: str) -> list[torch.Tensor]:
        """What bucket `bucket` travels as, one broadcast each, in `layout` (LAYOUTS): the
        bucket's bytes whole, each of its tensors, or each run of its tensors of one dtype
        end to end (copies: a receiver puts them back with `unflatten`)."""
        if layout == "per_tensor":
            return [self.tensor(index) for index in self.buckets[bucket]]
        if layout == "flattened_buckets":
            return [
                torch.cat([self.tensor(index).reshape(-1) for index in run])
                for run in self.dtype_runs(bucket)
            ]
        return [self.bucket(bucket)]

    def dtype_runs(self, bucket: int) -> list[list[int]]:
        """Bucket `bucket`'s tensor indices in runs of one dtype: a flattened bucket's pieces."""
        return dtype_runs(self.metas, self.buckets[bucket])

    def unflatten(self, bucket: int, pieces: Sequence[torch.Tensor]) -> None:
        """Copies the flattened pieces of bucket `bucket` (`broadcast_pieces`) into its
        tensors."""
        for run, piece in zip(self.dtype_runs(bucket), pieces, strict=True):
            start = 0
            for index in run:
                tensor = self.tensor(index)
                tensor.copy_(piece[start : start + tensor.numel()].view(tensor.shape))
                start += tensor.numel()

    def named_tensors(self, bucket: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor, or of bucket `bucket`'s, in order."""
        indices = range(len(self.metas)) if bucket is None else self.buckets[bucket]
        return [(self.metas[i].name, self.tensor(i)) for i in indices]

    def _place(self, index: int) -> torch.Tensor:
        """Tensor `index`'s view, whether or not it has been copied in."""
        meta, start = self.metas[index], self._offsets[index]
        return self.data[start : start + meta.nbytes].view(meta.dtype).view(meta.shape)

    def _wait_packed(self, bucket: int) -> None:
        packing = self._packing
        if packing is not None:
            packing.wait(bucket)
            if bucket == len(self.buckets) - 1:  # every bucket is in
                packing.join()
                self._packing = None


def bucket_indices(metas: Sequence[TensorMeta], bucket_size_bytes: int) -> list[list[int]]:
    """Which of `metas` travel in each bucket of an update, as `BucketedWeights` lays them out,
    with no memory allocated."""
    return _Layout(list(metas), bucket_size_bytes).buckets


def dtype_runs(metas: Sequence[TensorMeta], indices: Sequence[int]) -> list[list[int]]:
    """`indices` (of `metas`, in order) in runs of one dtype."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and metas[runs[-1][-1]].dtype == metas[index].dtype:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


class _Packing:
    """`BucketedWeights.pack`'s copy of the tensors into their places, bucket after bucket, in
    a thread of its own (torch's copy releases the GIL, so it runs beside a broadcast)."""

    def __init__(self, weights: BucketedWeights, tensors: list[torch.Tensor]) -> None:
        self._changed = threading.Condition()
        self._buckets_in = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._copy, args=(weights, tensors), name="turnrl-pack", daemon=True
        )
        self._thread.start()

    def wait(self, bucket: int) -> None:
        """Returns once bucket `bucket` and those before it are in; raises the copy's error."""
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or self._buckets_in > bucket)
            if self._error is not None:
                raise RuntimeError(f"packing the weights failed: {self._error!r}") from self._error

    def join(self) -> None:
        """Returns once the copy's thread has ended: one still ending as the interpreter exits
        can abort the process ("terminate called without an active exception")."""
        self._thread.join()

    def _copy(self, weights: BucketedWeights, tensors: list[torch.Tensor]) -> None:
        try:
            for bucket, indices in enumerate(weights.buckets):
                for index in indices:
                    weights._place(index).copy_(tensors[index])
                with self._changed:
                    self._buckets_in = bucket + 1
                    self._changed.notify_all()
        except BaseException as error:  # handed to every waiter
            with self._changed:
                self._error = error
                self._changed.notify_all()


class _Layout:
    """Where each tensor and bucket of an update lies in its buffer (BucketedWeights)."""

    def __init__(self, metas: list[TensorMeta], bucket_size_bytes: int) -> None:
        if bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
        self.buckets: list[list[int]] = []
        self.offsets: list[int] = []
        self.bounds: list[tuple[int, int]] = []
        cursor = 0  # always aligned
        for index, meta in enumerate(metas):
            if not self.buckets or cursor - self.bounds[-1][0] + meta.nbytes > bucket_size_bytes:
                self.buckets.append([])
                self.bounds.append((cursor, cursor))
            self.buckets[-1].append(index)
            self.offsets.append(cursor)
            self.bounds[-1] = (self.bounds[-1][0], cursor + meta.nbytes)
            cursor += -(-meta.nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        self.nbytes = cursor
