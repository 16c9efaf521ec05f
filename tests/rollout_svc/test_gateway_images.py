"""Images through the OpenAI-compatible gateway: `image_url` parts sent to a real gateway on
loopback serving a tiny random Qwen2.5-VL on the hf engine (Qwen2.5-VL's real processor config
and chat template, tests/tiny_vlm.py). A request with an image samples with the image's pixel
values, a session goes on token-exactly with its images where their tokens are, and bad images
are refused naming the part."""

import base64
import hashlib
import io
from pathlib import Path

import openai
import PIL.Image
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from tests.rollout_svc.test_gateway import end_session, gateway_server
from tests.tiny_vlm import IMAGE_TOKEN, data_url, forward_logprobs, png_bytes, save_tiny_vlm
from turnrl.chat_tokens import ConversationTokens
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2
from turnrl.vision import ProcessedImage, VisionProcessor

QUESTION = "What number is this?"
# A random model rarely samples its end of turn: a turn ends on one of these letters instead.
STOP = ["a", "e", "i", "o"]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, fixtures: Path) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), fixtures)


def image_message(data: bytes, role: str = "user", **image_url) -> dict:
    """A message with the image `data` (a PNG) before the question."""
    image = {"type": "image_url", "image_url": {"url": data_url(data), **image_url}}
    return {"role": role, "content": [image, {"type": "text", "text": QUESTION}]}


def processed(vlm_dir: Path, data: bytes) -> ProcessedImage:
    image = common_pb2.Image(data=data, mime_type="image/png")
    return VisionProcessor(vlm_dir).process(load_image(image, ImageSettings(), "test"))


def engine_logprobs_match_a_forward(
    vlm_dir: Path, trajectory: dict, images_of_parts: list[list[ProcessedImage]]
) -> None:
    """The engine's logprob of every model token is what one forward over its part's ids (the
    context it was sampled in) with that part's images' pixel values gives."""
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32)
    for (start, end), images in zip(trajectory["parts"], images_of_parts, strict=True):
        expected = forward_logprobs(model.eval(), trajectory["token_ids"][start:end], images)
        mask = torch.tensor(trajectory["loss_mask"][start + 1 : end])
        engine = torch.tensor(trajectory["logprobs"][start + 1 : end])
        assert mask.sum() > 0
        torch.testing.assert_close(engine[mask], expected[mask], atol=1e-4, rtol=0)


def check_image_records(trajectory: dict, images: list[tuple[bytes, ProcessedImage]]) -> None:
    """Each record is its image's, sits on a run of its image tokens, off the loss mask."""
    ids, loss_mask = trajectory["token_ids"], trajectory["loss_mask"]
    assert len(trajectory["images"]) == len(images)
    for record, (data, image) in zip(trajectory["images"], images, strict=True):
        assert record["sha256"] == hashlib.sha256(data).hexdigest()
        assert tuple(record["grid_thw"]) == image.grid_thw
        assert record["token_count"] == image.token_count
        span = range(record["token_offset"], record["token_offset"] + record["token_count"])
        assert [ids[i] for i in span] == [IMAGE_TOKEN] * image.token_count
        assert not any(loss_mask[i] for i in span)
    assert ids.count(IMAGE_TOKEN) == sum(image.token_count for _, image in images)


async def test_an_image_request_samples_with_the_image(vlm_dir):
    data = png_bytes(90, 60, seed=7)
    async with gateway_server(vlm_dir) as gateway:
        model = gateway.service.chat_sessions.model_name
        reply = await gateway.client("one").chat.completions.create(
            model=model,
            messages=[image_message(data)],
            temperature=1.0,
            seed=3,
            max_tokens=8,
            logprobs=True,
        )
        trajectory = await end_session(gateway.url, "one")
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    image = processed(vlm_dir, data)
    check_image_records(trajectory, [(data, image)])
    engine_logprobs_match_a_forward(vlm_dir, trajectory, [[image]])
    sampled = [t.logprob for t in reply.choices[0].logprobs.content]
    logprobs = zip(trajectory["logprobs"], trajectory["loss_mask"], strict=True)
    assert sampled == pytest.approx([logprob for logprob, in_loss in logprobs if in_loss])
    url = trajectory["messages"][0]["content"][0]["image_url"]["url"]
    assert base64.b64decode(url.partition(",")[2]) == data


async def test_a_session_with_images_goes_on_token_exactly(vlm_dir):
    """Two turns, an image in each user message: the second request sends the first back (its
    image part with a `detail`, matched by the image's bytes) and continues the session's
    tokens; a bad image on the way is refused and changes nothing. A third request that
    rewrites the history starts a new part with its own images."""
    first, second = png_bytes(56, 84, seed=1), png_bytes(70, 42, seed=2)
    async with gateway_server(vlm_dir) as gateway:
        chat = gateway.client("two")
        request = {
            "model": gateway.service.chat_sessions.model_name,
            "temperature": 1.0,
            "seed": 5,
            "max_tokens": 24,
            "stop": STOP,
        }
        turn = await chat.chat.completions.create(**request, messages=[image_message(first)])
        assert turn.choices[0].finish_reason == "stop"
        answer = {"role": "assistant", "content": turn.choices[0].message.content}
        history = [image_message(first, detail="auto"), answer]
        remote = image_message(second)
        remote["content"][0]["image_url"]["url"] = "https://example.com/a.png"
        with pytest.raises(openai.BadRequestError, match="image URLs are refused") as refused:
            await chat.chat.completions.create(**request, messages=[*history, remote])
        assert refused.value.param == "messages.2.content.0"
        await chat.chat.completions.create(**request, messages=[*history, image_message(second)])
        await chat.chat.completions.create(**request, messages=[image_message(second)])
        trajectory = await end_session(gateway.url, "two")
    (_, first_part_end), _ = trajectory["parts"]
    sources = [segment["source"] for segment in trajectory["segments"]]
    assert sources == ["prompt", "model", "user", "template", "model", "prompt", "model"]
    images = [processed(vlm_dir, first), processed(vlm_dir, second)]
    # What ConversationTokens makes of the conversation with the model's ids.
    tokens = ConversationTokens(
        AutoTokenizer.from_pretrained(vlm_dir), None, None, vision=VisionProcessor(vlm_dir)
    )
    first_turn, second_turn, _ = [
        segment["token_ids"] for segment in trajectory["segments"] if segment["source"] == "model"
    ]
    expected = tokens.prompt_ids([image_message(first)], images[:1]) + first_turn
    tokens.append_model_turn(first_turn, answer, ended_on_stop_string=True)
    expected += tokens.append_messages([image_message(second)], images[1:]) + second_turn
    assert trajectory["token_ids"][:first_part_end] == expected
    check_image_records(trajectory, [(first, images[0]), (second, images[1]), (second, images[1])])
    engine_logprobs_match_a_forward(vlm_dir, trajectory, [images, images[1:]])


async def test_bad_images_are_refused_naming_the_part(vlm_dir, tmp_path):
    image = png_bytes(8, 8, seed=0)
    (tmp_path / "a.png").write_bytes(image)
    remote = image_message(image)
    remote["content"][0]["image_url"]["url"] = "https://example.com/a.png"
    corrupt = image_message(image)
    corrupt["content"][0]["image_url"]["url"] = data_url(b"not a png")
    from_file = image_message(image)
    from_file["content"][0]["image_url"]["url"] = (tmp_path / "a.png").as_uri()
    many = {"role": "user", "content": image_message(image)["content"][:1] * 17}
    huge = io.BytesIO()
    PIL.Image.new("RGB", (4097, 4096)).save(huge, format="PNG")  # past max_pixels, 4096 x 4096
    cases = [
        ([remote], "messages[0].content[0]: https:// image URLs are refused", "messages.0.content.0"),
        ([corrupt], "messages[0].content[0]: not a readable image", "messages.0.content.0"),
        ([from_file], "is outside the folders images may be read from", "messages.0.content.0"),
        ([image_message(image), image_message(huge.getvalue())], "messages[1].content[0]: 4097x4096", "messages.1.content.0"),
        ([many], "17 images; at most max_images=16", "messages.0.content.16"),
        ([image_message(image, "system")], "an image in a 'system' message", "messages.0.content.0"),
        (
            [image_message(image), image_message(image, "assistant")],
            "messages[1].content[0]: an image in a 'assistant' message",
            "messages.1.content.0",
        ),
        ([image_message(image, detail="high")], "detail 'high' is not supported", "messages.0.content.0.image_url.detail"),
    ]  # fmt: skip
    async with gateway_server(vlm_dir) as gateway:
        chat = gateway.client("bad")
        model = gateway.service.chat_sessions.model_name
        for messages, message, param in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                await chat.chat.completions.create(model=model, messages=messages, max_tokens=1)
            assert message in refused.value.message
            assert refused.value.param == param
        # Nothing was recorded: the session's first request is still to come.
        reply = await chat.chat.completions.create(
            model=model, messages=[image_message(image)], max_tokens=1
        )
        assert reply.usage.completion_tokens == 1


async def test_an_image_for_a_text_model_is_refused(tiny_model_dir):
    async with gateway_server(tiny_model_dir) as gateway:
        with pytest.raises(openai.BadRequestError, match="is text-only") as refused:
            await gateway.client("text").chat.completions.create(
                model=gateway.service.chat_sessions.model_name,
                messages=[image_message(png_bytes(8, 8, seed=0))],
            )
    assert refused.value.param == "messages.0.content.0"
