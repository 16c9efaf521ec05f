"""One rank of test_lora's 2-rank run:

    torchrun --standalone --nproc-per-node 2 tests/trainer_svc/lora_worker.py MODEL_DIR OUT_DIR

Rank r trains a LoRA policy on rows r, r + 2, ... of `fixed_batch()`; rank 0 writes the whole
batch's logprobs and reference logprobs before the step, the step's metrics, the adapters, the
merged weights and the checkpoint's model state after it into OUT_DIR/rank0.pt, with the count
of adapter tensors rank 1 got (none: only rank 0 receives them).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, rank_rows, token_mean_loss
from tests.trainer_svc.test_lora import LORA
from trainer_svc.checkpoint import model_checkpoint_state
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import exit_without_finalizing


def main(model_dir: str, out_dir: str) -> None:
    policy = FsdpPolicy(model_dir, SETTINGS, LORA)
    batch = fixed_batch()
    logprobs, _ = policy.logprobs(batch)
    reference = policy.reference_logprobs(batch)
    metrics = policy.train_step(rank_rows(batch, policy.rank, policy.world_size), token_mean_loss)
    adapters = policy.adapter_state_dict()
    merged = policy.full_state_dict()
    checkpoint = model_checkpoint_state(policy)[0]["model"]
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(policy.world_size)]
    dist.all_gather(counts, torch.tensor([len(adapters)]))
    if policy.rank == 0:
        results = {
            "logprobs": logprobs,
            "reference": reference,
            "metrics": metrics,
            "adapters": adapters,
            "merged": merged,
            "checkpoint": checkpoint,
            "other_rank_adapters": int(counts[1]),
        }
        torch.save(results, Path(out_dir) / "rank0.pt")
    dist.barrier()  # no rank leaves the group while another still works (gloo aborts)
    policy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
