"""`image_zoom`: the enlarged region of a session's image, and the errors a model reads."""

import base64
import io

import PIL.Image
import pytest

from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.image_zoom import ImageZoomTool


def png_url(image: PIL.Image.Image) -> str:
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    return "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()


def quadrants() -> PIL.Image.Image:
    """40x20: red left half, the right half green on top and blue below."""
    image = PIL.Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 255, 0), (20, 0, 40, 10))
    image.paste((0, 0, 255), (20, 10, 40, 20))
    return image


async def zoom_tool(**options) -> ImageZoomTool:
    [tool] = await ImageZoomTool.from_config("image_zoom", options, None)
    return tool


def decoded(result) -> PIL.Image.Image:
    [image] = result.images
    assert image.mime_type == "image/png"
    return PIL.Image.open(io.BytesIO(image.data)).convert("RGB")


async def test_a_region_comes_back_enlarged_to_the_zoomed_size():
    tool = await zoom_tool(zoomed_size=64, resample="nearest")
    session = await tool.create(image=png_url(quadrants()))
    result = await tool.execute(session, tool.parse_args('{"bbox_2d": [20, 8, 36, 12]}'))
    region = decoded(result)
    assert region.size == (64, 16)  # 16x4 scaled 4x
    assert region.getpixel((0, 0)) == (0, 255, 0) and region.getpixel((0, 15)) == (0, 0, 255)
    assert {region.getpixel((x, 7)) for x in range(64)} == {(0, 255, 0)}
    assert result.text == "Region [20, 8, 36, 12] of the 40x20 image, shown at 64x16."


@pytest.mark.parametrize(
    "box, words",
    [
        ([0, 0, 41, 20], "not a box inside the 40x20 image"),
        ([10, 5, 10, 15], "not a box inside the 40x20 image"),
        ([-1, 0, 10, 10], "not a box inside the 40x20 image"),
        ([0, 0, 20, 2], "is 20x2 pixels; each side must be at least 4"),
    ],
)
async def test_a_box_outside_the_image_or_too_small_is_the_models_error(box, words):
    tool = await zoom_tool()
    session = await tool.create(image=png_url(quadrants()))
    with pytest.raises(ToolCallError) as caught:
        await tool.execute(session, {"bbox_2d": box})
    assert caught.value.kind == ToolErrorKind.INVALID_ARGUMENTS
    assert words in caught.value.message


async def test_arguments_are_checked_against_the_schema():
    tool = await zoom_tool()
    for raw in ('{"bbox_2d": [1, 2, 3]}', '{"bbox_2d": [1, 2, 3, 4.5]}', "{}"):
        with pytest.raises(ToolCallError) as caught:
            tool.parse_args(raw)
        assert caught.value.kind == ToolErrorKind.INVALID_ARGUMENTS


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({}, "one session kwarg, `image`"),
        ({"image": "https://example.com/a.png"}, "image URLs are refused"),
        ({"image": "data:image/png;base64,aGVsbG8="}, "not a readable image"),
        ({"image": png_url(quadrants()), "label": "x"}, "got keys ['image', 'label']"),
    ],
)
async def test_a_session_image_that_is_not_one_is_refused(kwargs, words):
    tool = await zoom_tool()
    with pytest.raises(ValueError) as caught:
        await tool.create(**kwargs)
    assert words in str(caught.value)


async def test_the_session_image_limits_apply():
    tool = await zoom_tool(images={"max_pixels": 100})
    with pytest.raises(ValueError) as caught:
        await tool.create(image=png_url(quadrants()))
    assert "40x20 is 800 pixels; at most max_pixels=100" in str(caught.value)
