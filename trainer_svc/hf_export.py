"""A sharded model written in Hugging Face format without gathering it on one rank: its tensors
are gathered one at a time (every rank takes part in each), and rank 0 appends each to the
safetensors file it belongs in as it arrives, then drops it. The files' headers are written
first, from the tensors' shapes, which every rank knows without gathering anything.

The names written are the checkpoint's (transformers' renamings of the model class reverted,
as `save_pretrained` does: a Qwen2.5-VL's `model.language_model.layers.*` is written as
`model.layers.*`), the tied aliases left out; files of at most `max_file_bytes` (a tensor
larger than that gets a file of its own), with model.safetensors.index.json when there are
several, as `save_pretrained` names them.
"""

import contextlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming, apply_renamings

from trainer_svc.safetensors_io import safetensors_header, write_tensor
from trainer_svc.sharded_load import SAFETENSORS_FILE, SAFETENSORS_INDEX

# Files of a Hugging Face tokenizer folder that `save_pretrained` copies, when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# As transformers' own default before 5.0: files a Hub upload or a download resumes well.
MAX_FILE_BYTES = 5 * 2**30


def checkpoint_names(model: PreTrainedModel, names: list[str]) -> dict[str, str] | None:
    """Each of `names` (the model's) under the name its Hugging Face checkpoint gives it, as
    transformers' `revert_weight_conversion` renames them; None when transformers converts
    the model's tensors as it saves them beyond renaming."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # not loaded by from_pretrained: the class's own renamings
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    reverse = [conversion.reverse_transform() for conversion in conversions[::-1]]
    if not all(isinstance(conversion, WeightRenaming) for conversion in reverse):
        return None
    return {name: apply_renamings(name, reverse) for name in names}


def file_plan(sizes: dict[str, int], max_file_bytes: int) -> list[list[str]]:
    """The names of each file, in order: consecutive tensors up to `max_file_bytes` a file."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_file_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def whole(tensor: Tensor) -> Tensor:
    """The whole of `tensor`, gathered from every rank's shard under FSDP (collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def export_streaming(
    model: PreTrainedModel,
    state: dict[str, Tensor],
    folder: Path,
    renamed: dict[str, str],
    max_file_bytes: int = MAX_FILE_BYTES,
) -> None:
    """Writes `state` (the model's state dict: DTensor shards under FSDP) into `folder` as
    safetensors files under the names `renamed` gives, gathering one tensor at a time; rank 0
    writes, with the model's config and generation config. Collective."""
    writes = not dist.is_initialized() or dist.get_rank() == 0
    sizes = {name: tensor.numel() * tensor.dtype.itemsize for name, tensor in state.items()}
    plan = file_plan(sizes, max_file_bytes)
    file_names = [
        SAFETENSORS_FILE
        if len(plan) == 1
        else SAFETENSORS_FILE.replace(".safetensors", f"-{i:05d}-of-{len(plan):05d}.safetensors")
        for i in range(1, len(plan) + 1)
    ]
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
    for file_name, names in zip(file_names, plan, strict=True):
        header = {renamed[n]: (state[n].dtype, tuple(state[n].shape)) for n in names}
        with open(folder / file_name, "wb") if writes else contextlib.nullcontext() as file:
            if writes:
                file.write(safetensors_header(header))
            for name in names:
                tensor = whole(state[name])
                if writes:
                    write_tensor(file, tensor)
    if writes:
        if len(plan) > 1:
            weight_map = {
                renamed[name]: file_name
                for file_name, names in zip(file_names, plan, strict=True)
                for name in names
            }
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        model.config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """The names under which `model` holds a parameter it holds under an earlier name: a tied
    output layer (`lm_head.weight`, which is `model.embed_tokens.weight`). A push leaves them
    out. Hugging Face checkpoints keep the first name only, and so every engine loads that one:
    SGLang and vLLM check updates against the checkpoint, and vLLM's loader loads the first
    name it reaches. FSDP's full state dict gathers each name into a tensor of its own, so the
    tensors no longer show the tie; the model's parameters still do."""
    first_names: dict[int, str] = {}
    aliases = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first_names.setdefault(id(parameter), name) != name:
            aliases.add(name)
    return aliases


def copy_tokenizer_files(tokenizer_dir: str | Path | None, folder: str | Path) -> None:
    """Copies the Hugging Face tokenizer files `tokenizer_dir` has into `folder`."""
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy2(Path(tokenizer_dir) / name, Path(folder) / name)
