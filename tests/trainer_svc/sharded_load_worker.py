"""One rank of test_sharded_load's 2-rank run.

    torchrun --standalone --nproc-per-node 2 tests/trainer_svc/sharded_load_worker.py \
        TEXT_MODEL_DIR VISION_MODEL_DIR OUT_DIR

Each rank loads the policy and the critic of TEXT_MODEL_DIR and the policy of
VISION_MODEL_DIR, each from its rows of the files only (trainer_svc/sharded_load.py); rank 0
saves their gathered weights, and whether every parameter was sharded, into OUT_DIR/rank0.pt.
The text policy is also exported in files of at most 64 KiB into OUT_DIR/export, gathering
one tensor at a time (trainer_svc/hf_export.py).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from tests.trainer_svc.fsdp_worker import SETTINGS
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FULL_ON_CPU, FsdpPolicy
from trainer_svc.hf_export import checkpoint_names, export_streaming, tied_aliases
from trainer_svc.ranks import exit_without_finalizing

EXPORT_FILE_BYTES = 64 * 1024


def main(text_model_dir: str, vision_model_dir: str, out_dir: str) -> None:
    policy = FsdpPolicy(text_model_dir, SETTINGS)
    critic = FsdpCritic(text_model_dir, SETTINGS)
    vision = FsdpPolicy(vision_model_dir, SETTINGS)
    models = (policy.model, critic.model, vision.model)
    sharded = all(isinstance(p, DTensor) for model in models for p in model.parameters())
    policy_state = policy.full_state_dict()
    critic_state = get_model_state_dict(critic.model, options=FULL_ON_CPU)
    vision_state = vision.full_state_dict()
    state = {
        n: t for n, t in policy.model.state_dict().items() if n not in tied_aliases(policy.model)
    }
    renamed = checkpoint_names(policy.model, list(state))
    export_streaming(policy.model, state, Path(out_dir) / "export", renamed, EXPORT_FILE_BYTES)
    if policy.rank == 0:
        results = {"sharded": sharded, "policy": policy_state, "critic": critic_state}
        torch.save({**results, "vision": vision_state}, Path(out_dir) / "rank0.pt")
    dist.barrier()  # no rank leaves the group while another still works (gloo aborts)
    policy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
