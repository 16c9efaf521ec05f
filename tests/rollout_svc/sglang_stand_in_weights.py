"""How the stand-in SGLang server (`sglang_stand_in`) takes weights as SGLang does: it joins
a weight-sync group as SGLang's `init_custom_process_group` does, receives the broadcasts of
`update_weights_from_distributed` (per tensor or flattened), reads a folder of
`update_weights_from_disk`, and labels output tokens with the versions that sampled them
(`meta_info["weight_versions"]`)."""

import datetime
import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

# How long a join or a broadcast waits for the other ranks.
WAIT_SECONDS = 10.0


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `folder`."""
    return {
        name: tensor
        for file in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


def join_as_sglang(body: dict, group_name: str) -> dist.ProcessGroup:
    """Joins the weight-sync group as SGLang's ModelRunner.init_weights_update_group does (its
    `init_custom_process_group`, tensor-parallel rank 0): rendezvous at tcp://master, the keys
    under a PrefixStore named after the group, the group made and registered by torch's helper.
    Written out here, not taken from turnrl, so a test shows that turnrl's end agrees."""
    timeout = datetime.timedelta(seconds=WAIT_SECONDS)
    init_method = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world_size = next(
        rendezvous(init_method, body["rank_offset"], body["world_size"], timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(body.get("backend", "nccl")),
        PrefixStore(group_name, store), group_name=group_name, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {member: member for member in range(world_size)}
    return group


def receive_flattened(
    group: dist.ProcessGroup, dtypes: list[str], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """One broadcast of the tensors end to end, as SGLang's load_format "flattened_bucket"
    (its FlattenedTensorBucket) receives them; split back into the tensors."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=getattr(torch, dtypes[0]))
    dist.broadcast(flat, src=0, group=group)
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]


def receive_per_tensor(
    group: dist.ProcessGroup, dtypes: list[str], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """One broadcast from rank 0 per tensor, as SGLang's update_weights_from_distributed."""
    tensors = [
        torch.empty(shape, dtype=getattr(torch, dtype))
        for dtype, shape in zip(dtypes, shapes, strict=True)
    ]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    for handle in handles:
        handle.wait()
    return tensors


def spans_of(versions: list[int]) -> list[dict]:
    """meta_info["weight_versions"] of tokens sampled by the given versions, one each."""
    spans: list[dict] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": str(version), "start": index, "end": index + 1})
    return spans


def version_spans(changes: list[tuple[str, int]], current: str, count: int) -> list[dict]:
    """SGLang's meta_info["weight_versions"]: which version sampled which output tokens."""
    spans: list[dict] = []
    for version, end in [*changes, (current, count)]:
        start = spans[-1]["end"] if spans else 0
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        elif not spans or end > start:
            spans.append({"version": version, "start": start, "end": end})
    return spans
