"""What a train step's rows are and how they are cut: `Batch`, right-padded rows of tokens with
their per-token tensors (and a vision-language policy's images, processed again from the
trajectory's bytes: `processed_images`), a step's shuffled mini-batches, and the micro-batch
plans `FsdpModel` forwards and trains in (trainer_svc/fsdp.py): rows longest first within a token budget, or, where a
group's prefix is computed once (trainer_svc/forward.py), whole groups whose three forwards
fit it.
"""

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from trainer_svc.forward import PrefixLevel
from turnrl.images import trajectory_images
from turnrl.trajectory import Trajectory
from turnrl.vision import ProcessedImage, VisionProcessor


@dataclass
class Batch:
    """Right-padded rows of tokens and their per-token tensors, all (rows, length)."""

    input_ids: Tensor  # long
    attention_mask: Tensor  # long; 1 on real tokens, which come first in each row
    loss_mask: Tensor  # bool; True where the loss applies (sampled tokens)
    # Per-token floats split with the rows: old_logprobs, advantages, ref_logprobs, ...
    extras: dict[str, Tensor] = field(default_factory=dict)
    # (rows,) long: rows of one value share their prompt (a GRPO group); None: not known.
    # The policy's forward computes a group's shared prefix once (`trainer_svc.forward`).
    groups: Tensor | None = None
    # Each row's images, in the order of its image tokens (a vision-language model's rows);
    # None: no row has any.
    images: list[list[ProcessedImage]] | None = None
    # Set by `train_step` on each micro-batch: loss tokens and rows over all ranks' batches.
    global_token_count: int = 0
    global_sequence_count: int = 0

    @classmethod
    def from_sequences(
        cls,
        token_ids: list[list[int]],
        loss_masks: list[list[bool]],
        extras: dict[str, list[list[float]]] | None = None,
        pad_token_id: int = 0,
        groups: list[int] | None = None,
        images: list[list[ProcessedImage]] | None = None,
    ) -> "Batch":
        """Pads rows on the right; every loss mask and extra row has its token row's length.
        `groups`: each row's group (rows of one prompt), when known; `images`: each row's
        images, when any row has one."""
        extras = extras or {}
        for name, rows in {"loss_masks": loss_masks, **extras}.items():
            lengths = [len(row) for row in rows]
            expected = [len(row) for row in token_ids]
            if lengths != expected:
                raise ValueError(
                    f"{name} row lengths {lengths!r} differ from token_ids' {expected!r}"
                )
        if not token_ids or min(map(len, token_ids)) == 0:
            raise ValueError("a batch needs at least one row and no empty row")
        lengths = torch.tensor([len(row) for row in token_ids])
        width = int(lengths.max())
        return cls(
            input_ids=pad_rows(token_ids, width, pad_token_id, torch.long),
            attention_mask=(torch.arange(width)[None, :] < lengths[:, None]).long(),
            loss_mask=pad_rows(loss_masks, width, False, torch.bool),
            extras={
                name: pad_rows(rows, width, 0.0, torch.float32) for name, rows in extras.items()
            },
            groups=None if groups is None else torch.tensor(groups, dtype=torch.long),
            images=images if images and any(images) else None,
        )

    def select(self, rows: list[int], device: torch.device) -> "Batch":
        """These rows, in this order, trimmed to the longest of them, on `device`."""
        index = torch.tensor(rows, device=self.input_ids.device)
        length = int(self.attention_mask[index].sum(1).max())

        def take(tensor: Tensor) -> Tensor:
            return tensor[index, :length].to(device)

        return replace(
            self,
            input_ids=take(self.input_ids),
            attention_mask=take(self.attention_mask),
            loss_mask=take(self.loss_mask),
            extras={name: take(tensor) for name, tensor in self.extras.items()},
            groups=None if self.groups is None else self.groups[index].to(device),
            images=None if self.images is None else [self.images[row] for row in rows],
        )


def pad_rows(rows: list[list[Any]], width: int, value: Any, dtype: torch.dtype) -> Tensor:
    """(len(rows), width) of `dtype`: each row on the left, `value` after it."""
    # Row by row into a filled tensor: one nested list of the whole batch is slower.
    tensor = torch.full((len(rows), width), value, dtype=dtype)
    for index, row in enumerate(rows):
        tensor[index, : len(row)] = torch.tensor(row, dtype=dtype)
    return tensor


def mini_batches(size: int, count: int, generator: torch.Generator) -> list[list[int]]:
    """`count` shuffled, near-equal slices of the row indices 0..size-1."""
    order = torch.randperm(size, generator=generator).tolist()
    return [order[i::count] for i in range(count) if order[i::count]]


def micro_batch_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch: longest rows first, each micro-batch filled while its
    rows x its longest row fit in `max_tokens`; a row longer than that goes alone."""
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def packed_micro_batch_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each packed micro-batch: longest rows first, each into the first
    micro-batch whose tokens stay within `max_tokens`; a row longer than that goes alone."""
    groups: list[list[int]] = []
    tokens: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [i for i, used in enumerate(tokens) if used + lengths[row] <= max_tokens]
        if fits:
            groups[fits[0]].append(row)
            tokens[fits[0]] += lengths[row]
        else:
            groups.append([row])
            tokens.append(lengths[row])
    return groups


@dataclass
class _SharedPrefixMicroBatch:
    """A micro-batch being filled by `shared_prefix_micro_batch_rows`."""

    trunks: set[int]
    units: int
    rows: list[int]
    longest: tuple[int, int, int]  # the most tokens one trunk, unit and row computes

    def cost(self) -> int:
        """Tokens of its three forwards, padding included."""
        trunk, unit, row = self.longest
        return len(self.trunks) * trunk + self.units * unit + len(self.rows) * row


def shared_prefix_micro_batch_rows(levels: list[PrefixLevel], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch of `shared_prefix_logprobs`, given the whole batch's
    `prefix_levels`: whole units (a group's rows), longest first, each micro-batch filled while
    its three forwards fit in `max_tokens` (each forward: its nodes x the most tokens one of
    them computes). A unit's rows go in runs of rows of like length that fit, each run
    computing the unit's prefix again: a unit too large alone, or whose rows differ in length by
    more than its prefix, is split."""
    _, units, rows = levels
    own = [(level.end - level.start).clamp(min=1).tolist() for level in levels]
    trunk_of_unit = units.parent.tolist()
    unit_rows: dict[int, list[int]] = {}
    for row, unit in enumerate(rows.parent.tolist()):
        unit_rows.setdefault(unit, []).append(row)
    runs: list[_SharedPrefixMicroBatch] = []
    for unit, members in unit_rows.items():
        trunk = trunk_of_unit[unit]
        run = _SharedPrefixMicroBatch({trunk}, 1, [], (own[0][trunk], own[1][unit], 0))
        for row in sorted(members, key=own[2].__getitem__, reverse=True):
            longest = (*run.longest[:2], max(run.longest[2], own[2][row]))
            grown = replace(run, rows=[*run.rows, row], longest=longest)
            # A row much shorter than the run's longest starts a run of its own where padding
            # it would cost more than computing the unit's prefix again.
            padding = run.longest[2] - own[2][row]
            if run.rows and (grown.cost() > max_tokens or padding > run.longest[1]):
                runs.append(run)
                grown = replace(run, rows=[row], longest=(*run.longest[:2], own[2][row]))
            run = grown
        runs.append(run)
    micro_batches: list[_SharedPrefixMicroBatch] = []
    for run in sorted(runs, key=lambda run: -sum(run.longest)):
        if micro_batches:
            last = micro_batches[-1]
            merged = _SharedPrefixMicroBatch(
                last.trunks | run.trunks,
                last.units + run.units,
                last.rows + run.rows,
                tuple(map(max, last.longest, run.longest)),
            )
            if merged.cost() <= max_tokens:
                micro_batches[-1] = merged
                continue
        micro_batches.append(run)
    return [micro_batch.rows for micro_batch in micro_batches]


def processed_images(
    trajectory: Trajectory, vision: VisionProcessor | None
) -> list[ProcessedImage]:
    """The trajectory's images as the policy's processor makes them from their bytes, each
    checked against its record: the same bytes, and the grid the rollout's processor made."""
    if not trajectory.images:
        return []
    where = f"trajectory {trajectory.trajectory_id!r}"
    if vision is None:
        raise ValueError(f"{where} has images, but the policy is a text-only model")
    if len(trajectory.parts) > 1:
        raise ValueError(f"{where} has images and comes in parts; only whole ones are trained")
    processed = []
    loaded = trajectory_images(trajectory.messages)
    for index, (image, record) in enumerate(zip(loaded, trajectory.images, strict=True)):
        done = vision.process(image)
        if image.sha256 != record.sha256 or done.grid_thw != record.grid_thw:
            raise ValueError(
                f"{where}: image {index} is {image.sha256[:12]} processed to a "
                f"{done.grid_thw} grid, but its record says {record.sha256[:12]} and "
                f"{record.grid_thw} (do the rollout and the trainer load one processor?)"
            )
        processed.append(done)
    return processed
