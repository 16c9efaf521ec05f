"""turnrl's worker extension inside vLLM: the weight-sync group's end in each vLLM worker
process, and the loading of what it receives into the model.

vLLM mixes this class into its worker class when the server is started with
`--worker-extension-cls turnrl.vllm_worker_extension.WeightSyncExtension` (and the repo root
on PYTHONPATH); the engine process calls its methods through the dev-mode endpoint
`POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1), which runs them in every worker while the
engine core waits. So this module runs in vLLM's environment: it imports torch, vllm, and the
turnrl modules that import only torch and protobuf.

- The group is formed as `rollout_svc.weight_sync` forms it (`turnrl.weight_group`), so the
  trainer's rank 0 and every other member see one kind of member; each worker is one rank
  (`rank_offset` + its tensor-parallel rank) and receives the whole update; vLLM's weight
  loaders keep the worker's shard.
- An update is received whole, in any of turnrl's layouts (`turnrl.weights.BucketedWeights`),
  before the model is touched: `reload_weights` puts each layer on the meta device until its
  weights arrive, so a broadcast that broke off in the middle of it would leave layers with no
  memory. A broken broadcast leaves the old weights whole; the engine still counts them
  incomplete until a push completes.
- The model loads through vLLM's own in-place reload (`Worker.reload_weights` with an
  iterator: checkpoint names, stacked and sharded by the model's `load_weights`, then each
  layer's `process_weights_after_loading`, so CPU's packed GEMM weights are rebuilt).
- The tied head: with `tie_word_embeddings`, `lm_head.weight` is the embedding's parameter and
  the checkpoint has no head, so reload processes only the embedding; the head's derived state
  (on CPU its packed copy, `cpu_linear`) would keep the old embedding. It is processed again
  after every load.

Every method answers a JSON-able dict; a failure is {"error": message}, never an exception,
which vLLM's HTTP layer would turn into a bare HTTP 500.
"""

import datetime
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from turnrl.weight_group import broadcast, form_group, join_store, leave_group
from turnrl.weights import LAYOUTS, BucketedWeights, TensorMeta

log = logging.getLogger(__name__)


@dataclass
class _GroupState:
    """What one worker keeps between calls: its group, and the memory updates land in
    (kept from push to push: fresh memory costs a page fault per 4 KiB)."""

    group: dist.ProcessGroup | None = None
    group_name: str = ""
    device: str = "cpu"
    staging: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))


class WeightSyncExtension:
    """Methods vLLM adds to its worker class (module docstring). Names start with `turnrl_`:
    vLLM refuses an extension whose names clash with the worker's own (`update_weights`...)."""

    def turnrl_join_weight_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> dict:
        """Joins group `group_name` as rank `rank_offset` + this worker's rank, leaving the
        group it was in; returns once every rank joined: {"rank": ...}."""
        state = _state(self)
        rank = rank_offset + self.rank
        try:
            _leave(state)
            timeout = datetime.timedelta(seconds=timeout_seconds)
            store = join_store(master_address, master_port, world_size, timeout)
            state.group = form_group(store, rank, world_size, backend, group_name, timeout)
        except Exception as e:  # the boundary to the engine process: answered, not raised
            return {"error": f"rank {rank} could not join weight-sync group {group_name!r}: {e}"}
        state.group_name = group_name
        state.device = "cuda" if backend == "nccl" else "cpu"
        return {"rank": rank}

    def turnrl_leave_weight_group(self) -> dict:
        """Leaves the group this worker is in, if any."""
        _leave(_state(self))
        return {}

    def turnrl_receive_weights(
        self, group_name: str, tensors: list[list], bucket_size_bytes: int, layout: str
    ) -> dict:
        """Receives one update that rank 0 broadcasts in `layout` (turnrl.weights.LAYOUTS),
        `tensors` as [name, dtype name, shape] in send order, and loads it once it is whole;
        {"receive_seconds", "load_seconds"}."""
        state = _state(self)
        if state.group is None or group_name != state.group_name:
            return {"error": f"no weight-sync group {group_name!r}; call InitWeightSync first"}
        if layout not in LAYOUTS:
            return {"error": f"layout {layout!r} is not one of {list(LAYOUTS)}"}
        metas = [
            TensorMeta(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in tensors
        ]
        update = BucketedWeights(metas, bucket_size_bytes, device=state.device, reuse=state.staging)
        if update.data.numel() > state.staging.numel():
            state.staging = update.data
        started = time.perf_counter()
        index = 0
        try:
            for index in range(len(update.buckets)):
                pieces = update.broadcast_pieces(index, layout)
                for piece in pieces:
                    broadcast(state.group, piece)
                if layout == "flattened_buckets":
                    update.unflatten(index, pieces)
        except RuntimeError as e:  # torch's DistBackendError: the sender left, a timeout
            return {
                "error": f"the weight broadcast on group {group_name!r} broke off after "
                f"{index} of {len(update.buckets)} buckets; the weights are unchanged: {e}"
            }
        received = time.perf_counter()
        error = _load(self, update.named_tensors())
        if error:
            return {"error": error}
        return {
            "receive_seconds": received - started,
            "load_seconds": time.perf_counter() - received,
        }

    def turnrl_load_weights_from_folder(self, folder: str) -> dict:
        """Loads the tensors of every safetensors file in `folder` (the PushWeights fallback,
        written by the engine on a disk both share); {"load_seconds"}."""
        started = time.perf_counter()
        try:
            named_tensors = [
                item for file in sorted(Path(folder).glob("*.safetensors"))
                for item in load_file(file).items()
            ]  # fmt: skip
        except OSError as e:
            return {"error": f"could not read the update in {folder!r}: {e}"}
        if not named_tensors:
            return {"error": f"no safetensors files in {folder!r}"}
        error = _load(self, named_tensors)
        if error:
            return {"error": error}
        return {"load_seconds": time.perf_counter() - started}


def _state(worker: object) -> _GroupState:
    """The worker's group state, made on first use (vLLM builds the worker, not us)."""
    return worker.__dict__.setdefault("_turnrl_weight_sync", _GroupState())


def _leave(state: _GroupState) -> None:
    if state.group is not None:
        leave_group(state.group)
        state.group, state.group_name = None, ""


def _load(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Loads checkpoint-named tensors into the worker's model in place, its tied head included;
    an error message, or "" when it loaded."""
    try:
        worker.reload_weights(weights_iterator=iter(named_tensors))
        _refresh_tied_head(worker)
    except Exception as e:  # e.g. a tensor the model's loader does not take
        log.exception("loading a weight update failed")
        return f"vLLM could not load the update ({type(e).__name__}: {e})"
    return ""


def _refresh_tied_head(worker) -> None:
    """Redoes the head's after-loading processing from the embedding it shares (module
    docstring: a reload processes only the embedding)."""
    model = worker.model_runner.get_model()
    config = worker.vllm_config.model_config.hf_text_config
    head = getattr(model, "lm_head", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None:
        return
    with torch.no_grad():
        head.quant_method.process_weights_after_loading(head)
