"""LoRA adapters (`trainer.lora`) on a transformers model, by peft's `inject_adapter_in_model`:
the model keeps its class and its module names, each targeted linear layer becomes a peft
`LoraLayer` holding the frozen layer as `base_layer` and the adapters as `lora_A.default` and
`lora_B.default`, the only parameters left trainable.

What leaves the trainer uses other names: the merged weights (`merge_adapters`) the plain
Hugging Face names of the base model, the adapters (`adapter_state`, `save_adapter`) the names
of the files peft's `PeftModel.save_pretrained` writes.
"""

import contextlib
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from torch import Tensor

from trainer_svc.config import LoraSettings
from turnrl.weights import PEFT_PREFIX

ADAPTER = "default"  # peft's name of the one adapter
# Every adapter's initial weights are drawn from this seed and its name (`initial_adapters`).
ADAPTER_INIT_SEED = 0
# peft's init_lora_weights for each `trainer.lora.init`.
INIT_LORA_WEIGHTS = {"default": True, "gaussian": "gaussian"}


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's linear layers but its output head, by module name."""
    output = model.get_output_embeddings()
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }


def adapter_target_modules(model: torch.nn.Module, lora: LoraSettings) -> list[str]:
    """The last parts of the names of the linear layers `lora.target_modules` selects, sorted:
    all of them for 'all-linear'. Raises ValueError naming `trainer.lora.target_modules` when
    it selects none, and `trainer.lora.rank` when the rank exceeds a targeted layer's smaller
    side."""
    layers = linear_layers(model)
    suffixes = {name.rsplit(".", 1)[-1] for name in layers}
    wanted = suffixes if "all-linear" in lora.target_modules else set(lora.target_modules)
    targets = sorted(suffixes & wanted)
    if not targets:
        raise ValueError(
            f"trainer.lora.target_modules={lora.target_modules} matches no linear layer of the "
            f"model; its linear layers end in {sorted(suffixes)} (or use 'all-linear')"
        )
    for name, layer in layers.items():
        smaller_side = min(layer.in_features, layer.out_features)
        if name.rsplit(".", 1)[-1] in targets and lora.rank > smaller_side:
            raise ValueError(
                f"trainer.lora.rank={lora.rank} exceeds the smaller side ({smaller_side}) of "
                f"the targeted layer {name} ({layer.in_features} in, {layer.out_features} out)"
            )
    return targets


def lora_config(
    lora: LoraSettings, targets: list[str], base_model: str | None = None
) -> LoraConfig:
    """peft's config of the adapters on the layers ending in `targets`."""
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        init_lora_weights=INIT_LORA_WEIGHTS[lora.init],
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def add_lora_adapters(model: torch.nn.Module, lora: LoraSettings) -> list[str]:
    """Puts adapters on the layers `lora` targets (checked by `adapter_target_modules`) in
    place and freezes every other parameter; returns the targets. The initial weights come
    from `initial_adapters`, which the caller sets (on a model whose base is empty, on the
    meta device, the adapters are empty too); peft's own draws leave the caller's RNG state
    as it was."""
    targets = adapter_target_modules(model, lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ADAPTER_INIT_SEED)
        inject_adapter_in_model(lora_config(lora, targets), model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    return targets


def initial_adapters(model: torch.nn.Module, lora: LoraSettings) -> dict[str, Tensor]:
    """Each adapter's initial weights, drawn for its name alone (a generator seeded from
    ADAPTER_INIT_SEED and the name): equal on every rank, and whether the model was loaded
    whole or empty (`sharded_load`), where peft's own draws would follow the RNG. Drawn as
    peft draws them: A kaiming-uniform (`trainer.lora.init` default) or normal with std
    1 / rank (gaussian), B zero, so that the adapted model starts as its base."""
    values = {}
    for name, parameter in model.named_parameters():
        if ".lora_" not in name:
            continue
        value = values[name] = torch.zeros(parameter.shape)
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(ADAPTER_INIT_SEED + zlib.crc32(name.encode()))
            if lora.init == "gaussian":
                value.normal_(0.0, 1.0 / lora.rank, generator=generator)
            else:
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return values


def unadapted_name(name: str) -> str:
    """A parameter's name in the base model: an adapted layer's frozen weight is its
    `base_layer`'s."""
    return name.replace(".base_layer.", ".")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter switched off, on again after."""
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_adapters(state: dict[str, Tensor], lora: LoraSettings) -> dict[str, Tensor]:
    """The model state `state` (with adapters) as the base model's, under its Hugging Face
    names: each adapted layer's weight W + (alpha / rank) B A, no adapter entries. New tensors
    where merged; the others are `state`'s."""
    scaling = lora.alpha / lora.rank
    merged = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        layer, _, kind = name.rpartition(".base_layer.")
        if not layer:
            merged[name] = tensor
        elif kind == "weight":
            down = state[f"{layer}.lora_A.{ADAPTER}.weight"]
            up = state[f"{layer}.lora_B.{ADAPTER}.weight"]
            merged[f"{layer}.weight"] = tensor + scaling * (up @ down).to(tensor.dtype)
        else:  # the base layer's bias
            merged[f"{layer}.{kind}"] = tensor
    return merged


def unadapted_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model state `state` (with adapters) as the base model's, under its Hugging Face
    names, with the adapters left out: the frozen weights pushed adapters apply to."""
    return {unadapted_name(name): tensor for name, tensor in state.items() if ".lora_" not in name}


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of the model state `state` under the names peft's
    `PeftModel.save_pretrained` gives them, detached copies on CPU."""
    return {
        PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): tensor.detach().to("cpu", copy=True)
        for name, tensor in state.items()
        if ".lora_" in name
    }


def save_adapter(
    folder: Path, adapters: dict[str, Tensor], lora: LoraSettings, targets: list[str], base: str
) -> None:
    """Writes `adapters` (`adapter_state`'s names) as peft does: adapter_config.json naming the
    base model `base`, and adapter_model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    lora_config(lora, targets, base_model=base).save_pretrained(str(folder))
    save_file(adapters, folder / "adapter_model.safetensors", metadata={"format": "pt"})
