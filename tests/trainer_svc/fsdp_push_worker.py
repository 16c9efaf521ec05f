"""One rank of test_fsdp_tied_push's 2-rank run: the policy in MODEL_DIR under FSDP2 gathers its
weights for a push (`FsdpPolicy.full_weights`), and rank 0 saves what the push would send, as
(name, tensor) pairs in push order, to OUT_FILE.

    torchrun --standalone --nproc-per-node 2 tests/trainer_svc/fsdp_push_worker.py \
        MODEL_DIR OUT_FILE
"""

import sys

import torch

from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import exit_without_finalizing

BUCKET_SIZE_BYTES = 64 * 1024


def main(model_dir: str, out_file: str) -> None:
    policy = FsdpPolicy(model_dir, TrainSettings())
    assert policy.is_sharded and policy.world_size == 2
    weights = policy.full_weights(BUCKET_SIZE_BYTES)
    if policy.rank == 0:
        torch.save([(name, t.clone()) for name, t in weights.named_tensors()], out_file)
    policy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
