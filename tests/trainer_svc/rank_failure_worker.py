"""One rank of test_ranks' failing calls on 2 ranks, started as a launcher starts a rank (the
env:// variables, no torchrun):

    python -m tests.trainer_svc.rank_failure_worker MODEL_DIR OUT_FILE

Rank 0 builds a policy on every rank and runs a train step whose loss raises on rank 1 (out of
memory on its share, as it were): rank 0 is then in the step's collectives, waiting for rank
1. Then one that raises on rank 0, with rank 1 waiting; then, with models built again, a step
that fails nowhere. What each call raised, and after how long, goes into OUT_FILE as JSON. The
other ranks follow.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, rank_rows, token_mean_loss
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, Ranks, exit_without_finalizing


def policy_models(model_dir: str) -> Models:
    return Models(policy=FsdpPolicy(model_dir, SETTINGS))


def train_step(models: Models, failing_rank: int | None) -> dict[str, float]:
    """A train step on this rank's rows whose loss raises MemoryError on `failing_rank`."""
    policy = models.policy

    def loss_fn(micro, logprobs, entropy):
        if policy.rank == failing_rank:
            raise MemoryError(f"out of memory on rank {failing_rank}'s share")
        return token_mean_loss(micro, logprobs, entropy)

    return policy.train_step(rank_rows(fixed_batch(), policy.rank, policy.world_size), loss_fn)


async def drive(ranks: Ranks, model_dir: str) -> dict:
    results = {}
    for failing_rank in (1, 0):
        await ranks.build(policy_models, model_dir)
        started = time.monotonic()
        try:
            await ranks.run(train_step, failing_rank)
        except Exception as error:  # what the test looks at
            results[f"failing on rank {failing_rank}"] = {
                "error": f"{type(error).__name__}: {error}",
                "seconds": time.monotonic() - started,
            }
    await ranks.build(policy_models, model_dir)
    results["after"] = await ranks.run(train_step, None)
    await ranks.close()
    return results


def main(model_dir: str, out_file: str) -> None:
    ranks = Ranks()
    if ranks.rank == 0:
        Path(out_file).write_text(json.dumps(asyncio.run(drive(ranks, model_dir))))
    else:
        ranks.follow()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
