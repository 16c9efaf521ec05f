"""One rank of test_ranks' forward passes on 2 ranks, started as a launcher starts a rank, with
the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and no torchrun:

    python -m tests.trainer_svc.forward_worker MODEL_DIR REFERENCE_DIR CRITIC_DIR OUT_DIR

For each batch of `BATCHES`, `update_inputs` with a policy, a reference and a critic, and the
rows each model's forward was given, go into OUT_DIR/rank{RANK}.pt; test_ranks compares them
with `update_inputs` in one process.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch
from trainer_svc.config import AlgorithmConfig
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, exit_without_finalizing
from trainer_svc.rl_step import RolloutBatch, kl_reference, prepare_update

# Rows of `fixed_batch()`: 7, not divisible by 2 ranks, and 1, fewer than the ranks.
BATCHES = {"seven rows": list(range(7)), "one row": [3]}
# Every forward pass of an update: the policy's, the reference's (in the reward) and the critic's.
GAE_WITH_KL = AlgorithmConfig(
    advantage_estimator="gae", gae_lambda=0.9, kl_coef=0.1, kl_in_reward=True
)


def update_inputs(models: Models, rows: list[int]) -> dict:
    """`prepare_update` on `fixed_batch()`'s `rows` as one step's rollouts (rewards 1, 0, 1, ...):
    its metrics and the batch's extras, with the policy's logprobs and entropy besides."""
    batch = fixed_batch().select(rows, torch.device("cpu"))
    batch.extras["rollout_logprobs"] = -batch.loss_mask.float()
    rewards = torch.tensor([float(index % 2 == 0) for index in range(len(rows))])
    rollouts = RolloutBatch(batch, rewards, torch.arange(len(rows)) // 2, trajectories=[])
    reference_logprobs = kl_reference(models, GAE_WITH_KL)
    metrics = prepare_update(
        rollouts, models.policy, reference_logprobs, models.critic, GAE_WITH_KL
    )
    logprobs, entropy = models.policy.logprobs(batch, with_entropy=True)
    return {"metrics": metrics, **batch.extras, "logprobs": logprobs, "entropy": entropy}


def record_rows(model: nn.Module) -> list[tuple[int, ...]]:
    """Filled with the tokens of each row `model`'s forward is given, padding left out."""
    rows = []

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        pairs = zip(kwargs["input_ids"], kwargs["attention_mask"].bool(), strict=True)
        rows.extend(tuple(ids[real].tolist()) for ids, real in pairs)

    model.register_forward_pre_hook(record, with_kwargs=True)
    return rows


def main(model_dir: str, reference_dir: str, critic_dir: str, out_dir: str) -> None:
    models = Models(
        policy=FsdpPolicy(model_dir, SETTINGS),
        reference=FsdpPolicy(reference_dir, SETTINGS),
        critic=FsdpCritic(critic_dir, SETTINGS),
    )
    seen = {
        name: record_rows(getattr(models, name).model) for name in ("policy", "reference", "critic")
    }
    results = {}
    for batch_name, rows in BATCHES.items():
        results[batch_name] = update_inputs(models, rows)
        results[batch_name]["seen"] = {name: list(tokens) for name, tokens in seen.items()}
        for tokens in seen.values():
            tokens.clear()
    torch.save(results, Path(out_dir) / f"rank{models.policy.rank}.pt")
    models.policy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
