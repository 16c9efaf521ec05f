"""Images in the hf engine: what a vision-language model (the Qwen2.5-VL family) takes besides
token ids.

Two things differ from a text model. An image's tokens are not embedded from the vocabulary:
their inputs are the image's features from the vision tower, one per token. And positions are
3-D (M-RoPE: temporal, height, width): an image's tokens take their grid coordinates, and the
text after an image goes on from the image's largest position, which is less than its token
count, so every later position is the token's index plus a (negative) `rope_delta`.

The engine therefore runs a VLM's prefill on input embeddings, with each image's features put
in the places of its tokens (computed once per image, whichever chunk of the prompt its tokens
fall in: a prefill may stop inside an image, when reused KV ends there), and on the 3-D
positions `get_rope_index` gives for the request's whole sequence; decode steps, past every
image, feed the index plus `rope_delta` on all three axes. Both equal one forward over the
whole sequence with the images' pixel values (tests/rollout_svc/test_hf_vision.py).
"""

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from rollout_svc.engines.base import EngineImage
from turnrl.errors import InvalidArgumentError


class RequestVision:
    """One request's images on a vision-language model: their features, computed on first use,
    and the 3-D positions of the request's tokens."""

    def __init__(
        self, model: PreTrainedModel, token_ids: Sequence[int], images: Sequence[EngineImage]
    ) -> None:
        image_token_id = model.config.image_token_id
        self._model = model
        self.images = list(images)
        ids = torch.tensor([list(token_ids)])
        positions, delta = model.model.get_rope_index(
            ids,
            mm_token_type_ids=(ids == image_token_id).int(),
            image_grid_thw=torch.tensor([image.processed.grid_thw for image in images]),
        )
        self._positions = positions[:, 0, :]  # [3, len(token_ids)]
        self.rope_delta = int(delta[0, 0])
        self._features: dict[int, torch.Tensor] = {}

    def position_ids(self, start: int, end: int) -> torch.Tensor:
        """The 3-D positions of tokens [start, end), [3, end - start]; tokens past the ones the
        request came with (sampled ones) are text: their index plus rope_delta."""
        known = self._positions[:, start:end]
        first_later = max(start, self._positions.shape[1])
        later = torch.arange(first_later, max(end, first_later))
        return torch.cat([known, (later + self.rope_delta).expand(3, -1)], dim=1)

    def embeds(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """The input embeddings of `token_ids`, the request's tokens from `start`: each image
        token's the feature of its image at that place."""
        embedding = self._model.get_input_embeddings()
        ids = torch.tensor(list(token_ids), device=embedding.weight.device)
        embeds = embedding(ids)
        end = start + len(ids)
        for index, image in enumerate(self.images):
            first = image.token_offset
            last = first + image.processed.token_count
            if first < end and last > start:
                at, upto = max(first, start), min(last, end)
                embeds[at - start : upto - start] = self._feature(index)[at - first : upto - first]
        return embeds

    def forget_features(self) -> None:
        """Drops the features computed so far: new weights were loaded."""
        self._features.clear()

    def _feature(self, index: int) -> torch.Tensor:
        if index not in self._features:
            processed = self.images[index].processed
            output = self._model.model.get_image_features(
                processed.pixel_values.to(self._model.device, self._model.dtype),
                torch.tensor([processed.grid_thw], device=self._model.device),
                return_dict=True,
            )
            self._features[index] = output.pooler_output[0]
        return self._features[index]


def prefill_inputs(
    model: PreTrainedModel,
    padded_ids: torch.Tensor,
    past_lens: list[int],
    new_lens: list[int],
    visions: Sequence["RequestVision | None"],
) -> dict[str, torch.Tensor]:
    """A VLM prefill's inputs for rows of new tokens `padded_ids` (right-padded) after
    `past_lens` cached ones: input embeddings, with each row's images' features in their
    places, and 3-D positions (a row without images: its index on the three axes; padding 0)."""
    embeds = model.get_input_embeddings()(padded_ids)
    columns = torch.arange(padded_ids.shape[1], device=padded_ids.device)
    positions = torch.zeros((3, *padded_ids.shape), dtype=torch.long, device=padded_ids.device)
    for row, (past, new, vision) in enumerate(zip(past_lens, new_lens, visions, strict=True)):
        if vision is None:
            positions[:, row, :new] = past + columns[:new]
        else:
            embeds[row, :new] = vision.embeds(padded_ids[row, :new].tolist(), past)
            positions[:, row, :new] = vision.position_ids(past, past + new)
    return {"inputs_embeds": embeds, "position_ids": positions}


def check_images(
    token_ids: Sequence[int], images: Sequence[EngineImage], image_token_id: int | None
) -> None:
    """Raises InvalidArgumentError for images given to a text-only model (`image_token_id`
    None), and unless each image's tokens are image tokens, one image after another, and no
    image token is outside an image. Plain Python: the event loop runs it."""
    if image_token_id is None:
        raise InvalidArgumentError(
            f"{len(images)} images for a text-only model: images need a vision-language model"
        )
    covered = 0
    end = 0
    for index, image in enumerate(images):
        t, h, w = image.processed.grid_thw
        count = image.processed.token_count
        span = token_ids[image.token_offset : image.token_offset + count]
        if image.token_offset < end or len(span) < count or set(span) != {image_token_id}:
            raise InvalidArgumentError(
                f"image {index} ({t}x{h}x{w} patches) is not {count} image tokens at "
                f"{image.token_offset}, after the image before it"
            )
        end = image.token_offset + count
        covered += count
    if list(token_ids).count(image_token_id) != covered:
        raise InvalidArgumentError(
            f"{list(token_ids).count(image_token_id)} image tokens for {len(images)} images of "
            f"{covered} tokens"
        )
