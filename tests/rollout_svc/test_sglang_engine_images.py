"""Images through the SGLang engine (issue 35), against the stand-in speaking SGLang 0.5.23's
/generate with `image_data` (`sglang_stand_in_images`) and serving a real tiny VLM: each image
goes as its bytes with one image pad in the ids, the server expands it with its own processor,
and the prompt it made is checked against turnrl's. Through the rollout service, an image tool
result's turn carries both images."""

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout_svc.engines.base import EngineImage, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.sglang_stand_in import SglangStandIn, engine_options
from tests.rollout_svc.test_rollout_service import generate, rollout_server
from tests.tiny_vlm import ZOOM_OPTIONS, ZOOM_QUESTION, data_url, png_bytes
from tests.tool_svc.http_stand_in import serve_app
from tool_svc.config import ToolEntry
from turnrl.errors import FailedPreconditionError
from turnrl.images import ImageSettings, load_image
from turnrl.messages import dict_to_message
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2
from turnrl.vision import VisionProcessor

MAX_MODEL_LEN = 2048


@contextlib.asynccontextmanager
async def sglang_on(model_dir: Path, processor_dir: Path | None = None) -> AsyncIterator[tuple]:
    """A stand-in SGLang server of the model in `model_dir` (an hf engine behind its API),
    expanding images with the processor of `processor_dir` (default the model's); yields it
    and its URL."""
    model = await HfEngine.create(HfEngineOptions(), str(model_dir), MAX_MODEL_LEN)
    vision = VisionProcessor(processor_dir or model_dir)
    server = SglangStandIn(model_path=str(model_dir), model=model, vision=vision)
    try:
        async with serve_app(server.app()) as url:
            yield server, url
    finally:
        await model.close()


def image_prompt(vision: VisionProcessor, data: bytes) -> tuple[list[int], EngineImage]:
    """Ids around one image's expanded tokens, and the image."""
    image = load_image(common_pb2.Image(data=data, mime_type="image/png"), ImageSettings(), "x")
    processed = vision.process(image)
    ids = [5, 6, vision.image_token_id - 1, *[vision.image_token_id] * processed.token_count, 9]
    return ids, EngineImage(3, image, processed)


def other_processor(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of `model_dir` whose image processor resizes every image to about 1,568 pixels
    (its min and max): a server reading it expands images otherwise than the model folder."""
    other = tmp_path / "other-processor"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["min_pixels"] = config["max_pixels"] = 28 * 28 * 2
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    return other


async def test_an_image_goes_as_its_bytes_with_one_pad_and_samples_as_on_the_model(
    zoom_caller_dir,
):
    vision = VisionProcessor(zoom_caller_dir)
    ids, image = image_prompt(vision, png_bytes(84, 56, seed=3))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with sglang_on(zoom_caller_dir) as (server, url):
        options = SglangEngineOptions(url=url, **engine_options())
        engine = await SglangEngine.create(options, str(zoom_caller_dir), MAX_MODEL_LEN)
        try:
            output = await engine.generate(ids, greedy, "r0", images=[image])
        finally:
            await engine.close()
        [body] = server.bodies("/generate")
        direct = await server.model.generate(ids, greedy, "direct", images=[image])
    assert body["input_ids"] == [5, 6, vision.image_token_id - 1, vision.image_token_id, 9]
    assert body["image_data"] == [data_url(image.image.data)]
    assert body["return_prompt_token_ids"] is True
    assert output.output_ids == direct.output_ids and output.logprobs == direct.logprobs


async def test_a_server_whose_processor_expands_otherwise_is_refused(zoom_caller_dir, tmp_path):
    """A server reading other image settings (max_pixels) makes other image tokens: the
    prompt it sampled from is not the trajectory's, so the turn is refused, saying why."""
    other = other_processor(zoom_caller_dir, tmp_path)
    ids, image = image_prompt(VisionProcessor(zoom_caller_dir), png_bytes(84, 56, seed=3))
    async with sglang_on(zoom_caller_dir, processor_dir=other) as (_, url):
        options = SglangEngineOptions(url=url, **engine_options())
        engine = await SglangEngine.create(options, str(zoom_caller_dir), MAX_MODEL_LEN)
        try:
            with pytest.raises(FailedPreconditionError) as caught:
                await engine.generate(ids, SamplingParams(max_new_tokens=2), "r", images=[image])
        finally:
            await engine.close()
    served = (
        len(ids)
        - image.processed.token_count
        + VisionProcessor(other).process(image.image).token_count
    )
    assert served != len(ids)
    assert f"a prompt of {served} tokens of the {len(ids)}" in str(caught.value)
    assert "image processor settings" in str(caught.value)


async def test_a_tool_results_image_rides_the_next_turn_with_the_prompts(zoom_caller_dir):
    """The zoom caller on SGLang through the rollout service: its image_zoom call's result
    (an image) goes to the server with the prompt's, each as one pad, and the trajectory holds
    both, token-exact."""
    image = png_bytes(56, 56, seed=5)
    prompt = rollout_pb2.RolloutPrompt(
        prompt_id="z",
        messages=[
            dict_to_message(
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(image)}},
                        {"type": "text", "text": ZOOM_QUESTION},
                    ],
                }
            )
        ],
        tool_names=["image_zoom"],
    )
    prompt.tools_kwargs.update({"image_zoom": {"create_kwargs": {"image": data_url(image)}}})
    request = rollout_pb2.GenerateRequest(
        prompts=[prompt], n=1, max_turns=2,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        limits=common_pb2.LengthLimits(max_new_tokens=64),
    )  # fmt: skip
    vision = VisionProcessor(zoom_caller_dir)
    zoom = ToolEntry(class_name="image_zoom", config=ZOOM_OPTIONS)
    async with (
        sglang_on(zoom_caller_dir) as (server, url),
        tool_service_address(zoom) as tools,
        reward_service_address() as rewards,
        rollout_server(
            zoom_caller_dir, tools, rewards,
            engine="sglang", engine_options=engine_options(url=url),
            chat_template_path=str(zoom_caller_dir / "chat_template.jinja"),
        ) as stub,
    ):  # fmt: skip
        [reply] = await generate(stub, request)
    trajectory = Trajectory.from_proto(reply)
    assert trajectory.metrics["tool_calls"] == 1 and trajectory.metrics["tool_errors"] == 0
    assert len(trajectory.images) == 2
    first, second = server.bodies("/generate")
    assert first["input_ids"].count(vision.image_token_id) == 1
    assert second["input_ids"].count(vision.image_token_id) == 2
    assert second["image_data"][0] == data_url(image) and len(second["image_data"]) == 2
    # The engine checked that the server expanded each turn's prompt to the trajectory's ids.
    assert trajectory.error_message == ""
