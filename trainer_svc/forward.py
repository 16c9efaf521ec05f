"""The policy's forward pass: each token's logprob (and its distribution's entropy) under a
causal LM, over whole rows, or with each group's shared prefix computed once.

GRPO samples several responses to one prompt, and the prompt (a system prompt with tool
schemas, then the question) is often most of each row's tokens. With the rows' groups known
(`Batch.groups`: the rows of one prompt), `shared_prefix_logprobs` runs the longest common
prefix of each group's rows once, as one row of a first forward that keeps its KV cache, then
every row's remaining tokens in a second forward over its group's KV, indexed out to the rows.
Causal attention makes a token's output depend on its prefix only, so the results equal one
forward over the whole rows, to float rounding; gradients from all the rows of a group add up
in its one prefix. A group's samples that begin alike share those tokens too.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


def token_logprobs(
    logits: Tensor, input_ids: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """logprobs[:, t] of input_ids[:, t] under logits[:, t - 1], and that distribution's
    entropy; column 0 has no prefix and gets 0. Works in fp32 whatever the logits' dtype."""
    logits = logits[:, :-1].float()
    log_norm = logits.logsumexp(-1)
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - log_norm
    if not with_entropy:
        return F.pad(picked, (1, 0)), None
    probs = (logits - log_norm[..., None]).exp()
    entropy = log_norm - (probs * logits).sum(-1)
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))


def whole_row_logprobs(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """One forward over right-padded rows; padding gets 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logprobs, entropy = token_logprobs(logits, input_ids, with_entropy)
    real = attention_mask.bool()
    return logprobs * real, None if entropy is None else entropy * real


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
    every row but a one-token one has a token left for the second forward). A group whose rows
    differ from the first token on is one unit per row, each its row's first token."""
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


def shared_prefix_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    groups: Tensor,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """`whole_row_logprobs` of the rows, in two forwards: the prefixes of `prefix_units` once
    each, then every row's remaining tokens on its prefix's KV."""
    row_lengths = attention_mask.sum(1)
    units = prefix_units(input_ids, row_lengths, groups)
    device = input_ids.device
    prefix_columns = torch.arange(int(units.lengths.max()), device=device)
    prefix_mask = prefix_columns < units.lengths[:, None]
    prefix_ids = input_ids[units.rows, : prefix_columns.numel()] * prefix_mask
    cache = DynamicCache(config=model.config)
    prefix_logits = model(
        input_ids=prefix_ids, attention_mask=prefix_mask.long(), cache=cache, use_cache=True
    ).logits
    cache.batch_select_indices(units.of_row)

    row_prefix = units.lengths[units.of_row]
    suffix_lengths = row_lengths - row_prefix
    suffix_columns = torch.arange(max(int(suffix_lengths.max()), 1), device=device)
    suffix_mask = suffix_columns < suffix_lengths[:, None]
    positions = row_prefix[:, None] + suffix_columns
    suffix_ids = input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1)) * suffix_mask
    suffix_logits = model(
        input_ids=suffix_ids,
        attention_mask=torch.cat([prefix_mask[units.of_row], suffix_mask], 1).long(),
        position_ids=positions,
        cache=cache,
        use_cache=True,
    ).logits

    prefix_parts = token_logprobs(prefix_logits, prefix_ids, with_entropy)
    # A row's first own token is predicted at its prefix's last position.
    last_prefix_logits = prefix_logits[units.of_row, row_prefix - 1]
    suffix_parts = token_logprobs(
        torch.cat([last_prefix_logits[:, None], suffix_logits], 1),
        F.pad(suffix_ids, (1, 0)),
        with_entropy,
    )
    width = input_ids.shape[1]
    from_prefix = prefix_columns < row_prefix[:, None]

    def placed(prefix_part: Tensor | None, suffix_part: Tensor | None) -> Tensor | None:
        """(rows, width): the prefix's values on its columns, the row's own after them."""
        if prefix_part is None:
            return None
        room = width + suffix_columns.numel()
        head = F.pad(prefix_part[units.of_row] * from_prefix, (0, room - prefix_columns.numel()))
        own = torch.zeros_like(head).scatter(1, positions, suffix_part[:, 1:] * suffix_mask)
        return (head + own)[:, :width] * attention_mask.bool()

    logprobs = placed(prefix_parts[0], suffix_parts[0])
    return logprobs, placed(prefix_parts[1], suffix_parts[1])
