"""The policy's forward pass: each token's logprob (and its distribution's entropy) under a
causal LM, over whole rows, or with each group's shared prefix computed once.

GRPO samples several responses to one prompt, and the prompt (a system prompt with tool
schemas, then the question) is often most of each row's tokens. With the rows' groups known
(`Batch.groups`: the rows of one prompt), `shared_prefix_logprobs` runs three forwards, each
continuing the KV cache of the one before, indexed out to its nodes: the prefix that the groups'
prompts share (the system prompt) once, then each group's longest common prefix once, then
every row's own tokens. Causal attention makes a token's output depend on its prefix only, so
the results equal one forward over the whole rows, to float rounding; gradients from all the
rows of a group add up in its one prefix. A group's samples that begin alike share those
tokens too. The number of forwards is fixed, whatever the data, so that FSDP's ranks gather
their parameters the same number of times.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from turnrl.vision import ProcessedImage


def token_logprobs(
    logits: Tensor, input_ids: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """logprobs[:, t] of input_ids[:, t] under logits[:, t - 1], and that distribution's
    entropy; column 0 has no prefix and gets 0. Works in fp32 whatever the logits' dtype."""
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1)
    if not with_entropy:
        return F.pad(picked, (1, 0)), None
    return F.pad(picked, (1, 0)), F.pad(entropy_from_logits(logits), (1, 0))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy in nats of softmax(logits) over the last dim: (..., V) -> (...).

    H = log sum e^z' - sum e^z' * z' / sum e^z' with z' = z - max z. Shifting first keeps the
    subtraction exact for large logits (in float32, plain logsumexp(z) - sum p z is off by
    whole nats at z ~ 1e4); the einsum contracts without materialising the (..., V) product. Logits must be
    finite: a -inf logit gives NaN.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    unnormalized = torch.exp(shifted)
    total = unnormalized.sum(dim=-1)
    return torch.log(total) - torch.einsum("...v,...v->...", unnormalized, shifted) / total


def whole_row_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    with_entropy: bool,
    images: list[list[ProcessedImage]] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One forward over right-padded rows; padding gets 0. `images`: each row's images, for a
    vision-language model, whose features take their tokens' places."""
    inputs = {} if images is None else image_inputs(model, input_ids, images)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs
    ).logits
    logprobs, entropy = token_logprobs(logits, input_ids, with_entropy)
    real = attention_mask.bool()
    return logprobs * real, None if entropy is None else entropy * real


def packed_logprobs(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`whole_row_logprobs` of the rows computed as one sequence without their padding
    (`packed_forward`), put back in the rows' places."""
    real = attention_mask.bool()
    flat_ids = input_ids[real][None]
    logits, starts = packed_forward(model, flat_ids, attention_mask)
    logprobs, entropy = token_logprobs(logits, flat_ids, with_entropy)
    logprobs, entropy = [
        None if part is None else unpacked(part[0], real, starts) for part in (logprobs, entropy)
    ]
    return logprobs, entropy


def packed_forward(
    model: PreTrainedModel, flat_ids: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The model's output (logits, or a token classifier's) on `flat_ids`, (1, tokens): the
    real tokens of rows `attention_mask` marks, one row after the other, each attending to
    its own tokens only: transformers reads the rows' bounds from positions that start again
    at 0 with each row, when no attention mask is given: a block-diagonal causal mask with
    sdpa and eager (the trainer's models), the varlen kernels with flash_attention_2. Also
    whether each flat token begins its row."""
    lengths = attention_mask.sum(1)
    positions = torch.arange(flat_ids.shape[1], device=flat_ids.device)
    row_starts = torch.cumsum(lengths, 0) - lengths
    positions = positions - torch.repeat_interleave(row_starts, lengths)
    output = model(input_ids=flat_ids, position_ids=positions[None], use_cache=False)
    return output.logits, positions == 0


def unpacked(flat: Tensor, real: Tensor, starts: Tensor) -> Tensor:
    """The (tokens,) `flat` values of a packed forward, each computed from the token before
    it, in their rows' places, (rows, length) like `real`. A row's first token (`starts`)
    followed the row before's last one there: it has no prefix and gets 0, as padding does.
    Differentiable."""
    rows = torch.zeros(real.shape, dtype=flat.dtype, device=flat.device)
    return rows.masked_scatter(real, flat.masked_fill(starts, 0.0))


def image_inputs(
    model: PreTrainedModel, input_ids: Tensor, images: list[list[ProcessedImage]]
) -> dict[str, Tensor]:
    """A VLM's image inputs for rows `input_ids` with each row's `images`: every image's
    patches in row order (the order of their tokens in the flattened rows), their grids, and
    the mask of image tokens its M-RoPE positions are computed from."""
    flat = [image for row in images for image in row]
    device = input_ids.device
    return {
        "pixel_values": torch.cat([image.pixel_values for image in flat]).to(device),
        "image_grid_thw": torch.tensor([image.grid_thw for image in flat], device=device),
        "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
    }


def can_share_prefixes(model: PreTrainedModel) -> bool:
    """Whether the model's KV cache is plain full attention in every layer, which the second
    forward of `shared_prefix_logprobs` continues (a sliding window would drop prefix keys)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


@dataclass(frozen=True)
class PrefixUnits:
    """Prefixes computed once: prefix u is the first `lengths[u]` tokens of row `rows[u]`, and
    row r continues prefix `of_row[r]`."""

    of_row: Tensor  # (rows,) long
    rows: Tensor  # (units,) long
    lengths: Tensor  # (units,) long


def prefix_units(input_ids: Tensor, row_lengths: Tensor, groups: Tensor) -> PrefixUnits:
    """Each group's longest common prefix, at most its shortest row less one token (so that
    every row but a one-token one has a token left for the forward after it). A group whose
    rows differ from the first token on is one unit per row, each its row's first token."""
    units: list[tuple[list[int], int]] = []
    for group in groups.unique().tolist():
        rows = (groups == group).nonzero().squeeze(1)
        limit = max(int(row_lengths[rows].min()) - 1, 1)
        tokens = input_ids[rows, :limit]
        common = int((tokens == tokens[:1]).all(0).int().cumprod(0).sum())
        if common:
            units.append((rows.tolist(), common))
        else:
            units += [([row], 1) for row in rows.tolist()]
    of_row = torch.empty(input_ids.shape[0], dtype=torch.long)
    for unit, (rows, _) in enumerate(units):
        of_row[rows] = unit
    return PrefixUnits(
        of_row=of_row.to(input_ids.device),
        rows=torch.tensor([rows[0] for rows, _ in units], device=input_ids.device),
        lengths=torch.tensor([length for _, length in units], device=input_ids.device),
    )


@dataclass(frozen=True)
class PrefixLevel:
    """One forward of `shared_prefix_logprobs`: node i computes tokens [start[i], end[i]) of
    row `rows[i]` (none when start == end) after the KV of its node `parent[i]` in the level
    before (the first level has no parent: start is 0)."""

    rows: Tensor  # (nodes,) long
    start: Tensor  # (nodes,) long
    end: Tensor  # (nodes,) long
    parent: Tensor | None  # (nodes,) long


def prefix_levels(input_ids: Tensor, row_lengths: Tensor, groups: Tensor) -> list[PrefixLevel]:
    """The three forwards of a grouped batch: the prefix that the groups' prefixes share (a
    system prompt with its tool schemas) once, then each group's prefix after it, then each
    row's own tokens (`prefix_units` at both levels; the groups' prefixes are grouped by their
    first token, so prompts of another kind make trunks of their own)."""
    units = prefix_units(input_ids, row_lengths, groups)
    unit_ids = input_ids[units.rows]
    trunks = prefix_units(unit_ids, units.lengths, unit_ids[:, 0])
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return [
        PrefixLevel(
            units.rows[trunks.rows], torch.zeros_like(trunks.lengths), trunks.lengths, None
        ),
        PrefixLevel(units.rows, trunks.lengths[trunks.of_row], units.lengths, trunks.of_row),
        PrefixLevel(rows, units.lengths[units.of_row], row_lengths, units.of_row),
    ]


def shared_prefix_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    groups: Tensor,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """`whole_row_logprobs` of the rows, in the forwards of `prefix_levels`, each on the KV of
    the one before: every token is computed once per node that holds it."""
    device = input_ids.device
    rows, width = input_ids.shape
    levels = prefix_levels(input_ids, attention_mask.sum(1), groups)
    cache = DynamicCache(config=model.config)
    kv_mask = torch.zeros(1, 0, dtype=torch.bool, device=device)  # the KV's real columns
    last_logits: Tensor | None = None  # per node of the level before: after its last token
    computed = []  # per level, by node: (positions, mask of its values, [logprobs, entropy])
    for level in levels:
        own = level.end - level.start
        columns = torch.arange(max(int(own.max()), 1), device=device)
        own_mask = columns < own[:, None]
        positions = level.start[:, None] + columns
        ids = input_ids[level.rows].gather(1, positions.clamp(max=width - 1)) * own_mask
        if level.parent is not None:
            cache.batch_select_indices(level.parent)
            kv_mask = kv_mask[level.parent]
        kv_mask = torch.cat([kv_mask.expand(len(own), -1), own_mask], 1)
        logits = model(
            input_ids=ids,
            attention_mask=kv_mask.long(),
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).logits
        # A node's first token is predicted after its parent's last (the first level's first
        # token has no prefix: it gets 0, as in whole_row_logprobs).
        before = logits[:, :1] if last_logits is None else last_logits[level.parent, None]
        logprobs, entropy = token_logprobs(
            torch.cat([before, logits], 1), F.pad(ids, (1, 0)), with_entropy
        )
        own_values = [logprobs[:, 1:], None if entropy is None else entropy[:, 1:]]
        computed.append((positions, own_mask & (positions > 0), own_values))
        own_last = logits[torch.arange(len(own), device=device), (own - 1).clamp(min=0)]
        if last_logits is not None:  # a node without tokens of its own ends where its parent does
            own_last = torch.where((own > 0)[:, None], own_last, last_logits[level.parent])
        last_logits = own_last
    # Each row's node in every level, from the last level (the rows themselves) up.
    node_of_row = [torch.arange(rows, device=device)]
    for level in reversed(levels[1:]):
        node_of_row.insert(0, level.parent[node_of_row[0]])

    def placed(which: int) -> Tensor:
        """(rows, width) values (0: logprobs, 1: entropies), each token's from its node."""
        total = torch.zeros(rows, width, device=device)
        for nodes, (positions, mask, values) in zip(node_of_row, computed, strict=True):
            at = positions[nodes]
            room = max(int(at.max()) + 1, width)
            own = (values[which] * mask)[nodes]
            total = total + torch.zeros(rows, room, device=device).scatter(1, at, own)[:, :width]
        return total * attention_mask.bool()

    return placed(0), placed(1) if with_entropy else None
