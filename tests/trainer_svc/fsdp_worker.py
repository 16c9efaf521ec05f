"""One rank of test_fsdp's 2-rank run; also the batch, settings and loss the test shares with it.

    torchrun --standalone --nproc-per-node 2 tests/trainer_svc/fsdp_worker.py \
        MODEL_DIR CHECKPOINT OUT_DIR

Rank r trains on rows r, r + 2, ... of `fixed_batch()`: the whole batch's logprobs before
training (each rank forwards its own rows), the first step's gradients, the weights after 3
steps (checkpointed, each rank its shards, in OUT_DIR/run), its weights after loading the
checkpoint folder CHECKPOINT (written by one process after 2 steps) and stepping once more
(checkpointed in the background while one more step trains, in OUT_DIR/background), a bf16 step with activation checkpointing, and the logprobs, first
gradients and metrics of `grouped_batch()` (prefixes computed once per group), all go into
OUT_DIR/rank0.pt (rank 0); the model after 3 steps is also exported to OUT_DIR/hf.
"""

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from trainer_svc.batch import Batch
from trainer_svc.checkpoint import (
    CHECKPOINTS,
    SHARDS_FOLDER,
    CheckpointState,
    checkpoint_name,
    finish_checkpoint,
    new_staging_folder,
)
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, exit_without_finalizing, restore, save_checkpoint_shards

# Small enough for several micro-batches per rank, and a different count on each rank.
SETTINGS = TrainSettings(learning_rate=1e-3, grad_clip=0.5, micro_batch_tokens=24)
STEPS = 3


def fixed_batch() -> Batch:
    """Seven rows of 3 to 16 random tokens (vocabulary 256); the loss covers each row's tail."""
    generator = torch.Generator().manual_seed(0)
    lengths = [16, 3, 9, 12, 5, 16, 7]
    token_ids = [torch.randint(256, (n,), generator=generator).tolist() for n in lengths]
    loss_masks = [[i >= n // 3 for i in range(n)] for n in lengths]
    advantages = [[float(torch.randn(1, generator=generator))] * n for n in lengths]
    return Batch.from_sequences(token_ids, loss_masks, {"advantages": advantages}, pad_token_id=0)


def grouped_batch() -> Batch:
    """GRPO-like rows: three prompts (a 6-token system prompt they share, then 9, 5 and 12
    random tokens) of three samples each, whose responses of 1 to 8 tokens are the loss; the
    first prompt's samples all begin with the same two tokens. Then a group of one with the
    system prompt, and a group whose rows differ from their first token."""
    generator = torch.Generator().manual_seed(1)

    def tokens(count: int) -> list[int]:
        return torch.randint(256, (count,), generator=generator).tolist()

    system = tokens(6)
    token_ids, loss_masks, groups = [], [], []
    for group, (prompt_length, response_lengths) in enumerate(
        [(9, [3, 8, 5]), (5, [1, 6, 2]), (12, [4, 4, 7]), (6, [5])]
    ):
        prompt = system + tokens(prompt_length)
        prompt_length += len(system)
        opening = tokens(2)
        for response_length in response_lengths:
            response = tokens(response_length)
            if group == 0:
                response[:2] = opening
            token_ids.append(prompt + response)
            loss_masks.append([False] * prompt_length + [True] * response_length)
            groups.append(group)
    for length in (7, 4):
        token_ids.append(tokens(length))
        loss_masks.append([False] + [True] * (length - 1))
        groups.append(4)
    advantages = [[float(torch.randn(1, generator=generator))] * len(row) for row in token_ids]
    return Batch.from_sequences(token_ids, loss_masks, {"advantages": advantages}, groups=groups)


def rank_rows(batch: Batch, rank: int, world_size: int) -> Batch:
    rows = list(range(rank, batch.input_ids.shape[0], world_size))
    return batch.select(rows, torch.device("cpu"))


def token_mean_loss(micro: Batch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
    """Policy-gradient loss, mean over all loss tokens of the step (a batch-global denominator)."""
    mask = micro.loss_mask
    per_token = -logprobs * micro.extras["advantages"] * mask
    mean_logprob = float((logprobs.detach() * mask).sum() / mask.sum().clamp(min=1))
    return per_token.sum() / micro.global_token_count, {"mean_logprob": mean_logprob}


def step_gradients(policy: FsdpPolicy) -> dict[str, torch.Tensor]:
    """Filled with the full gradients the optimizer applies at `policy`'s next step (collective
    under FSDP: every rank gathers them)."""
    gradients = {}

    def capture(optimizer, args, kwargs) -> None:
        for name, parameter in policy.model.named_parameters():
            gradient = parameter.grad
            gradients[name] = gradient.full_tensor() if isinstance(gradient, DTensor) else gradient
            gradients[name] = gradients[name].clone()
        handle.remove()

    handle = policy.optimizer.register_step_pre_hook(capture)
    return gradients


def write_checkpoint(
    models: Models, run_dir: Path, step: int, meanwhile: Callable[[], object] | None = None
) -> Path:
    """The run loop's checkpoint of `models` at `step`, in run_dir/checkpoints; collective
    under FSDP: rank 0 makes the folder, every rank writes its shards into it. With
    `meanwhile`, the shards are written in the background while it runs."""
    staging = [new_staging_folder(run_dir, step) if models.policy.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(staging, src=0)
    state = CheckpointState.now(step, {}, {"data_position": 0})
    plain, writing = save_checkpoint_shards(models, staging[0], meanwhile is not None)
    if meanwhile is not None:
        meanwhile()
        writing.result()
    state.tensors.update(plain)
    if models.policy.rank == 0:
        finish_checkpoint(staging[0], run_dir, state)
    if dist.is_initialized():
        dist.barrier()
    return run_dir / CHECKPOINTS / checkpoint_name(step)


def checkpoint_tensors(folder: Path, role: str = "policy", kind: str = "model") -> dict:
    """The tensors of `role`'s `kind` (model, optimizer) in the checkpoint `folder`, under
    their names there, as its shard files hold them (whole, when one process wrote it)."""
    prefix = f"{role}/{kind}/"
    tensors = {}
    for file in sorted((folder / SHARDS_FOLDER).glob("*.safetensors")):
        tensors |= {k[len(prefix) :]: t for k, t in load_file(file).items() if k.startswith(prefix)}
    return tensors


def main(model_dir: str, checkpoint: str, out_dir: str) -> None:
    policy = FsdpPolicy(model_dir, SETTINGS)
    logprobs, _ = policy.logprobs(fixed_batch())
    rows = rank_rows(fixed_batch(), policy.rank, policy.world_size)
    gradients = step_gradients(policy)
    metrics = [policy.train_step(rows, token_mean_loss) for _ in range(STEPS)]
    trained = policy.full_state_dict()
    pushed = policy.full_weights(bucket_size_bytes=4096)
    assert (pushed is None) == (policy.rank != 0)
    policy.save_pretrained(Path(out_dir) / "hf")
    write_checkpoint(Models(policy), Path(out_dir) / "run", STEPS)
    restore(Models(policy), Path(checkpoint))
    resumed_metrics = policy.train_step(rows, token_mean_loss)
    resumed = policy.full_state_dict()
    # Written in the background while the next step trains: the state it was taken at.
    stepping = partial(policy.train_step, rows, token_mean_loss)
    write_checkpoint(Models(policy), Path(out_dir) / "background", STEPS + 1, stepping)

    bf16_settings = SETTINGS.model_copy(
        update={"dtype": "bfloat16", "activation_checkpointing": True}
    )
    bf16_metrics = FsdpPolicy(model_dir, bf16_settings).train_step(rows, token_mean_loss)
    grouped = FsdpPolicy(model_dir, SETTINGS)
    grouped_logprobs, _ = grouped.logprobs(grouped_batch())
    grouped_gradients = step_gradients(grouped)
    grouped_rows = rank_rows(grouped_batch(), grouped.rank, grouped.world_size)
    grouped_metrics = grouped.train_step(grouped_rows, token_mean_loss)
    if policy.rank == 0:
        torch.save(
            {
                "logprobs": logprobs,
                "gradients": gradients,
                "metrics": metrics,
                "trained": trained,
                "pushed": {name: tensor.clone() for name, tensor in pushed.named_tensors()},
                "resumed_metrics": resumed_metrics,
                "resumed": resumed,
                "bf16_metrics": bf16_metrics,
                "grouped_logprobs": grouped_logprobs,
                "grouped_gradients": grouped_gradients,
                "grouped_metrics": grouped_metrics,
            },
            Path(out_dir) / "rank0.pt",
        )
    dist.barrier()  # no rank leaves the group while another still works (gloo aborts)
    policy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
