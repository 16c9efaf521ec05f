"""Images in prompts and tool results: what a service accepts, checked once where it arrives.

An image is encoded bytes (PNG, JPEG or WebP) given inline (`Image.data` with its
`mime_type`, or a `data:` URL) or a `file:` URL of a file under a folder the service's
settings name. A remote URL (http, https, anything else) is refused: services never fetch
from the network. Each image is decoded here, so a corrupt file, a format other than the
three, bytes that are not what their media type says, or an image over the limits fails with
an InvalidArgumentError that names the item, before any work is done on its request.
"""

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import PIL.Image
from pydantic import Field

from turnrl.config import StrictModel
from turnrl.errors import InvalidArgumentError
from turnrl.v1 import common_pb2

# The encoded formats accepted, by PIL's name for each, with their media types.
MIME_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


class ImageSettings(StrictModel):
    """Limits on the images a service accepts."""

    max_images: int = Field(
        default=16, ge=0, description="Images in one request (a prompt, or one tool result)."
    )
    max_image_bytes: int = Field(
        default=20 * 2**20, gt=0, description="Encoded bytes of one image."
    )
    max_pixels: int = Field(
        default=4096 * 4096,
        gt=0,
        description="Width x height of one image, decoded: larger ones are refused, not shrunk "
        "(the model's processor resizes within its own min and max pixels).",
    )
    file_dirs: list[str] = Field(
        default_factory=list,
        description="Folders whose files `file:` URLs may name (resolved, links followed). "
        "Empty: file URLs are refused, and images travel inline.",
    )


@dataclass(frozen=True)
class LoadedImage:
    """A checked image: its encoded bytes, their media type and SHA-256, its size."""

    data: bytes
    mime_type: str
    sha256: str
    width: int
    height: int

    def rgb(self) -> PIL.Image.Image:
        """The decoded image in RGB, as image processors take it."""
        with PIL.Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")

    def to_proto(self) -> common_pb2.Image:
        return common_pb2.Image(data=self.data, mime_type=self.mime_type)

    def data_url(self) -> str:
        return data_url(self.data, self.mime_type)


def data_url(data: bytes, mime_type: str) -> str:
    """An image's bytes inline, as an image_url part carries them."""
    return f"data:{mime_type};base64,{base64.b64encode(data).decode()}"


def load_image(image: common_pb2.Image, settings: ImageSettings, where: str) -> LoadedImage:
    """`image` read, decoded and checked against `settings`. Raises InvalidArgumentError
    naming `where` (e.g. "messages[1].content[0].image") and what was wrong."""
    if image.url and image.data:
        raise InvalidArgumentError(f"{where}: set data or url, not both")
    if image.url:
        data, declared = _read_url(image.url, settings, where)
    elif image.data:
        data, declared = image.data, image.mime_type
        if not declared:
            raise InvalidArgumentError(f"{where}: mime_type is required with data")
    else:
        raise InvalidArgumentError(f"{where}: the image has neither data nor url")
    return _checked(data, declared, settings, where)


def load_images(
    images: list[tuple[common_pb2.Image, str]], settings: ImageSettings
) -> list[LoadedImage]:
    """Each (image, where) of one request loaded in order; at most `settings.max_images`."""
    if len(images) > settings.max_images:
        raise InvalidArgumentError(
            f"{len(images)} images in one request; at most max_images={settings.max_images} "
            f"(the first over the limit: {images[settings.max_images][1]})"
        )
    return [load_image(image, settings, where) for image, where in images]


def load_message_images(
    messages: list[dict[str, Any]], settings: ImageSettings, where: str
) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
    """The images of OpenAI-style `messages` (their `image_url` parts), loaded in order, and
    the messages with each such part's URL made the data URL of its checked bytes, so that
    the conversation holds its images whatever file they came from. `where` names the
    messages in errors ("prompts[0].messages")."""
    found = _image_parts(messages, where)
    images = iter(load_images(found, settings))
    if not found:
        return messages, []
    loaded: list[LoadedImage] = []
    inlined = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image_url":
                    loaded.append(next(images))
                    part = {"type": "image_url", "image_url": {"url": loaded[-1].data_url()}}
                parts.append(part)
            message = {**message, "content": parts}
        inlined.append(message)
    return inlined, loaded


def trajectory_images(messages: list[dict[str, Any]]) -> list[LoadedImage]:
    """The images a finished trajectory's messages hold (data URLs, as `load_message_images`
    left them), decoded in order. The rollout service checked them against its limits; here
    they are only read back, so no limit applies."""
    unlimited = ImageSettings(max_images=2**31, max_image_bytes=2**62, max_pixels=2**62)
    return load_images(_image_parts(messages, "messages"), unlimited)


def _image_parts(messages: list[dict[str, Any]], where: str) -> list[tuple[common_pb2.Image, str]]:
    """Each `image_url` part of `messages` as an Image of its URL, with where it is."""
    return [
        (common_pb2.Image(url=part["image_url"]["url"]), f"{where}[{i}].content[{j}]")
        for i, message in enumerate(messages)
        if isinstance(message.get("content"), list)
        for j, part in enumerate(message["content"])
        if part.get("type") == "image_url"
    ]


def _read_url(url: str, settings: ImageSettings, where: str) -> tuple[bytes, str]:
    """The bytes of a `data:` or `file:` URL, and the media type it declares ('' for a
    file: the bytes say)."""
    scheme = urlparse(url).scheme
    if scheme == "data":
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise InvalidArgumentError(
                f"{where}: a data URL must be data:<media type>;base64,<bytes>; got {url[:40]!r}..."
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise InvalidArgumentError(
                f"{where}: the data URL's base64 is malformed: {e}"
            ) from None
        return data, header.removeprefix("data:").removesuffix(";base64")
    if scheme == "file":
        return _read_file(Path(unquote(urlparse(url).path)), settings, where), ""
    raise InvalidArgumentError(
        f"{where}: {scheme or 'a'}:// image URLs are refused (services never fetch from the "
        f"network); send the bytes inline, or a file: URL under image file_dirs"
    )


def _read_file(path: Path, settings: ImageSettings, where: str) -> bytes:
    resolved = path.resolve()
    allowed = [Path(folder).resolve() for folder in settings.file_dirs]
    if not any(resolved.is_relative_to(folder) for folder in allowed):
        raise InvalidArgumentError(
            f"{where}: file {str(path)!r} is outside the folders images may be read from "
            f"(file_dirs: {settings.file_dirs})"
        )
    try:
        size = resolved.stat().st_size
        if size > settings.max_image_bytes:
            raise InvalidArgumentError(_too_many_bytes(where, size, settings))
        return resolved.read_bytes()
    except OSError as e:
        raise InvalidArgumentError(f"{where}: cannot read {str(path)!r}: {e.strerror}") from None


def _checked(data: bytes, declared: str, settings: ImageSettings, where: str) -> LoadedImage:
    if len(data) > settings.max_image_bytes:
        raise InvalidArgumentError(_too_many_bytes(where, len(data), settings))
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            encoded_as, (width, height) = image.format, image.size
            if encoded_as in MIME_TYPES and width * height <= settings.max_pixels:
                image.load()  # decodes every byte: a truncated or corrupt file fails here
    except PIL.UnidentifiedImageError:  # its message names an in-memory buffer, not the item
        raise InvalidArgumentError(
            f"{where}: not a readable image (no image format recognised in its bytes)"
        ) from None
    except (PIL.Image.DecompressionBombError, OSError, ValueError) as e:
        raise InvalidArgumentError(f"{where}: not a readable image: {e}") from None
    if encoded_as not in MIME_TYPES:
        raise InvalidArgumentError(
            f"{where}: {encoded_as} images are not accepted; send one of {sorted(MIME_TYPES)}"
        )
    if declared and declared != MIME_TYPES[encoded_as]:
        raise InvalidArgumentError(
            f"{where}: declared {declared!r} but the bytes are {MIME_TYPES[encoded_as]!r}"
        )
    if width * height > settings.max_pixels:
        raise InvalidArgumentError(
            f"{where}: {width}x{height} is {width * height} pixels; at most "
            f"max_pixels={settings.max_pixels}"
        )
    return LoadedImage(
        data=data,
        mime_type=MIME_TYPES[encoded_as],
        sha256=hashlib.sha256(data).hexdigest(),
        width=width,
        height=height,
    )


def _too_many_bytes(where: str, size: int, settings: ImageSettings) -> str:
    return f"{where}: {size} bytes; at most max_image_bytes={settings.max_image_bytes}"
