"""The images of a gateway session's requests: user and tool messages' `image_url` parts
(requests.py), checked with the rollout service's image settings, processed by the served
model's processor and placed among the session's tokens as the agent loop places a prompt's and
a tool result's (`TrajectoryImages`).

A request sends its session's history back, images included; only the new messages' images are
processed and placed, since the history's are the session's already (its messages hold each as
the data URL of its bytes, so the prefix rule compares images by their bytes). The engine is
given the current part's images with every turn (its context is that part: history.py); the
trajectory records all parts'.
"""

import asyncio
import dataclasses
from collections.abc import Callable

from rollout_svc.engines.base import EngineImage
from rollout_svc.gateway.requests import ChatCompletionRequest, RequestFieldError
from rollout_svc.trajectory_images import TrajectoryImages
from turnrl.images import ImageSettings, LoadedImage
from turnrl.trajectory import TrajectoryImage
from turnrl.vision import ProcessedImage, VisionProcessor


class SessionImages:
    """The served model's image processor (None: a text-only model) and the limits on the
    images of a request: the agent loop's own."""

    def __init__(self, vision: VisionProcessor | None, settings: ImageSettings) -> None:
        self.vision = vision
        self._settings = settings

    def load(self, request: ChatCompletionRequest) -> list[LoadedImage]:
        """The request's images, checked (CPU work: run off the loop). Raises RequestFieldError
        naming the part of one that fails, or the first image part for a text-only model."""
        parts = request.image_parts()
        if parts and self.vision is None:
            index, position, _ = parts[0]
            raise RequestFieldError(
                f"messages[{index}].content[{position}]: the messages hold {len(parts)} images, "
                "but the model is text-only: images need a vision-language model",
                f"messages.{index}.content.{position}",
            )
        return request.load_images(self._settings)

    async def tokenized(
        self,
        render: Callable[[list[ProcessedImage]], list[int]],
        images: list[LoadedImage],
        part_tokens: int,
        offset: int,
    ) -> tuple[list[int], list[EngineImage], list[TrajectoryImage]]:
        """The ids `render` makes of messages holding `images` (processed first), and those
        images placed among the ids: for the engine, whose context is the current part (the
        ids start at its token `offset`), and in the trajectory, where the part starts at token
        `part_tokens`."""
        placed = TrajectoryImages(self.vision, self._settings)
        processed = await asyncio.to_thread(placed.process, images)
        new_ids = await asyncio.to_thread(render, processed)
        placed.place(offset, new_ids, images, processed)
        records = [
            dataclasses.replace(record, token_offset=part_tokens + record.token_offset)
            for record in placed.records
        ]
        return new_ids, placed.engine_images, records
