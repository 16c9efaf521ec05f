"""The CPU image task's problems: their images, what the real `image_zoom` tool shows of them,
what the tiny VLM's image processor leaves of them, and the real gsm8k scorer's grading."""

import io

import numpy as np
import PIL.Image

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from turnrl import zoom_digits
from turnrl.images import ImageSettings, load_image
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2
from turnrl.vision import VisionProcessor
from turnrl_demo.tiny_vlm import zoomed_tool_messages


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png)).convert("L"))


def glyph_pixels(digit: int) -> int:
    """The dark pixels of `digit` as drawn: its font's pixels, each SCALE x SCALE."""
    drawn = sum(line.count("#") for line in zoom_digits._FONT[str(digit)])
    return drawn * zoom_digits.SCALE**2


def test_problems_are_the_same_every_time_and_splits_share_no_image():
    train = zoom_digits.generate_problems(300, seed=0, split="train")
    assert zoom_digits.generate_problems(300, seed=0, split="train") == train
    test = zoom_digits.generate_problems(100, seed=0, split="test")
    assert not {p.digits for p in train} & {p.digits for p in test}
    assert {p.answer for p in test} == set(range(10))
    for problem in test:
        cells = {(d.row, d.column) for d in problem.digits}
        assert len(cells) == zoom_digits.DIGITS_PER_IMAGE
        assert f"row {problem.asked.row}, column {problem.asked.column}" in problem.question


def test_the_image_holds_each_digit_in_its_cell_and_nothing_else():
    problem = zoom_digits.generate_problems(1, seed=0, split="test")[0]
    image = pixels(problem.png())
    side = zoom_digits.GRID * zoom_digits.CELL
    assert image.shape == (side, side)
    assert (image < 128).sum() == sum(glyph_pixels(d.digit) for d in problem.digits)
    for placed in problem.digits:
        top, left = (placed.row - 1) * zoom_digits.CELL, (placed.column - 1) * zoom_digits.CELL
        cell = image[top : top + zoom_digits.CELL, left : left + zoom_digits.CELL]
        assert (cell < 128).sum() == glyph_pixels(placed.digit)


def test_the_zoom_tool_returns_the_asked_cell_doubled():
    """The conversations' tool message is the real image_zoom tool's answer to their call
    (ZOOM_OPTIONS): the asked cell at twice its size, the asked digit alone in it."""
    problems = zoom_digits.generate_problems(3, seed=0, split="train")
    messages = zoomed_tool_messages(problems)
    side = 2 * zoom_digits.CELL
    for problem in problems:
        text, image = messages[problem]["content"]
        assert text["text"] == (
            f"Region {problem.bbox} of the {zoom_digits.GRID * zoom_digits.CELL}x"
            f"{zoom_digits.GRID * zoom_digits.CELL} image, shown at {side}x{side}."
        )
        zoomed = pixels(load_image(url_image(image), ImageSettings(), "tool").data)
        assert zoomed.shape == (side, side)
        assert (zoomed < 128).sum() == 4 * glyph_pixels(problem.answer)
        left, top, right, bottom = problem.bbox
        cell = pixels(problem.png())[top:bottom, left:right]
        assert (zoomed == np.kron(cell, np.ones((2, 2), dtype=cell.dtype))).all()
        conversation = problem.messages(messages.__getitem__)
        call = conversation[2]["tool_calls"][0]["function"]
        assert call == {"name": "image_zoom", "arguments": {"bbox_2d": problem.bbox}}
        assert conversation[-1]["content"] == f"#### {problem.answer}"


def test_the_processor_sees_the_image_at_a_quarter_and_a_zoomed_cell_as_drawn(zoom_model_dir):
    """The tiny VLM's processor shrinks the 112-pixel image to 28 (2 x 2 patches of 14, one
    token), where a digit of 10 x 14 pixels is 3 x 4; a zoomed cell keeps its 28 pixels."""
    processor = VisionProcessor(zoom_model_dir)
    problem = zoom_digits.generate_problems(1, seed=0, split="test")[0]
    [image_part] = [p for p in problem.prompt_messages[1]["content"] if p["type"] == "image_url"]
    whole = processor.process(load_image(url_image(image_part), ImageSettings(), "prompt"))
    assert whole.grid_thw == (1, 2, 2) and whole.token_count == 1
    [message] = zoomed_tool_messages([problem]).values()
    zoomed = processor.process(load_image(url_image(message["content"][1]), ImageSettings(), ""))
    assert zoomed.grid_thw == (1, 2, 2)


def url_image(part: dict) -> common_pb2.Image:
    return dict_to_message({"role": "user", "content": [part]}).content[0].image


def test_the_gsm8k_scorer_credits_the_digit_and_a_wrong_guess_not():
    score = SCORERS[zoom_digits.DATA_SOURCE].ref.load()
    problem = zoom_digits.generate_problems(1, seed=0, split="test")[0]

    def graded(text: str) -> float:
        request = ScoringRequest(
            data_source=zoom_digits.DATA_SOURCE,
            response_text=text,
            ground_truth=str(problem.answer),
            extra_info={},
        )
        return score(request).score

    assert graded(f"#### {problem.answer}") == 1.0
    assert graded(f"#### {(problem.answer + 1) % 10}") == 0.0
