"""The image side of a vision-language model: its image processor, and the image tokens that a
chat template's placeholder becomes.

A Qwen-VL chat template writes one `<|image_pad|>` per image (between `<|vision_start|>` and
`<|vision_end|>`); the model's processor then repeats it once per merged patch of that image,
`t * h * w / merge_size**2` times for a processed grid of (t, h, w) patches. turnrl tokenizes
conversations as differences of renders (turnrl.chat_tokens), so the repetition is done here on
token ids, image by image in the order the images appear, exactly as the processor does it on
text. The image processor runs on PIL (`backend="pil"`): transformers' default backend needs
torchvision, and its video processor, which `AutoProcessor` loads, needs it too; the image
processors alone do not.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
)

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.images import LoadedImage

# What an image part of a message is rendered as: the form vision-language templates test for,
# without the image's bytes (a render, and the cache of renders, never holds them).
IMAGE_PLACEHOLDER = {"type": "image"}


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model's vision tower takes it: its patches, flattened
    ([patches, channels * temporal_patch_size * patch_size**2]), and their grid (t, h, w)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    token_count: int  # the image's tokens in the sequence: t * h * w / merge_size**2


class VisionProcessor:
    """A vision-language model's image processor and image token (its config's
    `image_token_id`), from its folder or Hub id."""

    def __init__(self, model_path: str | Path) -> None:
        self.image_token_id = vision_token_id(model_path)
        if self.image_token_id is None:
            raise FailedPreconditionError(
                f"{model_path} is not a vision-language model: its config has no image_token_id"
            )
        self._image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        self._merged_patches = self._image_processor.merge_size**2

    def process(self, image: LoadedImage) -> ProcessedImage:
        """`image` resized, normalized and cut into patches by the model's image processor."""
        out = self._image_processor(images=[image.rgb()], return_tensors="pt")
        grid = tuple(int(n) for n in out["image_grid_thw"][0])
        t, h, w = grid
        return ProcessedImage(
            pixel_values=out["pixel_values"],
            grid_thw=(t, h, w),
            token_count=t * h * w // self._merged_patches,
        )

    def expand_image_tokens(self, ids: list[int], images: list[ProcessedImage]) -> list[int]:
        """`ids` with the k-th image token repeated `images[k].token_count` times. Raises
        InvalidArgumentError when the ids hold another number of image tokens than images."""
        placeholders = ids.count(self.image_token_id)
        if placeholders != len(images):
            raise InvalidArgumentError(
                f"the rendered messages hold {placeholders} image placeholders for "
                f"{len(images)} images"
            )
        expanded: list[int] = []
        remaining = iter(images)
        for token in ids:
            if token == self.image_token_id:
                expanded.extend([token] * next(remaining).token_count)
            else:
                expanded.append(token)
        return expanded


def model_class(model_path: str | Path) -> type:
    """The auto class that loads the model at `model_path` whole: a vision-language model's
    with its vision tower, a causal LM's for the rest."""
    if vision_token_id(model_path) is None:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def is_vision_model(model: PreTrainedModel) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def vision_token_id(model_path: str | Path) -> int | None:
    """The image token id of the model at `model_path`; None for a text-only model."""
    return getattr(AutoConfig.from_pretrained(model_path), "image_token_id", None)


def with_image_placeholders(messages: list[dict]) -> tuple[list[dict], int]:
    """`messages` with each image part of their content (OpenAI's `image_url`, or `image`) as
    IMAGE_PLACEHOLDER, and how many there were."""
    placeheld, count = [], 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(_is_image(part) for part in content):
            parts = [IMAGE_PLACEHOLDER if _is_image(part) else part for part in content]
            count += parts.count(IMAGE_PLACEHOLDER)
            message = {**message, "content": parts}
        placeheld.append(message)
    return placeheld, count


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")
