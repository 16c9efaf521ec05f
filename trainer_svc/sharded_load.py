"""Loading a Hugging Face model onto FSDP2's shards without a whole copy of it on any rank.

`empty_model` builds the model with its parameters on the meta device (its buffers, such as
RoPE's frequencies, are real: they are computed at construction, not loaded); `apply_fsdp`
shards the empty parameters; `fill_shards` then gives each rank's shard memory and copies
in the rows of each tensor that the rank holds, read from the model folder's safetensors
files with plain reads: one tensor's rows at a time, in fp32. So a rank's peak is
about its shard of the model, where loading the whole model on every rank and then
sharding it (transformers' `from_pretrained`, then `fully_shard`) peaks at the whole model
on each of them. `benchmarks/trainer_memory.py` measures both.

The files' names are the model's, after transformers' own renamings of the model class (a
Qwen2.5-VL checkpoint's `model.layers.*` is the model's `model.language_model.layers.*`).
A model whose checkpoint transformers converts in other ways (fusing experts, say) is
refused by `CheckpointFiles`: `load_model` loads it whole instead, as it does every model
of a single process. A LoRA policy's adapters go on the empty model with their initial
weights (`lora.add_lora_adapters`), which fill them once sharded.
"""

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from trainer_svc.safetensors_io import StoredTensor, read_bytes, safetensors_entries
from turnrl.errors import ConfigError

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


def empty_model(
    model_class: type, model_path: str | Path, config: PreTrainedConfig
) -> PreTrainedModel:
    """The model of `model_path` in fp32 with `config`, its parameters on the meta device (no
    memory), its buffers real; with the folder's generation config, as `from_pretrained`
    would set it."""
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=torch.float32)
    # The patched parameter registration unties them: a tied head is the embedding again.
    model.tie_weights()
    if (Path(model_path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


class CheckpointFiles:
    """The safetensors files of a model folder, indexed by the model's parameter names, read a
    few rows of one tensor at a time with plain reads: a memory map would keep the pages it
    touched resident, counted in the rank's memory until it is closed."""

    def __init__(self, model_path: str | Path, model: PreTrainedModel) -> None:
        folder = Path(model_path)
        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / SAFETENSORS_FILE).is_file():
            files = [SAFETENSORS_FILE]
        else:
            raise ConfigError(
                f"{folder} holds no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}: the trainer "
                "loads models from safetensors files only"
            )
        conversions = get_model_conversion_mapping(model)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        if len(renamings) < len(conversions):
            raise ConfigError(
                f"transformers converts the tensors of {folder} ({type(model).__name__}) as it "
                "loads them, beyond renaming: they cannot be read as the model's shards"
            )
        names = dict.fromkeys((name for name, _ in model.named_parameters()), True)
        self.folder = folder
        # parameter name -> where its bytes lie
        self.locations: dict[str, StoredTensor] = {}
        for file in files:
            for key, stored in safetensors_entries(folder / file).items():
                name, _ = rename_source_key(key, renamings, [], model.base_model_prefix, names)
                self.locations[name] = stored

    def follow_renames(self, model: PreTrainedModel, name_before: Callable[[str], str]) -> None:
        """Indexes the files by `model`'s parameter names again after a change to its modules
        renamed them (LoRA's: `name_before` gives each name as it was)."""
        self.locations = {
            name: self.locations[name_before(name)]
            for name, _ in model.named_parameters()
            if name_before(name) in self.locations
        }

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows start:stop (dimension 0) of parameter `name` in fp32; a 0-d tensor whole."""
        stored = self.locations[name]
        if not stored.shape:
            return read_bytes(stored, 0, stored.dtype.itemsize).reshape(()).float()
        row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
        data = read_bytes(stored, start * row_bytes, (stop - start) * row_bytes)
        return data.reshape(stop - start, *stored.shape[1:]).float()


@dataclass
class LoadedModel:
    """A model as `load_model` built it: whole, or empty with the `files` to fill its shards
    from once sharded (`fill_shards`); `missing` names the parameters the checkpoint lacks."""

    model: PreTrainedModel
    files: CheckpointFiles | None
    missing: list[str]


def load_model(
    model_class: type, model_path: str | Path, config: PreTrainedConfig, sharded: bool
) -> LoadedModel:
    """The model of `model_path` (fp32, with `config`): `sharded`, and where its files allow,
    empty for `fill_shards` to fill after sharding; else whole, by `from_pretrained`."""
    if sharded:
        model = empty_model(model_class, model_path, config)
        try:
            files = CheckpointFiles(model_path, model)
        except ConfigError as e:
            logger.info("loading %s whole on every rank: %s", model_path, e)
        else:
            names = [name for name, _ in model.named_parameters()]
            return LoadedModel(model, files, [n for n in names if n not in files.locations])
    model, loading = model_class.from_pretrained(
        model_path, config=config, dtype=torch.float32, output_loading_info=True
    )
    return LoadedModel(model, None, loading["missing_keys"])


def shard_rows(parameter: Tensor) -> tuple[int, int]:
    """The rows (start, stop) of dimension 0 that this rank holds of `parameter`: all of a
    plain tensor, and torch.chunk's share of a DTensor sharded on dimension 0 (FSDP2's)."""
    if not isinstance(parameter, DTensor):
        return 0, parameter.shape[0] if parameter.dim() else 0
    (placement,) = parameter.placements
    assert placement == Shard(0), f"FSDP2 shards dimension 0, not {placement}"
    mesh = parameter.device_mesh
    rows = parameter.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    return start, min(start + chunk, rows)


def fill_shards(
    model: PreTrainedModel,
    device: torch.device,
    files: CheckpointFiles,
    fresh: dict[str, Tensor] | None = None,
) -> None:
    """Gives the (sharded) empty `model` memory on `device` and fills each parameter's local
    rows from `files`, or from `fresh` (whole tensors, for parameters the files lack: a new
    head). Raises ConfigError naming the parameters found in neither."""
    fresh = fresh or {}
    names = [name for name, _ in model.named_parameters()]
    missing = [n for n in names if n not in files.locations and n not in fresh]
    if missing:
        raise ConfigError(
            f"{files.folder} lacks {len(missing)} of the model's tensors: {missing[:5]}"
        )
    # to_empty gives buffers new memory too; theirs were computed at construction.
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module's alias a tensor of its own, unsharded
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, parameter in model.named_parameters():
            start, stop = shard_rows(parameter)
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            if name in fresh:
                rows = fresh[name][start:stop] if fresh[name].dim() else fresh[name]
            else:
                rows = files.rows(name, start, stop)
            local.copy_(rows.reshape(local.shape))
