"""The images of one trajectory while the agent loop builds it: the prompt's, then each tool
result's, processed by the model's processor, placed among the trajectory's tokens, and handed
to the engine with every model turn.

A tool result's images are checked like a prompt's (turnrl.images); one that fails makes the
result an error the model reads, naming the image, as any failed tool call does. A text-only
model is shown a tool's text only, and the images it did not see are counted.
"""

from collections.abc import Sequence
from typing import Any

from rollout_svc.engines.base import EngineImage
from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, LoadedImage, load_images
from turnrl.trajectory import TrajectoryImage
from turnrl.v1 import common_pb2
from turnrl.vision import ProcessedImage, VisionProcessor


class TrajectoryImages:
    """One trajectory's images: what its engine requests carry (`engine_images`) and what its
    record holds (`records`, the trajectory's `images`)."""

    def __init__(self, vision: VisionProcessor | None, settings: ImageSettings) -> None:
        self._vision = vision
        self._settings = settings
        self.engine_images: list[EngineImage] = []
        self.records: list[TrajectoryImage] = []
        self.unseen = 0  # tool result images a text-only model was not shown

    def process(self, images: Sequence[LoadedImage]) -> list[ProcessedImage]:
        """The images as the model's processor makes them (CPU work: run off the loop)."""
        assert self._vision is not None or not images, "a prompt's images were refused earlier"
        return [self._vision.process(image) for image in images]

    def place(
        self,
        offset: int,
        new_ids: list[int],
        images: Sequence[LoadedImage],
        processed: Sequence[ProcessedImage],
    ) -> None:
        """Records `images`, whose tokens are among `new_ids` (which start at token `offset` of
        the trajectory), each at its run of image tokens, in order."""
        position = 0
        for image, done in zip(images, processed, strict=True):
            position = new_ids.index(self._vision.image_token_id, position)
            self.engine_images.append(EngineImage(offset + position, image, done))
            self.records.append(
                TrajectoryImage(offset + position, done.token_count, image.sha256, done.grid_thw)
            )
            position += done.token_count

    def tool_content(
        self, text: str, images: Sequence[common_pb2.Image], tool: str
    ) -> tuple[str | list[dict[str, Any]], list[LoadedImage], bool]:
        """A tool result's message content (its text, then its images as parts), its checked
        images, and whether it failed: an image that fails its check makes the content the
        error instead."""
        if not images:
            return text, [], False
        if self._vision is None:
            self.unseen += len(images)
            return text, [], False
        where = [(image, f"the {tool!r} result's images[{i}]") for i, image in enumerate(images)]
        try:
            loaded = load_images(where, self._settings)
        except InvalidArgumentError as e:
            return f"Error: {e}", [], True
        parts = [{"type": "image_url", "image_url": {"url": image.data_url()}} for image in loaded]
        return [{"type": "text", "text": text}, *parts], loaded, False
