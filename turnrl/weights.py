"""Weight updates on the wire: tensor specs and the bucket layout that the trainer (sender)
and every rollout engine (receiver) must agree on byte for byte.

A push sends tensors in spec order, packed into flat uint8 buckets of at most
`bucket_size_bytes` (a tensor larger than that gets a bucket of its own). One broadcast per
bucket moves far more bytes per second than one per tensor.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from turnrl.v1 import rollout_pb2

DTYPES = {
    rollout_pb2.TensorSpec.D_TYPE_FLOAT32: torch.float32,
    rollout_pb2.TensorSpec.D_TYPE_BFLOAT16: torch.bfloat16,
    rollout_pb2.TensorSpec.D_TYPE_FLOAT16: torch.float16,
}
WIRE_DTYPES = {dtype: wire for wire, dtype in DTYPES.items()}


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
        return count * _element_size(self.dtype)

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


def plan_buckets(metas: list[TensorMeta], bucket_size_bytes: int) -> list[list[int]]:
    """Indices of `metas` per bucket, in order, each bucket at most `bucket_size_bytes`."""
    buckets: list[list[int]] = []
    size = 0
    for index, meta in enumerate(metas):
        if not buckets or size + meta.nbytes > bucket_size_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += meta.nbytes
    return buckets


def pack(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 tensor holding `tensors` back to back (contiguous, on CPU)."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> list[torch.Tensor]:
    """The tensors of `metas`, in order: views of `flat`, or copies where a tensor's bytes do not
    start at a multiple of its element size (an odd-length bf16 tensor before an fp32 one)."""
    tensors = []
    offset = 0
    for meta in metas:
        chunk = flat[offset : offset + meta.nbytes]
        if chunk.storage_offset() % _element_size(meta.dtype):
            chunk = chunk.clone()
        tensors.append(chunk.view(meta.dtype).view(meta.shape))
        offset += meta.nbytes
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes; its tensors need {offset}")
    return tensors


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
