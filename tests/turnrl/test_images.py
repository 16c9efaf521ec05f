"""turnrl.images: the images a service accepts (inline, data: URLs, file: URLs under the
configured folders; PNG, JPEG, WebP), and a clear error naming the item for everything else."""

import base64
import hashlib
import io
import random

import PIL.Image
import pytest

from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, load_image, load_images, load_message_images
from turnrl.v1 import common_pb2

SETTINGS = ImageSettings()


def encoded(format: str, size: tuple[int, int] = (12, 8), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, size, color=(200, 30, 60)[: len(mode)] or 1).save(buffer, format=format)
    return buffer.getvalue()


def noise_png() -> bytes:
    """A PNG whose pixel data does not compress away: cut short, it cannot decode."""
    buffer = io.BytesIO()
    PIL.Image.frombytes("RGB", (32, 32), random.Random(0).randbytes(32 * 32 * 3)).save(
        buffer, format="PNG"
    )
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("format", "mime_type"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]
)
def test_inline_and_data_url_images_load_with_their_hash_and_size(format, mime_type):
    data = encoded(format)
    inline = load_image(common_pb2.Image(data=data, mime_type=mime_type), SETTINGS, "image")
    url = f"data:{mime_type};base64,{base64.b64encode(data).decode()}"
    from_url = load_image(common_pb2.Image(url=url), SETTINGS, "image")
    assert inline == from_url
    assert (inline.width, inline.height, inline.mime_type) == (12, 8, mime_type)
    assert inline.sha256 == hashlib.sha256(data).hexdigest()
    assert inline.rgb().size == (12, 8) and inline.rgb().mode == "RGB"
    assert inline.to_proto() == common_pb2.Image(data=data, mime_type=mime_type)


def test_a_file_url_is_read_only_under_the_configured_folders(tmp_path):
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "a.png").write_bytes(encoded("PNG"))
    (tmp_path / "secret.png").write_bytes(encoded("PNG"))
    settings = ImageSettings(file_dirs=[str(tmp_path / "allowed")])
    loaded = load_image(common_pb2.Image(url=f"file://{tmp_path}/allowed/a.png"), settings, "x")
    assert loaded.mime_type == "image/png"
    for outside in (f"{tmp_path}/secret.png", f"{tmp_path}/allowed/../secret.png"):
        with pytest.raises(InvalidArgumentError, match=r"x: file .* is outside the folders"):
            load_image(common_pb2.Image(url=f"file://{outside}"), settings, "x")
    with pytest.raises(InvalidArgumentError, match=r"outside .*file_dirs: \[\]"):
        load_image(common_pb2.Image(url=f"file://{tmp_path}/allowed/a.png"), SETTINGS, "x")
    with pytest.raises(InvalidArgumentError, match=r"cannot read .*missing\.png"):
        load_image(common_pb2.Image(url=f"file://{tmp_path}/allowed/missing.png"), settings, "x")


@pytest.mark.parametrize(
    "url", ["https://example.com/a.png", "http://127.0.0.1/a.png", "ftp://h/a.png", "a.png"]
)
def test_remote_urls_are_refused_without_a_fetch(url):
    with pytest.raises(InvalidArgumentError, match="image URLs are refused"):
        load_image(common_pb2.Image(url=url), SETTINGS, "messages[0].content[1].image")


@pytest.mark.parametrize(
    ("image", "error"),
    [
        (common_pb2.Image(), "neither data nor url"),
        (common_pb2.Image(data=b"x", url="data:,"), "not both"),
        (common_pb2.Image(data=encoded("PNG")), "mime_type is required"),
        (common_pb2.Image(data=b"not an image", mime_type="image/png"), "not a readable image"),
        (common_pb2.Image(data=noise_png()[:1500], mime_type="image/png"), "not a readable image"),
        (
            common_pb2.Image(data=encoded("GIF", mode="P"), mime_type="image/gif"),
            "GIF images are not accepted",
        ),
        (
            common_pb2.Image(data=encoded("JPEG"), mime_type="image/png"),
            "declared 'image/png' but the bytes are 'image/jpeg'",
        ),
        (common_pb2.Image(url="data:image/png,abc"), "must be data:<media type>;base64"),
        (common_pb2.Image(url="data:image/png;base64,@@@"), "base64 is malformed"),
    ],
)
def test_bad_images_fail_with_an_error_naming_the_item(image, error):
    with pytest.raises(InvalidArgumentError, match=f"^tool_result.images\\[2\\]: .*{error}"):
        load_image(image, SETTINGS, "tool_result.images[2]")


def test_the_limits_are_settings():
    data = encoded("PNG", size=(40, 30))
    image = common_pb2.Image(data=data, mime_type="image/png")
    with pytest.raises(
        InvalidArgumentError, match=f"{len(data)} bytes; at most max_image_bytes=10"
    ):
        load_image(image, ImageSettings(max_image_bytes=10), "x")
    with pytest.raises(InvalidArgumentError, match="40x30 is 1200 pixels; at most max_pixels=1000"):
        load_image(image, ImageSettings(max_pixels=1000), "x")
    assert load_image(image, ImageSettings(max_pixels=1200), "x").width == 40
    items = [(image, f"images[{i}]") for i in range(3)]
    with pytest.raises(InvalidArgumentError, match=r"3 images .* max_images=2 .*images\[2\]"):
        load_images(items, ImageSettings(max_images=2))
    assert len(load_images(items, ImageSettings(max_images=3))) == 3


def test_the_images_of_messages_load_in_order_and_the_messages_hold_their_bytes(tmp_path):
    (tmp_path / "a.png").write_bytes(encoded("PNG"))
    jpeg = encoded("JPEG")
    messages = [
        {"role": "system", "content": "Look."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/a.png"}},
                {"type": "text", "text": "and"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": load_image(
                            common_pb2.Image(data=jpeg, mime_type="image/jpeg"), SETTINGS, "x"
                        ).data_url()
                    },
                },
            ],
        },
    ]
    settings = ImageSettings(file_dirs=[str(tmp_path)])
    inlined, images = load_message_images(messages, settings, "prompts[0].messages")
    assert [image.mime_type for image in images] == ["image/png", "image/jpeg"]
    assert images[1].data == jpeg
    urls = [part["image_url"]["url"] for part in inlined[1]["content"] if "image_url" in part]
    assert urls == [image.data_url() for image in images]
    assert inlined[0] == messages[0] and inlined[1]["content"][1] == messages[1]["content"][1]
    assert load_message_images(messages[:1], settings, "m") == (messages[:1], [])
    with pytest.raises(
        InvalidArgumentError, match=r"^prompts\[0\]\.messages\[1\]\.content\[0\]: file"
    ):
        load_message_images(messages, SETTINGS, "prompts[0].messages")
