"""Checkpoints of a run: each model's weights and optimizer state as the shards each rank
holds, and the loop's state (schedulers, data position, prompts in flight, RNG states, step).

Each checkpoint is one folder `checkpoints/step_<N>/`:

    shards/      every rank's shards of each model's weights and optimizer state, a
                 safetensors file per rank under the names `<role>/<model|optimizer>/<name>`,
                 each file's header saying where its rows sit in the whole tensor (as
                 torch.distributed.checkpoint's HuggingFaceStorageReader reads them)
    state.pt     the small rest, by role (policy, critic, judge): each model's scheduler
                 and optimizer param groups; and torch's RNG state
    state.json   step, data position, prompts in flight, Python's RNG state

No rank gathers a model to write it: each writes its rows straight from where they lie, one
tensor at a time (`save_shards`; the safetensors library would build the whole file in memory
first). Any number of ranks reads a checkpoint back, each its own rows (`read_shards`: the
checkpoint reshards). The shards are written into a temporary folder that rank 0 renames into
place once every rank's are written (`finish_checkpoint`), so a folder that exists is
complete: a run killed mid-save (kill -9) resumes from the checkpoint before. With
`trainer.checkpoint.async_save` each rank copies its shards and writes the copies on a thread
of its own while the run trains on, and rank 0 finishes the folder when every rank's are
written. `trainer.checkpoint.keep_last` deletes all but the newest checkpoints.

Nothing is unpickled as it loads: safetensors files hold tensors only, and `state.pt` is
loaded with `torch.load(weights_only=True)`, which builds tensors and plain containers only;
a file planted in a run folder that would run code when unpickled is refused.
"""

import json
import pickle
import random
import shutil
import tempfile
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer_svc.fsdp import FsdpModel
from trainer_svc.safetensors_io import safetensors_header, write_tensor
from trainer_svc.sharded_load import shard_rows
from turnrl.errors import ConfigError

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"
JSON_STATE_FILE = "state.json"
CHECKPOINT_PREFIX = "step_"

SHARDS_FOLDER = "shards"
# A single process saves and loads without a process group, as meant; torch warns each time.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

# A model's tensors in a checkpoint: {"model": {name: tensor}, "optimizer": {name: tensor}},
# this rank's shards of them (DTensors under FSDP), by role (policy, critic, judge).
Shards = dict[str, dict[str, Tensor]]


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def new_staging_folder(run_dir: Path, step: int) -> Path:
    """An empty temporary folder beside the checkpoints, for the checkpoint of `step` to be
    written into by every rank (rank 0 makes it; the ranks share the file system)."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{checkpoint_name(step)}-", dir=root))


def model_checkpoint_state(model: FsdpModel) -> tuple[Shards, dict[str, Any]]:
    """What a checkpoint holds of `model`: this rank's shards of its weights and its
    optimizer's state, the live tensors (DTensors under FSDP), as {"model": {name: ...},
    "optimizer": {"<parameter name>.<exp_avg|exp_avg_sq|step>": ...}}; and the plain rest,
    the scheduler's state and the optimizer's param groups. Frozen parameters (a LoRA
    policy's base: the model the run started from) and tied aliases are left out."""
    model_state, optimizer_state = get_state_dict(model.model, model.optimizer)
    plain = {
        "scheduler": model.scheduler.state_dict(),
        "param_groups": optimizer_state["param_groups"],
    }
    return checkpointed_tensors(model, model_state, optimizer_state), plain


def restore_model(model: FsdpModel, folder: Path, role: str, plain: dict[str, Any]) -> None:
    """Loads `model`'s state from the checkpoint in `folder`, where it is `role`'s, and
    `plain` (`model_checkpoint_state`'s plain part): each rank reads its rows. Collective."""
    model_state, optimizer_state = get_state_dict(model.model, model.optimizer)
    # Read in place into the tensors the state dicts hold (the frozen ones keep the model the
    # run started from), then set from them.
    read_shards(folder, {role: checkpointed_tensors(model, model_state, optimizer_state)})
    optimizer_state["param_groups"] = plain["param_groups"]
    set_state_dict(
        model.model,
        model.optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
    )
    model.scheduler.load_state_dict(plain["scheduler"])


def checkpointed_tensors(
    model: FsdpModel, model_state: dict[str, Tensor], optimizer_state: dict[str, Any]
) -> Shards:
    """The tensors of `get_state_dict`'s two state dicts of `model` that a checkpoint holds."""
    # named_parameters names a tied parameter once: its aliases stay out too.
    trainable = {n for n, p in model.model.named_parameters() if p.requires_grad}
    return {
        "model": {name: t for name, t in model_state.items() if name in trainable},
        "optimizer": {
            f"{name}.{key}": tensor
            for name, entries in optimizer_state["state"].items()
            for key, tensor in entries.items()
        },
    }


def save_shards(
    folder: Path, shards_by_role: dict[str, Shards], group: Any = None, in_background: bool = False
) -> Future | None:
    """Writes this rank's `shards_by_role` into its file in folder/shards, one tensor at a time
    from where it lies; every rank calls it with the same folder. In the background the
    shards are copied first and written on a thread of their own while the caller goes on:
    the future returned is done once every rank's are written (under FSDP the ranks meet on
    `group`, a gloo group of their own, once written)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = folder / SHARDS_FOLDER / f"shard-{rank:05d}.safetensors"
    pieces = rank_pieces(flat_names(shards_by_role), rank)
    if not in_background:
        write_pieces(file, pieces)
        return None
    copies = {key: (tensor.clone(), offsets) for key, (tensor, offsets) in pieces.items()}
    written: Future = Future()

    def write() -> None:
        try:
            write_pieces(file, copies)
            copies.clear()  # their memory back before the caller hears they are written
            if group is not None:
                dist.barrier(group=group)
        except BaseException as error:  # the caller's, with the future
            written.set_exception(error)
        else:
            written.set_result(file)

    threading.Thread(target=write, name="checkpoint-writer", daemon=True).start()
    return written


def rank_pieces(state: dict[str, Tensor], rank: int) -> dict[str, tuple[Tensor, list[int]]]:
    """What this rank writes of `state`: the rows it holds of each sharded tensor, with their
    offset in the whole, and on rank 0 the tensors every rank holds whole (Adam's step)."""
    pieces = {}
    for key, tensor in state.items():
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            if local.numel():
                start, _ = shard_rows(tensor)
                pieces[key] = (local, [start] + [0] * (tensor.dim() - 1))
        elif rank == 0:
            pieces[key] = (tensor, [0] * tensor.dim())
    return pieces


def write_pieces(file: Path, pieces: dict[str, tuple[Tensor, list[int]]]) -> None:
    """Writes `pieces` into the safetensors file `file`, with each one's offset in the whole
    in the header as torch.distributed.checkpoint's HuggingFaceStorageReader reads it."""
    file.parent.mkdir(parents=True, exist_ok=True)
    shapes = {key: (tensor.dtype, tuple(tensor.shape)) for key, (tensor, _) in pieces.items()}
    offsets = {key: {SAVED_OFFSETS_KEY: offsets} for key, (_, offsets) in pieces.items()}
    with open(file, "wb") as f:
        f.write(safetensors_header(shapes, {CUSTOM_METADATA_KEY: json.dumps(offsets)}))
        for tensor, _ in pieces.values():
            write_tensor(f, tensor)


def read_shards(folder: Path, targets_by_role: dict[str, Shards]) -> None:
    """Reads each of `targets_by_role`'s tensors, in place, from the checkpoint in `folder`:
    this rank's rows of it, whatever number of ranks wrote it. Collective."""
    reader = HuggingFaceStorageReader(str(folder / SHARDS_FOLDER))
    no_dist = not dist.is_initialized()
    try:
        dcp.load(flat_names(targets_by_role), storage_reader=reader, no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: each rank's failure inside
        causes = "; ".join(
            f"rank {rank}: {getattr(failure, 'exception', failure)}"
            for rank, failure in e.failures.items()
        )
        raise ConfigError(
            f"{folder} does not hold the run's models as they are: {causes}"
        ) from None


def flat_names(shards_by_role: dict[str, Shards]) -> dict[str, Tensor]:
    """`shards_by_role`'s tensors under the names the files give them: <role>/<kind>/<name>."""
    return {
        f"{role}/{kind}/{name}": tensor
        for role, shards in shards_by_role.items()
        for kind, tensors in shards.items()
        for name, tensor in tensors.items()
    }


@dataclass
class CheckpointState:
    """What rank 0 writes beside the shards, as it was at the step checkpointed (the shards
    may be written later): small tensors in dicts and lists, the models' plain state among
    them (state.pt), and the loop's JSON values (state.json), each with its RNG's state."""

    step: int
    tensors: dict[str, Any]
    loop_state: dict[str, Any]

    @classmethod
    def now(cls, step: int, tensors: dict[str, Any], loop_state: dict[str, Any]) -> Self:
        """The state of `step` with torch's and Python's RNG states as they are now."""
        tensors = {**tensors, "torch_rng": torch.get_rng_state()}
        return cls(step, tensors, {**loop_state, "step": step, "python_rng": random.getstate()})


def finish_checkpoint(
    staging: Path, run_dir: Path, state: CheckpointState, keep_last: int = 0
) -> Path:
    """Completes the checkpoint whose shards are in `staging` with `state`, renames it into
    place and, with `keep_last`, deletes all but the newest `keep_last` checkpoints; returns
    its folder."""
    target = run_dir / CHECKPOINTS / checkpoint_name(state.step)
    try:
        torch.save(state.tensors, staging / STATE_FILE)
        (staging / JSON_STATE_FILE).write_text(json.dumps(state.loop_state))
        if target.exists():  # SaveCheckpoint on demand, then the periodic one, at one step
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if keep_last:
        for old in checkpoint_folders(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    return target


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = run_dir / CHECKPOINTS
    return sorted(root.glob(f"{CHECKPOINT_PREFIX}*")) if root.is_dir() else []


def find_checkpoint(run_dir: Path, name: str | None = None) -> Path | None:
    """The checkpoint a run resumes from: the one named `name` (a folder name, step_000040,
    or a step, 40), else the newest; None when the run has none. Raises ConfigError for a
    name that is no checkpoint of the run, listing those it has."""
    folders = checkpoint_folders(run_dir)
    if name is None:
        return folders[-1] if folders else None
    wanted = checkpoint_name(int(name)) if name.isdigit() else name
    for folder in folders:
        if folder.name == wanted:
            return folder
    raise ConfigError(
        f"run {run_dir.name} has no checkpoint {name!r}; it has "
        f"{[f.name for f in folders] or 'none'}"
    )


def read_checkpoint_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's state beside its shards (state.pt's tensors and state.json's values in
    one dict), RNG states restored. Raises ConfigError for a file that is not a checkpoint
    this module wrote."""
    tensors_file, json_file = folder / STATE_FILE, folder / JSON_STATE_FILE
    try:
        tensors = torch.load(tensors_file, weights_only=True)
        plain = json.loads(json_file.read_text())
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConfigError(
            f"{tensors_file} with {json_file.name} is not a turnrl checkpoint (tensors and plain "
            f"containers only, beside JSON); it is not loaded: {e}"
        ) from None
    version, internal_state, gauss_next = plain["python_rng"]
    random.setstate((version, tuple(internal_state), gauss_next))
    torch.set_rng_state(tensors["torch_rng"])
    return {**tensors, **plain}
