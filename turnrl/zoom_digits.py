"""Digits too small to read until zoomed in: the CPU-scale visual tool task's data.

An image of GRID x GRID cells of CELL pixels holds a few digits, each a 5 x 7 bitmap drawn at
twice its size in a cell of its own. The question names one cell by row and column. The tiny
VLM's processor shrinks the whole 112-pixel image to 28 pixels (its `max_pixels`), which leaves
each digit a blur of 3 x 4 pixels, while the `image_zoom` tool on that cell returns it doubled,
28 pixels a side, where the digit is plain. Its solved conversation, in OpenAI message format:

    system     SYSTEM_PROMPT
    user       [the image] "Which digit is in row 2, column 3?"
    assistant  tool call image_zoom {"bbox_2d": [28, 14, 42, 28]}
    tool       "Region [28, 14, 42, 28] of the 112x112 image, shown at 28x28." [the cell]
    assistant  "#### 7"

graded by the reward service's `gsm8k` scorer (DATA_SOURCE; the answer after `####`). The train
and test splits never share an image (a hash of its layout picks its split).
"""

import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import PIL.Image

from turnrl.images import data_url
from turnrl.messages import openai_tool_call
from turnrl.splits import Split, check_split, split_of

SYSTEM_PROMPT = (
    "Read the digit the question asks for. The image is small: zoom in with the image_zoom "
    "tool. Give the final answer as #### N."
)
DATA_SOURCE = "turnrl_zoom"
GRID = 8  # cells a side
CELL = 14  # a cell's side in pixels: the image is GRID * CELL pixels a side
SCALE = 2  # each font pixel is SCALE x SCALE image pixels
DIGITS_PER_IMAGE = 4  # the asked digit and the others, each in a cell of its own
# A 5 x 7 bitmap font: a row of five pixels per string, "#" drawn.
_FONT = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
}
_FONT_WIDTH, _FONT_HEIGHT = 5, 7
# Where a glyph's top-left pixel may sit in its cell (ranges, end exclusive): a few pixels of
# play sideways; a glyph is as tall as its cell.
_GLYPH_LEFT = (0, CELL - SCALE * _FONT_WIDTH + 1)
_GLYPH_TOP = (0, CELL - SCALE * _FONT_HEIGHT + 1)


@dataclass(frozen=True)
class PlacedDigit:
    digit: int
    row: int  # 1-based, as the question names it
    column: int
    left: int  # the glyph's top-left pixel inside its cell
    top: int


@dataclass(frozen=True)
class ZoomProblem:
    """One image and the cell it asks about (the first of `digits`)."""

    digits: tuple[PlacedDigit, ...]
    guess: int  # the answer of the warm start's conversations that answer without the tool

    @property
    def asked(self) -> PlacedDigit:
        return self.digits[0]

    @property
    def answer(self) -> int:
        return self.asked.digit

    @property
    def question(self) -> str:
        return f"Which digit is in row {self.asked.row}, column {self.asked.column}?"

    @property
    def bbox(self) -> list[int]:
        """The asked cell as image_zoom's `bbox_2d`: [left, top, right, bottom]."""
        left, top = (self.asked.column - 1) * CELL, (self.asked.row - 1) * CELL
        return [left, top, left + CELL, top + CELL]

    @property
    def image_url(self) -> str:
        """The image as a PNG `data:` URL."""
        return data_url(self.png(), "image/png")

    def png(self) -> bytes:
        side = GRID * CELL
        image = PIL.Image.new("L", (side, side), 255)
        for placed in self.digits:
            x0 = (placed.column - 1) * CELL + placed.left
            y0 = (placed.row - 1) * CELL + placed.top
            for y, line in enumerate(_FONT[str(placed.digit)]):
                for x, pixel in enumerate(line):
                    if pixel == "#":
                        box = (x0 + x * SCALE, y0 + y * SCALE)
                        image.paste(0, (*box, box[0] + SCALE, box[1] + SCALE))
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
        return buffer.getvalue()

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        image = {"type": "image_url", "image_url": {"url": self.image_url}}
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [image, {"type": "text", "text": self.question}]},
        ]

    @property
    def tools_kwargs(self) -> dict[str, Any]:
        """The tool service's session of image_zoom opens on this image."""
        return {"image_zoom": {"create_kwargs": {"image": self.image_url}}}

    def messages(self, zoomed: Callable[["ZoomProblem"], dict[str, Any]]) -> list[dict[str, Any]]:
        """The solved conversation; `zoomed` gives the tool message image_zoom answers this
        problem's call with (the tool's own text and image)."""
        call = openai_tool_call("call_0", "image_zoom", {"bbox_2d": self.bbox})
        return [
            *self.prompt_messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            zoomed(self),
            {"role": "assistant", "content": f"#### {self.answer}"},
        ]

    @property
    def guess_messages(self) -> list[dict[str, Any]]:
        """An answer at once, without zooming: a digit drawn at random, right by chance only."""
        return [*self.prompt_messages, {"role": "assistant", "content": f"#### {self.guess}"}]


def generate_problems(count: int, seed: int = 0, split: Split = "train") -> list[ZoomProblem]:
    """`count` problems of `split`, the same ones for the same seed."""
    check_split(split)
    draws = random.Random(f"zoom digits:{seed}")
    problems: list[ZoomProblem] = []
    while len(problems) < count:
        cells = draws.sample(range(GRID * GRID), DIGITS_PER_IMAGE)
        digits = tuple(
            PlacedDigit(
                digit=draws.randrange(10),
                row=cell // GRID + 1,
                column=cell % GRID + 1,
                left=draws.randrange(*_GLYPH_LEFT),
                top=draws.randrange(*_GLYPH_TOP),
            )
            for cell in cells
        )
        problem = ZoomProblem(digits, guess=draws.randrange(10))
        if split_of(repr(digits)) == split:
            problems.append(problem)
    return problems
