"""The weight routes of the stand-in SGLang server (`sglang_stand_in`), as SGLang 0.5.23 answers
them: the weight-update session, joining a weight-sync group with every tensor-parallel rank,
receiving the broadcasts of `update_weights_from_distributed` (per tensor, or a flattened
bucket of one or several dtypes), reading a folder of `update_weights_from_disk`, and the
cache flush that ends an update. Paths below are the 0.5.23 wheel's, under `sglang/srt/`."""

import asyncio
import datetime
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from starlette.responses import JSONResponse, Response
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

# How long a join or a broadcast waits for the other ranks. (SGLang 0.5.23 waits torch's
# default, 30 minutes: `utils/common.py` init_custom_process_group, called without a timeout;
# a stand-in that did would hold a failing test that long.)
WAIT_SECONDS = 10.0
DEFAULT_GROUP = "weight_update_group"  # `managers/io_struct.py`'s default group_name
# `managers/scheduler_components/weight_updater.py`'s words.
NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)


class StandInWeights:
    """The weights of the stand-in server and the routes that change them. `tp_size` ranks
    join each group (ranks rank_offset onwards) and each receives every broadcast, as SGLang's
    tensor-parallel ranks do; rank 0's tensors are `weights`, rank k's `rank_weights[k]`.
    `sessions` False stands in for a release before 0.5.21: no session routes (404), and
    updates need no session. `load` takes what rank 0 received and its weight_version;
    `cache_in_use` says whether running requests keep the cache from being flushed; `joined`
    is awaited once a group formed (tests wait for it)."""

    def __init__(
        self,
        tp_size: int,
        load: Callable[[dict[str, torch.Tensor], str | None], Awaitable[None]],
        cache_in_use: Callable[[], bool],
        joined: Callable[[], Awaitable[None]],
    ) -> None:
        self.tp_size = tp_size
        self.sessions = True
        self.session_open = False
        self.groups: dict[str, list[dist.ProcessGroup]] = {}  # by name: one per rank
        self.rank_weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        self._load = load
        self._cache_in_use = cache_in_use
        self._joined = joined

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.rank_weights[0]

    def routes(self) -> dict[str, Callable[[dict | None], Awaitable[Response]]]:
        return {
            "/init_weights_update_group": self._init_group,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/update_weights_from_disk": self._update_from_disk,
            "/begin_weight_update": self._begin,
            "/end_weight_update": self._end,
        }

    def leave_groups(self) -> None:
        """Destroys the weight-sync groups joined, whose names are the test process's."""
        for ranks in self.groups.values():
            _leave(ranks)
        self.groups.clear()

    async def _begin(self, body: dict | None) -> Response:
        # weight_updater.py begin_weight_update: one session at a time.
        if not self.sessions:
            return _NOT_FOUND
        if self.session_open:
            return _failure(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session_open = True
        return JSONResponse({"success": True, "message": "Success"})

    async def _end(self, body: dict | None) -> Response:
        if not self.sessions:
            return _NOT_FOUND
        if not self.session_open:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return JSONResponse({"success": True, "message": "Success"})

    async def _init_group(self, body: dict) -> Response:
        group_name = body.get("group_name", DEFAULT_GROUP)
        try:
            if group_name in self.groups:  # torch refuses a name it registered
                raise ValueError(f"The specified group name {group_name} has already been created")
            joins = [asyncio.to_thread(join_rank, body, k) for k in range(self.tp_size)]
            ranks = await asyncio.gather(*joins)
        except Exception as e:  # weight_updater.py (model runner) answers, it does not raise
            return _failure(f"Failed to initialize custom process group: {e}.")
        self.groups[group_name] = ranks
        await self._joined()
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    async def _destroy_group(self, body: dict) -> Response:
        ranks = self.groups.pop(body.get("group_name", DEFAULT_GROUP), None)
        if ranks is None:
            return _failure("The group to be destroyed does not exist.")
        _leave(ranks)
        return JSONResponse({"success": True, "message": "Succeeded to destroy group."})

    async def _update_from_distributed(self, body: dict) -> Response:
        # scheduler_components/weight_updater.py: refused before anything is received.
        if self.sessions and not self.session_open:
            return _failure(NO_SESSION)
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        group_name = body.get("group_name", DEFAULT_GROUP)
        flattened = body.get("load_format") == "flattened_bucket"  # any other: per tensor
        try:
            if group_name not in self.groups:
                raise AssertionError(
                    f"Group {group_name} not in {list(self.groups)}. Please call "
                    "`init_weights_update_group` first."
                )
            receive = receive_flattened if flattened else receive_per_tensor
            received = await asyncio.gather(
                *(asyncio.to_thread(receive, g, dtypes, shapes) for g in self.groups[group_name])
            )
        except Exception as e:
            return _failure(f"Failed to receive weights: {e}")
        for rank, tensors in enumerate(received):
            self.rank_weights[rank].update(zip(names, tensors, strict=False))
        version = body.get("weight_version")
        await self._load(dict(zip(names, received[0], strict=False)), version)
        return self._flushed(body, "Succeeded to update parameter online.", version)

    async def _update_from_disk(self, body: dict) -> Response:
        loaded = await asyncio.to_thread(load_folder, Path(body["model_path"]))
        if not loaded:
            return _failure(f"no safetensors in {body['model_path']}")
        for weights in self.rank_weights:
            weights.update(loaded)
        version = body.get("weight_version")
        await self._load(loaded, version)
        return self._flushed(body, "Succeeded to update model weights.", version)

    def _flushed(self, body: dict, message: str, version: str | None) -> Response:
        """The answer to an update that loaded its weights: a failure when its cache flush is
        refused (weight_updater.py flush_cache_after_weight_update), else success."""
        if body.get("flush_cache", True) and self._cache_in_use():
            return _failure(NOT_FLUSHED)
        if version is not None:  # tokenizer_control_mixin.py
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message})


# What a FastAPI server answers for a route it does not have.
_NOT_FOUND = JSONResponse({"detail": "Not Found"}, status_code=404)


def _failure(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `folder`."""
    return {
        name: tensor
        for file in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


def join_rank(body: dict, tp_rank: int) -> dist.ProcessGroup:
    """Joins the weight-sync group as SGLang's tensor-parallel rank `tp_rank` does, as rank
    rank_offset + tp_rank (model runner's weight_updater.py init_weights_update_group):
    rendezvous at tcp://master, the keys under a PrefixStore named after the group, then the
    group's name and device, as torch's helper nests them (`utils/common.py`
    init_custom_process_group). Rank 0 is made and registered by that helper, written out
    here, not taken from turnrl, so a test shows that turnrl's end agrees; the other ranks,
    processes of their own in SGLang, are built from the same keys without registering, since
    a process registers a group's name once."""
    timeout = datetime.timedelta(seconds=WAIT_SECONDS)
    group_name = body.get("group_name", DEFAULT_GROUP)
    init_method = f"tcp://{body['master_address']}:{body['master_port']}"
    rank = body["rank_offset"] + tp_rank
    store, rank, world_size = next(
        rendezvous(init_method, rank, body["world_size"], timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    backend = Backend(body.get("backend", "nccl"))
    if tp_rank > 0:
        assert backend == "gloo", "the stand-in's extra ranks join gloo groups only"
        nested = PrefixStore("cpu/", PrefixStore(f"{group_name}/", store))
        return dist.ProcessGroupGloo(nested, rank, world_size, timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {member: member for member in range(world_size)}
    return group


def _leave(ranks: list[dist.ProcessGroup]) -> None:
    dist.destroy_process_group(ranks[0])
    for group in ranks[1:]:
        group.shutdown()


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def receive_flattened(
    group: dist.ProcessGroup, dtypes: list[str], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """One broadcast of the tensors' bytes end to end, as SGLang's load_format
    "flattened_bucket" receives them (`weight_sync/tensor_bucket.py` FlattenedTensorBucket):
    a uint8 buffer, dtypes mixed, each tensor at a byte offset its dtype's size divides, or
    ValueError before anything is received."""
    pieces, offset = [], 0
    for dtype_name, shape in zip(dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        if any(size < 0 for size in shape):
            raise ValueError(f"Negative dimension in received tensor: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor: byte offset {offset}, dtype {dtype}")
        size = math.prod(shape) * dtype.itemsize
        pieces.append((offset, offset + size, dtype, shape))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    _broadcast(group, flat).wait()
    return [flat[start:end].view(dtype).view(shape) for start, end, dtype, shape in pieces]


def receive_per_tensor(
    group: dist.ProcessGroup, dtypes: list[str], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """One broadcast from rank 0 per tensor, as SGLang's update_weights_from_distributed."""
    tensors = [
        torch.empty(shape, dtype=getattr(torch, dtype))
        for dtype, shape in zip(dtypes, shapes, strict=False)
    ]
    for work in [_broadcast(group, tensor) for tensor in tensors]:
        work.wait()
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
