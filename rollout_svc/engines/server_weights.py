"""What the SGLang and vLLM engines need to check and carry weights that their server, not this
process, holds: the parameter shapes of the server's checkpoint, read from its safetensors
headers (no tensor is loaded), the check that an update is newer than the server's, and an
update written as a safetensors folder (the PushWeights fallback, when no weight-sync group
formed: SGLang's `/update_weights_from_disk`, the vLLM extension's folder load), and a LoRA
adapter written as the peft folder both servers load adapters from.
"""

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.weights import LoraAdapter, TensorMeta

# What a disk update's folder holds besides the weights: SGLang reads the model's config there.
CONFIG_FILES = ("config.json", "generation_config.json")


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor of the checkpoint in the folder `model_path`, by name: its shape. None when
    `model_path` is not a local folder of safetensors (a hub id the server downloads)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 - a safe_open handle is no dict
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes


def check_against_checkpoint(
    metas: Sequence[TensorMeta], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Raises InvalidArgumentError naming the first tensor the checkpoint lacks or has in
    another shape: SGLang would load a wrong update partly and fail, or ignore the name."""
    for meta in metas:
        if meta.name not in shapes:
            raise InvalidArgumentError(
                f"tensor {meta.name!r} is not a parameter of the server's model checkpoint"
            )
        if tuple(meta.shape) != shapes[meta.name]:
            raise InvalidArgumentError(
                f"tensor {meta.name!r} has shape {list(meta.shape)}, the server's model "
                f"{list(shapes[meta.name])}"
            )


class CheckpointShapes:
    """The server's model checkpoint as updates are checked against it: the shapes of the
    rollout config's `model_path`, read on the first check."""

    def __init__(self, model_path: str) -> None:
        self._model_path = model_path
        self._shapes: dict[str, tuple[int, ...]] | None = None  # {}: not a local folder

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor that the checkpoint (when
        `model_path` is a local folder) lacks or has in another shape; with no local
        checkpoint the server's own load checks them."""
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self._model_path) or {}
        if self._shapes:
            check_against_checkpoint(metas, self._shapes)


def check_not_older(policy_version: int, loaded_version: int) -> None:
    """Raises FailedPreconditionError for an update older than the weights loaded."""
    if policy_version < loaded_version:
        raise FailedPreconditionError(
            f"policy_version {policy_version} is older than the loaded version {loaded_version}"
        )


def write_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]], model_path: str, folder: Path
) -> None:
    """The update as `folder/model.safetensors`, with the model's config files beside it."""
    tensors = {name: tensor.contiguous() for name, tensor in named_tensors}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name in CONFIG_FILES:
        source = Path(model_path) / name
        if source.is_file():
            shutil.copyfile(source, folder / name)


def write_adapter(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    adapter: LoraAdapter,
    model_path: str,
    folder: Path,
) -> None:
    """The adapter as peft saves one (`PeftModel.save_pretrained`): `folder/adapter_config.json`
    and `folder/adapter_model.safetensors`, its tensors under peft's saved names."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_path,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: tensor.contiguous() for name, tensor in named_tensors}
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
