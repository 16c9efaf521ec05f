"""Each rank loads its rows of a model straight from the model's files (trainer_svc/
sharded_load.py), and a sharded model is exported gathering one tensor at a time
(trainer_svc/hf_export.py): on two ranks the weights are exactly those `from_pretrained`
loads whole (bf16 files split in several with an index, rows two ranks split unevenly, a
critic's new head, a vision-language model's renamed tensors), and the export loads back
equal under the files' own names. A folder missing a tensor is refused, naming it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Qwen3ForCausalLM,
)

from tests.trainer_svc.conftest import tiny_qwen3_config
from tests.trainer_svc.two_ranks import run_on_two_ranks
from trainer_svc.sharded_load import SAFETENSORS_INDEX, fill_shards, load_model
from turnrl.errors import ConfigError

WORKER = Path(__file__).with_name("sharded_load_worker.py")
WORKER_TIMEOUT_SECONDS = 180


@pytest.fixture(scope="module")
def split_bf16_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Qwen3 with an untied head and an odd vocabulary (rows two ranks split
    unevenly), saved in bf16 across several files with an index."""
    config = tiny_qwen3_config(vocab_size=301, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("split_bf16_qwen3")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    assert (folder / SAFETENSORS_INDEX).is_file()
    return folder


def whole(model_class: type, folder: Path) -> dict[str, torch.Tensor]:
    return model_class.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_two_ranks_load_their_rows_exactly_and_export_without_gathering(
    split_bf16_model_dir, zoom_model_dir, tmp_path
):
    run_on_two_ranks(
        WORKER,
        split_bf16_model_dir,
        zoom_model_dir,
        tmp_path,
        timeout_seconds=WORKER_TIMEOUT_SECONDS,
    )
    ranks = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert ranks["sharded"]
    expected = whole(AutoModelForCausalLM, split_bf16_model_dir)
    assert ranks["policy"].keys() == expected.keys()
    assert all(torch.equal(ranks["policy"][n], t) for n, t in expected.items())
    critic = ranks["critic"]
    assert torch.equal(critic["score.weight"], torch.zeros(1, 64)) and critic["score.bias"] == 0
    backbone = {n: t for n, t in expected.items() if n.startswith("model.")}
    assert all(torch.equal(critic[n], t) for n, t in backbone.items())
    vision = whole(AutoModelForImageTextToText, zoom_model_dir)
    assert ranks["vision"].keys() == vision.keys()
    assert all(torch.equal(ranks["vision"][n], t) for n, t in vision.items())

    export = tmp_path / "export"
    index = json.loads((export / SAFETENSORS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    original = json.loads((split_bf16_model_dir / SAFETENSORS_INDEX).read_text())
    assert index["weight_map"].keys() == original["weight_map"].keys()
    exported = whole(AutoModelForCausalLM, export)
    assert all(torch.equal(exported[n], t) for n, t in expected.items())
    written = load_file(export / files[0])
    assert all(tensor.dtype == torch.float32 for tensor in written.values())


def test_a_folder_missing_a_tensor_is_refused_naming_it(model_dir, tmp_path):
    config = AutoConfig.from_pretrained(model_dir)
    complete = load_model(AutoModelForCausalLM, model_dir, config, sharded=True)
    assert complete.missing == []
    fill_shards(complete.model, torch.device("cpu"), complete.files)
    expected = whole(AutoModelForCausalLM, model_dir)
    assert all(torch.equal(complete.model.state_dict()[n], t) for n, t in expected.items())

    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    partial = load_model(AutoModelForCausalLM, tmp_path, config, sharded=True)
    assert partial.missing == ["model.norm.weight"]
    with pytest.raises(
        ConfigError, match=r"lacks 1 of the model's tensors: \['model.norm.weight'\]"
    ):
        fill_shards(partial.model, torch.device("cpu"), partial.files)
