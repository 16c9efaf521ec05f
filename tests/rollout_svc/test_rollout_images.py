"""Images through the rollout service (issue 35): a prompt with an image, sent over gRPC to the
rollout service on a tiny random Qwen2.5-VL (the hf engine, Qwen2.5-VL's real processor config
and chat template), comes back with the image's tokens where its record says, expanded as the
processor does, and logprobs equal to one forward over the whole trajectory with the image's
pixel values. Bad images are refused, naming the item."""

import base64
from pathlib import Path

import pytest
import torch

from tests.rollout_svc.test_rollout_service import generate, rollout_stack
from tests.tiny_vlm import IMAGE_TOKEN, forward_logprobs, png_bytes, save_tiny_vlm, tiny_vlm
from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, load_image
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2
from turnrl.vision import VisionProcessor


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, fixtures: Path) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), fixtures)


def image_prompt(image: common_pb2.Image) -> rollout_pb2.RolloutPrompt:
    message = common_pb2.Message(role=common_pb2.Message.ROLE_USER)
    message.content.add(image=image)
    message.content.add(text="What number is this?")
    return rollout_pb2.RolloutPrompt(prompt_id="p0", messages=[message])


def request(prompt: rollout_pb2.RolloutPrompt) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[prompt],
        n=2,
        max_turns=1,
        limits=common_pb2.LengthLimits(max_new_tokens=8),
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=3),
    )


async def test_an_image_prompt_comes_back_token_exact_with_its_record_and_logprobs(vlm_dir):
    data = png_bytes(90, 60, seed=7)
    image = common_pb2.Image(data=data, mime_type="image/png")
    chat_template = str(vlm_dir / "chat_template.jinja")
    async with rollout_stack(vlm_dir, chat_template_path=chat_template) as stub:
        replies = await generate(stub, request(image_prompt(image)))
    processed = VisionProcessor(vlm_dir).process(load_image(image, ImageSettings(), "x"))
    model = type(tiny_vlm()).from_pretrained(vlm_dir, dtype=torch.float32).eval()
    assert len(replies) == 2
    for reply in replies:
        trajectory = Trajectory.from_proto(reply)
        (record,) = trajectory.images
        assert record.grid_thw == processed.grid_thw
        assert record.token_count == processed.token_count
        ids = trajectory.token_ids
        span = ids[record.token_offset : record.token_offset + record.token_count]
        assert span == [IMAGE_TOKEN] * record.token_count
        assert ids.count(IMAGE_TOKEN) == record.token_count
        url = trajectory.messages[0]["content"][0]["image_url"]["url"]
        assert base64.b64decode(url.partition(",")[2]) == data
        expected = forward_logprobs(model, ids, [processed])
        mask = torch.tensor(trajectory.loss_mask[1:])
        engine = torch.tensor(trajectory.rollout_logprobs[1:])
        assert mask.sum() > 0 and not any(trajectory.loss_mask[: record.token_offset + 1])
        torch.testing.assert_close(engine[mask], expected[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("image", "error"),
    [
        (common_pb2.Image(url="https://example.com/a.png"), "image URLs are refused"),
        (common_pb2.Image(data=b"not a png", mime_type="image/png"), "not a readable image"),
        (
            common_pb2.Image(data=png_bytes(8, 8, 0), mime_type="image/jpeg"),
            "declared 'image/jpeg' but the bytes are 'image/png'",
        ),
    ],
)
async def test_a_bad_image_is_refused_naming_it(vlm_dir, image, error):
    async with rollout_stack(vlm_dir) as stub:
        with pytest.raises(InvalidArgumentError) as refused:
            await generate(stub, request(image_prompt(image)))
    assert "prompts[0].messages[0].content[0]: " in str(refused.value)
    assert error in str(refused.value)


async def test_an_image_for_a_text_model_is_refused(tiny_model_dir):
    image = common_pb2.Image(data=png_bytes(8, 8, 0), mime_type="image/png")
    async with rollout_stack(tiny_model_dir) as stub:
        with pytest.raises(InvalidArgumentError, match="hold 1 images, but the model is text-only"):
            await generate(stub, request(image_prompt(image)))
