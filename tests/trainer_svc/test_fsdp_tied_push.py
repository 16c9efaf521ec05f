"""A tied model's push from the trainer (the tiny model's output layer is its input embedding):
under FSDP2, whose full state dict gathers `lm_head.weight` and `model.embed_tokens.weight` into
two tensors, as in a plain process, the shared tensor travels once under the checkpoint's name:
the name the SGLang and vLLM engines check updates against (the checkpoint's tensors), and an
hf replica ends up with the new weights in both its embedding and its output layer."""

from pathlib import Path

import pytest
import torch

from rollout_svc.engines.server_weights import check_against_checkpoint, checkpoint_shapes
from tests.rollout_svc.test_rollout_service import rollout_server
from tests.trainer_svc.test_weight_push import (
    DEAD_ADDRESS,
    assert_sampled_by,
    connected,
    load,
    sample,
)
from tests.trainer_svc.two_ranks import run_on_two_ranks
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from turnrl.weights import BucketedWeights

WORKER = Path(__file__).with_name("fsdp_push_worker.py")
WORKER_TIMEOUT_SECONDS = 180
BUCKET_SIZE_BYTES = 64 * 1024


def fsdp_push(model_dir: Path, out_file: Path) -> list[tuple[str, torch.Tensor]]:
    """What a 2-rank FSDP2 trainer of `model_dir` pushes (fsdp_push_worker.py)."""
    run_on_two_ranks(WORKER, model_dir, out_file, timeout_seconds=WORKER_TIMEOUT_SECONDS)
    return torch.load(out_file, weights_only=False)


def plain_push(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """What a one-process trainer of `model_dir` pushes."""
    weights = FsdpPolicy(model_dir, TrainSettings()).full_weights(BUCKET_SIZE_BYTES)
    return [(name, tensor.clone()) for name, tensor in weights.named_tensors()]


@pytest.mark.parametrize("path", ["fsdp", "plain"])
async def test_a_tied_model_pushes_its_shared_tensor_once_under_the_checkpoint_name(
    tiny_model_dir, tmp_path, path
):
    new = load(tiny_model_dir, noise_seed=6)
    assert new.lm_head.weight is new.model.embed_tokens.weight
    new.save_pretrained(tmp_path / "new")
    pushed = (
        fsdp_push(tmp_path / "new", tmp_path / "pushed.pt")
        if path == "fsdp"
        else plain_push(tmp_path / "new")
    )

    names = [name for name, _ in pushed]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(list(new.parameters()))
    expected = dict(new.named_parameters())
    for name, tensor in pushed:
        assert torch.equal(tensor, expected[name]), name
    # A model with the new embedding but the old output layer: what a receiver that missed the
    # output layer would serve.
    stale_head = load(tmp_path / "new")
    stale_head.config.tie_word_embeddings = False
    stale_head.lm_head.weight = torch.nn.Parameter(load(tiny_model_dir).lm_head.weight.clone())
    weights = BucketedWeights.pack(pushed, BUCKET_SIZE_BYTES)
    check_against_checkpoint(weights.metas, checkpoint_shapes(str(tiny_model_dir)))
    async with (
        rollout_server(tiny_model_dir, DEAD_ADDRESS, DEAD_ADDRESS) as hf,
        connected([hf], "broadcast") as pusher,
    ):
        assert (await pusher.push(weights, 1)).policy_versions == [1]
        assert_sampled_by(await sample(hf), new, stale_head, policy_version=1)
