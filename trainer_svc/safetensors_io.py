"""The safetensors file format, read and written a tensor at a time: an 8-byte header
length, a JSON header giving each tensor's dtype, shape and byte range, then the tensors'
bytes. turnrl reads the rows of a tensor it needs with plain reads (a memory map keeps the
pages it touched resident, counted in the process's memory) and writes each tensor as it
comes (the safetensors library builds a whole file in memory first)."""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from turnrl.errors import ConfigError

# safetensors' names of the element types of weights and optimizer state.
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes lie in a safetensors file, and what they hold."""

    file: Path
    offset: int  # of its first byte in the file
    dtype: torch.dtype
    shape: tuple[int, ...]


def safetensors_entries(file: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file by key, read from its header: an 8-byte length, then
    JSON giving each tensor's dtype, shape and byte range after the header. Raises ConfigError
    for an element type turnrl does not load (a quantized checkpoint's)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entries = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ConfigError(f"{file} holds {key} as {entry['dtype']}, which turnrl does not load")
        offset = 8 + length + entry["data_offsets"][0]
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        entries[key] = StoredTensor(file, offset, dtype, shape)
    return entries


def read_bytes(stored: StoredTensor, skip: int, count: int) -> Tensor:
    """`count` bytes of `stored`, from `skip` bytes into it, as a flat tensor of its dtype."""
    if not count:
        return torch.empty(0, dtype=stored.dtype)
    data = bytearray(count)
    with open(stored.file, "rb") as f:
        f.seek(stored.offset + skip)
        f.readinto(data)
    return torch.frombuffer(data, dtype=stored.dtype)


def safetensors_header(
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The header of a safetensors file holding `tensors` (name: (dtype, shape)) in this order,
    with `metadata`: its 8-byte length, then the JSON of each tensor's dtype, shape and byte
    range, padded with spaces to a multiple of 8 bytes, as the format asks."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        entries[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_tensor(file: BinaryIO, tensor: Tensor) -> None:
    """Appends `tensor`'s bytes (on CPU, in row-major order) to `file`."""
    file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
