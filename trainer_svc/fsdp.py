"""The trainer's model back end: transformers models under FSDP2, their forward passes and train
steps, on `Batch`es cut into micro-batches (trainer_svc/batch.py). `FsdpModel` holds what every
trained model needs (sharding, AdamW, LR schedule, micro-batches, the step, checkpoint state);
`FsdpPolicy` is the causal LM and its logprobs; `trainer_svc.critic.FsdpCritic` is the value
model.

Launched as several ranks (by torchrun, or by a launcher that starts each rank itself with the
env:// variables), every rank holds a shard of the model, from `fully_shard` on each decoder
layer and then the root, as torchtitan's `apply_fsdp_to_decoder` does; in a plain single
process the model stays whole, with no process group. Every method that touches the model
is collective under FSDP: all ranks call it, in the same order.

Data parallelism: each rank passes its own rows to `train_step`, and a step equals one step on
all ranks' rows together when the loss is normalised by counts over all of them: `train_step`
puts those counts on every micro-batch, and makes FSDP's mean of the ranks' gradients a sum.
Forward passes without gradients (`FsdpPolicy.logprobs`, `FsdpCritic.values`) take the whole
batch instead, the same on every rank: each rank runs the forward of its share of the rows
only, and every rank gets the whole batch's outputs back (`FsdpModel._per_token`).

The loss_fn contract of `train_step`:

    FsdpPolicy:  loss_fn(micro: Batch, logprobs: Tensor, entropy: Tensor | None) -> (loss, metrics)
    FsdpCritic:  loss_fn(micro: Batch, values: Tensor) -> (loss, metrics)

`micro` holds some rows of this rank's batch, trimmed to its longest row; `logprobs`,
`entropy` and `values` are (rows, length) and carry gradients. `loss` is this micro-batch's
share of the whole step's loss: its sum over the micro-batch divided by batch-global counts
(`micro.global_token_count`, `micro.global_sequence_count`), never by micro-batch counts, so
the shares add up to the full-batch loss. `metrics` are this micro-batch's means (e.g. a clip
fraction over its loss tokens); the step reports them weighted by loss tokens.
"""

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PreTrainedModel

from trainer_svc.batch import (
    Batch,
    micro_batch_rows,
    packed_micro_batch_rows,
    shared_prefix_micro_batch_rows,
)
from trainer_svc.config import LoraSettings, TrainSettings
from trainer_svc.forward import (
    can_share_prefixes,
    packed_logprobs,
    prefix_levels,
    shared_prefix_logprobs,
    whole_row_logprobs,
)
from trainer_svc.hf_export import (
    checkpoint_names,
    copy_tokenizer_files,
    export_streaming,
    tied_aliases,
)
from trainer_svc.lora import (
    adapter_state,
    adapters_disabled,
    add_lora_adapters,
    initial_adapters,
    merge_adapters,
    save_adapter,
    unadapted_name,
    unadapted_state,
)
from trainer_svc.sharded_load import LoadedModel, fill_shards, load_model
from turnrl.vision import is_vision_model, model_class
from turnrl.weights import BucketedWeights

# Full, unsharded tensors on CPU; under FSDP only rank 0 receives them.
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


LossFn = Callable[[Batch, Tensor, Tensor | None], tuple[Tensor, dict[str, float]]]


def distributed_backend() -> str:
    """The collectives' backend: nccl on GPU, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed() -> tuple[int, int]:
    """Joins the process group of the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) when WORLD_SIZE > 1, gloo on CPU and nccl on GPU; returns (rank, world_size).
    torchrun sets them for each rank it starts, and so does a launcher that starts each rank
    itself, on any machine.

    In a plain single process, or with a group already made, it makes none: (0, 1) or the
    group's.
    """
    if joins_process_group() and not dist.is_initialized():
        dist.init_process_group(distributed_backend(), init_method="env://")
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def joins_process_group() -> bool:
    """Whether `init_distributed` makes or finds a process group: whether models are sharded."""
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def apply_fsdp(model: PreTrainedModel, mesh: DeviceMesh, settings: TrainSettings) -> None:
    """Shards each decoder layer, then the root (embeddings, final norm, head) over `mesh`.

    Layers reshard after forward (parameters are gathered again for backward): memory over
    traffic, as torchtitan does by default. Gradients are averaged across ranks.
    """
    mp_policy = MixedPrecisionPolicy()
    if settings.dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in sharded_blocks(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def sharded_blocks(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The blocks `apply_fsdp` shards one by one: the decoder layers, and a vision-language
    model's vision blocks too."""
    inner = model.model
    if not is_vision_model(model):
        return list(inner.layers)
    return [*inner.language_model.layers, *inner.visual.blocks]


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Learning rate of optimizer step `step` (from 0) as a fraction of the peak."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return 1.0
    if settings.total_steps == 0:
        raise ValueError("a cosine schedule needs total_steps; it is 0")
    decay_steps = settings.total_steps - settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine


class FsdpModel:
    """A transformers model with AdamW and its LR schedule, sharded over several ranks: what the
    policy and the critic share. Subclasses load the model and define its forward pass.

    Under FSDP the model arrives empty where its files allow (`trainer_svc.sharded_load`):
    each rank loads its shard of it only, once sharded. Parameters its checkpoint lacks take
    their values from `fresh` (a critic's new head), whole tensors.
    """

    def __init__(
        self, loaded: LoadedModel, settings: TrainSettings, fresh: dict[str, Tensor] | None = None
    ) -> None:
        model = loaded.model
        self.settings = settings
        # Whether forwards compute a group's shared prefix once (`trainer_svc.forward`): the
        # policy's, where the settings and the model allow.
        self.shares_prefixes = False
        joined_a_group = dist.is_initialized()
        self.rank, self.world_size = init_distributed()
        self.is_sharded = dist.is_initialized()
        self._owns_process_group = self.is_sharded and not joined_a_group
        self.device = torch.device("cpu")
        if torch.cuda.is_available():  # the node's GPU of LOCAL_RANK
            self.device = torch.device("cuda", dist.get_node_local_rank(fallback_rank=0))
            torch.cuda.set_device(self.device)
        if settings.activation_checkpointing:
            # transformers checkpoints each layer's `forward`, inside FSDP2's hooks, so the
            # recompute runs on the parameters FSDP gathers for the backward pass anyway.
            model.activation_checkpointing_enable({"use_reentrant": False})
        if loaded.files is None:
            with torch.no_grad():
                for name, tensor in (fresh or {}).items():
                    model.get_parameter(name).copy_(tensor)
            model.to(self.device)
        if self.is_sharded:
            apply_fsdp(model, init_device_mesh(self.device.type, (self.world_size,)), settings)
        if loaded.files is not None:
            fill_shards(model, self.device, loaded.files, fresh)
        self.model = model
        # All of the model's parameters but frozen ones (a LoRA policy's base weights).
        self.trainable_parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters,
            lr=settings.learning_rate,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, settings=settings)
        )

    def close(self) -> None:
        """Leaves the process group, if this model made it."""
        if self._owns_process_group:
            dist.destroy_process_group()
            self._owns_process_group = False

    def _per_token(
        self, batch: Batch, forward: Callable[[Batch], tuple[Tensor | None, ...]]
    ) -> list[Tensor | None]:
        """`forward`'s (rows, length) outputs on the whole `batch`, without gradients, as
        (rows, length) tensors like the batch, on the batch's device; an output `forward` gives
        as None stays None.

        On several ranks every rank passes the same batch and runs `forward` on its share of
        the rows only: every world_size-th row from its rank, as `ranks.share_of` splits a
        train step's rows. The shares' outputs are then gathered, so every rank gets the whole.
        """
        if self.world_size == 1:
            return self._micro_batch_outputs(batch, forward)
        rows = list(range(batch.input_ids.shape[0]))
        mine = rows[self.rank :: self.world_size]
        # Where rows are fewer than ranks, a rank without one forwards row 0 and drops its
        # outputs: each forward gathers parameters with all ranks.
        share = batch.select(mine or rows[:1], batch.input_ids.device)
        outputs = self._micro_batch_outputs(share, forward)
        return [
            None if part is None else self._gather_shares(part[: len(mine)], batch.input_ids.shape)
            for part in outputs
        ]

    def _micro_batch_outputs(
        self, batch: Batch, forward: Callable[[Batch], tuple[Tensor | None, ...]]
    ) -> list[Tensor | None]:
        """`forward`'s outputs on every micro-batch of `batch` (this rank's rows), without
        gradients, put back together as (rows, length) tensors like it, on its device."""
        self.model.eval()
        outputs: list[Tensor | None] = []
        with torch.no_grad():
            for rows, micro, _ in self._micro_batches(batch):
                micro_outputs = forward(micro)
                if not outputs:
                    outputs = [
                        None
                        if part is None
                        else torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
                        for part in micro_outputs
                    ]
                length = micro.input_ids.shape[1]
                for whole, part in zip(outputs, micro_outputs, strict=True):
                    if whole is not None:
                        whole[rows, :length] = part.to(whole.device)
        return outputs

    def _gather_shares(self, share: Tensor, shape: torch.Size) -> Tensor:
        """The (rows, length) = `shape` tensor of the whole batch, on `share`'s device, from each
        rank's `share` of it (`_per_token`'s split: rank r's j-th row is row j * world_size + r),
        all-gathered on the default group after padding each share to ceil(rows / world_size)
        rows of the full length."""
        rows, length = shape
        most_rows = -(-rows // self.world_size)
        padded = torch.zeros(most_rows, length, dtype=share.dtype, device=self.device)
        padded[: share.shape[0], : share.shape[1]] = share
        shares = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(shares, padded)
        # Stacked as (j, rank), row j * world_size + rank sits at that flat index; the padding
        # rows, at indices past the last row, drop off the end.
        return torch.stack(shares, dim=1).flatten(0, 1)[:rows].to(share.device)

    def _train_step(
        self, batch: Batch, micro_loss: Callable[[Batch], tuple[Tensor, dict[str, float]]]
    ) -> dict[str, float]:
        """One optimizer step on this rank's `batch`; `micro_loss` runs the forward pass and the
        loss_fn of one micro-batch (see the module docstring).

        Returns the step's metrics, equal on all ranks: `loss` (the full-batch loss), the
        pre-clip `grad_norm`, the `lr` used, and loss_fn's metrics weighted by loss tokens. A
        non-finite gradient norm skips the update.
        """
        self.model.train()
        # A row without loss tokens (a rank's filler share) is no sequence of the loss.
        token_count, sequence_count = self._sum_over_ranks(
            [float(batch.loss_mask.sum()), float(batch.loss_mask.any(1).sum())]
        )
        batch = replace(
            batch, global_token_count=int(token_count), global_sequence_count=int(sequence_count)
        )
        loss_total, token_weight, weighted = 0.0, 0.0, {}
        for _, micro, is_filler in self._micro_batches(batch):
            loss, metrics = micro_loss(micro)
            if is_filler:
                loss = loss * 0.0
            # FSDP averages gradients over ranks; these shares are of all ranks' batch, so
            # scaling by the world size turns that average into the sum.
            (loss * self.world_size).backward()
            loss_total += float(loss.detach())
            weight = 0.0 if is_filler else float(micro.loss_mask.sum())
            token_weight += weight
            for name, value in metrics.items():
                weighted[name] = weighted.get(name, 0.0) + value * weight
        names = sorted(weighted)
        loss_total, token_weight, *totals = self._sum_over_ranks(
            [loss_total, token_weight, *(weighted[name] for name in names)]
        )

        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.trainable_parameters, self.settings.grad_clip
        )
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        metrics = {
            name: total / max(token_weight, 1.0) for name, total in zip(names, totals, strict=True)
        }
        return {**metrics, "loss": loss_total, "grad_norm": grad_norm, "lr": lr}

    def _micro_batches(self, batch: Batch) -> Iterator[tuple[list[int], Batch, bool]]:
        """(rows, micro-batch, is_filler) in order. Under FSDP every rank runs as many
        micro-batches as the rank with most, since each forward gathers parameters with all of
        them: a rank with fewer repeats its last one as a filler, whose loss counts zero."""
        lengths = batch.attention_mask.sum(1)
        budget = self.settings.micro_batch_tokens
        if self.shares_prefixes and batch.groups is not None:
            levels = prefix_levels(batch.input_ids, lengths, batch.groups)
            groups = shared_prefix_micro_batch_rows(levels, budget)
        elif self.packs(batch):
            groups = packed_micro_batch_rows(lengths.tolist(), budget)
        else:
            groups = micro_batch_rows(lengths.tolist(), budget)
        count = len(groups)
        if self.is_sharded:
            count_tensor = torch.tensor(count, device=self.device)
            dist.all_reduce(count_tensor, op=dist.ReduceOp.MAX)
            count = int(count_tensor)
        for index in range(count):
            rows = groups[min(index, len(groups) - 1)]
            yield rows, batch.select(rows, self.device), index >= len(groups)

    def packs(self, batch: Batch) -> bool:
        """Whether `batch`'s micro-batches are forwarded packed (`forward.packed_forward`):
        with `pack_sequences`, but for rows with images, and a policy's groups computed with
        their shared prefixes."""
        if self.shares_prefixes and batch.groups is not None:
            return False
        return self.settings.pack_sequences and batch.images is None

    def _autocast(self) -> torch.autocast:
        """bf16 autocast in a plain process; under FSDP the mixed-precision policy casts instead."""
        use_autocast = self.settings.dtype == "bfloat16" and not self.is_sharded
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_autocast)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if not self.is_sharded:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()


class FsdpPolicy(FsdpModel):
    """The trained policy: a causal LM, its logprobs and train step, and its export.

    With `lora` (`trainer.lora`) the base model is frozen and only LoRA adapters train
    (trainer_svc/lora.py), put on before sharding; the base is also the KL term's reference
    (`reference_logprobs`), so no second copy of it is loaded. The weights it pushes and
    exports in full are then the merged ones, under the base model's names.
    """

    def __init__(
        self, model_path: str | Path, settings: TrainSettings, lora: LoraSettings | None = None
    ) -> None:
        config = AutoConfig.from_pretrained(model_path)
        loaded = load_model(model_class(model_path), model_path, config, joins_process_group())
        self.model_path = str(model_path)
        self.lora = lora
        # The last parts of the adapted layers' names (q_proj, ...); [] without LoRA.
        self.adapter_target_modules = [] if lora is None else add_lora_adapters(loaded.model, lora)
        adapters = {} if lora is None else initial_adapters(loaded.model, lora)
        if lora is not None and loaded.files is not None:  # filled with the base once sharded
            loaded.files.follow_renames(loaded.model, unadapted_name)
        super().__init__(loaded, settings, adapters)
        self.shares_prefixes = settings.shared_prefix_forward and can_share_prefixes(self.model)

    def logprobs(self, batch: Batch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logprob (and entropy) of each token given its prefix, (rows, length) like the batch,
        on the batch's device; column 0 and padding get 0. Every rank passes the same batch and
        computes its share of it (`FsdpModel._per_token`)."""
        logprobs, entropy = self._per_token(
            batch, partial(self._forward, with_entropy=with_entropy)
        )
        return logprobs, entropy

    def reference_logprobs(self, batch: Batch) -> Tensor:
        """`logprobs` of the base model, the adapters switched off: the reference policy of a
        LoRA run. Collective like `logprobs`."""
        assert self.lora is not None, "only a LoRA policy holds its reference"
        with adapters_disabled(self.model):
            logprobs, _ = self.logprobs(batch)
        return logprobs

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step on this rank's `batch` with loss_fn(micro, logprobs, entropy); see
        `FsdpModel._train_step` for the metrics it returns."""

        def micro_loss(micro: Batch) -> tuple[Tensor, dict[str, float]]:
            return loss_fn(micro, *self._forward(micro, with_entropy))

        return self._train_step(batch, micro_loss)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded fp32 weights on CPU under the model's Hugging Face names (with LoRA the
        base model's, adapters merged in), a snapshot that later steps leave alone. Under FSDP
        only rank 0 gets them; other ranks get {}."""
        state = self._merged_state()
        if self.is_sharded:
            return state
        # Plain on CPU, the tensors are the live parameters.
        return {name: tensor.detach().clone() for name, tensor in state.items()}

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The LoRA adapters, unsharded on CPU, under the names of peft's
        adapter_model.safetensors (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.
        weight`, ...), copies later steps leave alone. Under FSDP only rank 0 gets them; other
        ranks get {}."""
        assert self.lora is not None, "a policy without LoRA has no adapters"
        # Gathered whole, like the checkpoint's state; the adapters are a small part of it.
        return adapter_state(get_model_state_dict(self.model, options=FULL_ON_CPU))

    def full_weights(
        self,
        bucket_size_bytes: int,
        reuse: BucketedWeights | None = None,
        *,
        adapters_merged: bool = True,
    ) -> BucketedWeights | None:
        """The unsharded fp32 weights on CPU, laid out for a push in buckets of
        `bucket_size_bytes` (in `reuse`'s memory when given and large enough), still being
        copied in on return (`BucketedWeights.pack`): under FSDP the copy reads a gathered
        state dict of its own; in a plain process the live parameters, which the next step
        changes only after the push. A tied parameter goes once, under its first name
        (`tied_aliases`). With LoRA they are the merged weights (`full_state_dict`), or
        without `adapters_merged` the frozen base model's, which pushed adapters apply to.
        Under FSDP only rank 0 gets them; other ranks get None."""
        state = self._merged_state() if adapters_merged else self._base_state()
        if self.rank != 0:
            return None
        aliases = tied_aliases(self.model)
        if reuse is not None:
            reuse.wait_packed()  # its memory is rewritten next
        return BucketedWeights.pack(
            [(name, tensor) for name, tensor in state.items() if name not in aliases],
            bucket_size_bytes,
            reuse=None if reuse is None else reuse.data,
        )

    def save_pretrained(self, folder: str | Path, tokenizer_dir: str | Path | None = None) -> None:
        """Writes the policy into `folder` on rank 0, with the tokenizer files of
        `tokenizer_dir` copied beside it: with LoRA the adapters in peft's format
        (adapter_config.json naming the base model, adapter_model.safetensors), which
        `AutoModelForCausalLM.from_pretrained` loads on the base; otherwise the model as
        `save_merged` writes it."""
        if self.lora is None:
            self.save_merged(folder, tokenizer_dir)
            return
        adapters = self.adapter_state_dict()
        if self.rank != 0:
            return
        targets = self.adapter_target_modules
        save_adapter(Path(folder), adapters, self.lora, targets, self.model_path)
        copy_tokenizer_files(tokenizer_dir, folder)

    def save_merged(self, folder: str | Path, tokenizer_dir: str | Path | None = None) -> None:
        """Writes the model in Hugging Face format (config, safetensors) into `folder` on rank 0,
        with LoRA's adapters merged in, and the tokenizer files of `tokenizer_dir` beside it.
        Without LoRA the tensors are gathered one at a time as they are written
        (`hf_export`): no rank holds more of the model than its shards and one tensor."""
        state = self.model.state_dict()
        aliases = tied_aliases(self.model)
        state = {name: tensor for name, tensor in state.items() if name not in aliases}
        renamed = None if self.lora is not None else checkpoint_names(self.model, list(state))
        if renamed is not None:
            export_streaming(self.model, state, Path(folder), renamed)
        else:  # the merge needs whole tensors, as do transformers' tensor conversions
            merged = self.full_state_dict()
            if self.rank == 0:
                self.model.save_pretrained(folder, state_dict=merged)
        if self.rank == 0:
            copy_tokenizer_files(tokenizer_dir, folder)

    def _base_state(self) -> dict[str, Tensor]:
        """The model's full state on CPU (rank 0; {} on the others) under the base model's
        names, without LoRA's adapters."""
        return unadapted_state(get_model_state_dict(self.model, options=FULL_ON_CPU))

    def _merged_state(self) -> dict[str, Tensor]:
        """The model's full state on CPU (rank 0; {} on the others) under the base model's
        names, with LoRA's adapters merged in."""
        state = get_model_state_dict(self.model, options=FULL_ON_CPU)
        if self.lora is None or not state:
            return state
        return merge_adapters(state, self.lora)

    def _forward(self, micro: Batch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        with self._autocast():
            # A row's images take their tokens' places: no prefix is computed apart from them.
            if self.shares_prefixes and micro.groups is not None and micro.images is None:
                return shared_prefix_logprobs(
                    self.model, micro.input_ids, micro.attention_mask, micro.groups, with_entropy
                )
            if self.packs(micro):
                return packed_logprobs(
                    self.model, micro.input_ids, micro.attention_mask, with_entropy
                )
            return whole_row_logprobs(
                self.model, micro.input_ids, micro.attention_mask, with_entropy, micro.images
            )
