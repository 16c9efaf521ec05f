"""`image_zoom`: shows the model an enlarged region of its trajectory's image.

A session opens on one image, the session kwarg `image` (a `data:` URL, as a prompt's
`tools_kwargs` give it: `{"image_zoom": {"create_kwargs": {"image": "data:image/png;base64,..."}}}`;
or a `file:` URL under the options' `images.file_dirs`), checked like every image
(turnrl.images). Each call names a box in that image's own pixels, `[left, top, right, bottom]`
(right and bottom exclusive), and gets back the region scaled so that its longer side is
`zoomed_size` pixels, as a PNG, with a line saying what it shows. A box that leaves the image or
is under `min_box_size` pixels a side is the model's error (INVALID_ARGUMENTS), and says the
image's size.
"""

import asyncio
import io
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import PIL.Image
from pydantic import Field

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolImage, ToolResult
from turnrl.config import StrictModel
from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2

RESAMPLING = {"nearest": PIL.Image.Resampling.NEAREST, "bicubic": PIL.Image.Resampling.BICUBIC}


class ImageZoomOptions(StrictModel):
    """How `image_zoom` enlarges, and which session images it accepts."""

    zoomed_size: int = Field(
        default=448, ge=8, le=4096, description="Longer side of a returned region, in pixels."
    )
    min_box_size: int = Field(
        default=4, ge=1, description="Shortest side a box may have, in pixels of the image."
    )
    resample: Literal["nearest", "bicubic"] = Field(
        default="bicubic",
        description="How pixels are enlarged: 'nearest' keeps hard edges (pixel art, "
        "rendered text), 'bicubic' smooths photographs.",
    )
    images: ImageSettings = Field(
        default_factory=ImageSettings, description="Limits on a session's image."
    )


@dataclass
class ZoomSession:
    """A trajectory's image, decoded once."""

    image: PIL.Image.Image


class ImageZoomTool(Tool):
    """Enlarges a region of the session's image."""

    schema: ClassVar[dict[str, Any]] = {
        "name": "image_zoom",
        "description": "Zoom in on a region of the image: returns the region enlarged.",
        "parameters": {
            "type": "object",
            "properties": {
                "bbox_2d": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "minItems": 4,
                    "maxItems": 4,
                    "description": "The region as [left, top, right, bottom] in the image's "
                    "pixels; right and bottom are exclusive.",
                }
            },
            "required": ["bbox_2d"],
            "additionalProperties": False,
        },
    }
    Options = ImageZoomOptions
    requires_session: ClassVar[bool] = True

    async def create(self, **session_kwargs: Any) -> ZoomSession:
        if set(session_kwargs) != {"image"} or not isinstance(session_kwargs["image"], str):
            raise ValueError(
                "image_zoom takes one session kwarg, `image`: a data: or file: URL; "
                f"got keys {sorted(session_kwargs)}"
            )
        options: ImageZoomOptions = self.options
        image = common_pb2.Image(url=session_kwargs["image"])
        try:
            loaded = await asyncio.to_thread(load_image, image, options.images, "image")
        except InvalidArgumentError as e:  # the service answers a ValueError as bad kwargs
            raise ValueError(str(e)) from None
        return ZoomSession(await asyncio.to_thread(loaded.rgb))

    async def execute(self, session: ZoomSession, args: dict[str, Any]) -> ToolResult:
        left, top, right, bottom = args["bbox_2d"]
        width, height = session.image.size
        options: ImageZoomOptions = self.options
        if not (0 <= left < right <= width and 0 <= top < bottom <= height):
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"bbox_2d {args['bbox_2d']} is not a box inside the {width}x{height} image "
                "(need 0 <= left < right <= width and 0 <= top < bottom <= height)",
            )
        if min(right - left, bottom - top) < options.min_box_size:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"bbox_2d {args['bbox_2d']} is {right - left}x{bottom - top} pixels; each side "
                f"must be at least {options.min_box_size}",
            )
        png, size = await asyncio.to_thread(_zoomed_png, session.image, args["bbox_2d"], options)
        return ToolResult(
            text=f"Region {args['bbox_2d']} of the {width}x{height} image, shown at "
            f"{size[0]}x{size[1]}.",
            images=[ToolImage(png, "image/png")],
        )


def _zoomed_png(
    image: PIL.Image.Image, box: list[int], options: ImageZoomOptions
) -> tuple[bytes, tuple[int, int]]:
    """The region `box` of `image` scaled to `options.zoomed_size` on its longer side."""
    left, top, right, bottom = box
    scale = options.zoomed_size / max(right - left, bottom - top)
    size = (max(1, round((right - left) * scale)), max(1, round((bottom - top) * scale)))
    region = image.crop((left, top, right, bottom)).resize(size, RESAMPLING[options.resample])
    encoded = io.BytesIO()
    region.save(encoded, format="PNG")
    return encoded.getvalue(), size
