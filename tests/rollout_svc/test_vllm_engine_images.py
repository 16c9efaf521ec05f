"""Images through the vLLM engine (issue 35), against a stand-in of vLLM 0.32's token-in
/inference/v1/generate serving a real tiny VLM (`vllm_stand_in`: vLLM's CPU build cannot load a
vision-language processor here, see there): each image goes as its bytes in `content_parts`
with one image pad in `token_ids`, the server expands it with its own processor, and the prompt
it made (`return_token_ids`) is checked against turnrl's."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from rollout_svc.engines.vllm import VllmEngine, VllmEngineOptions
from tests.rollout_svc.test_sglang_engine_images import (
    MAX_MODEL_LEN,
    image_prompt,
    other_processor,
)
from tests.rollout_svc.vllm_stand_in import VllmVisionStandIn
from tests.tiny_vlm import data_url, png_bytes
from tests.tool_svc.http_stand_in import serve_app
from turnrl.errors import FailedPreconditionError
from turnrl.vision import VisionProcessor


@contextlib.asynccontextmanager
async def vllm_engine_on(
    model_dir: Path, processor_dir: Path | None = None
) -> AsyncIterator[tuple[VllmVisionStandIn, VllmEngine]]:
    """A vLLM engine connected to a stand-in server of the model in `model_dir`, which expands
    images with the processor of `processor_dir` (default the model's)."""
    model = await HfEngine.create(HfEngineOptions(), str(model_dir), MAX_MODEL_LEN)
    vision = VisionProcessor(processor_dir or model_dir)
    server = VllmVisionStandIn(str(model_dir), model, vision, MAX_MODEL_LEN)
    try:
        async with serve_app(server.app()) as url:
            options = VllmEngineOptions(url=url, request_timeout_seconds=60.0)
            engine = await VllmEngine.create(options, str(model_dir), MAX_MODEL_LEN)
            try:
                yield server, engine
            finally:
                await engine.close()
    finally:
        await model.close()


async def test_an_image_goes_as_its_bytes_with_one_pad_and_samples_as_on_the_model(
    zoom_caller_dir,
):
    vision = VisionProcessor(zoom_caller_dir)
    ids, image = image_prompt(vision, png_bytes(84, 56, seed=3))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with vllm_engine_on(zoom_caller_dir) as (server, engine):
        output = await engine.generate(ids, greedy, "r0", images=[image])
        direct = await server.model.generate(ids, greedy, "direct", images=[image])
    [body] = server.generate_bodies
    assert body["token_ids"] == [5, 6, vision.image_token_id - 1, vision.image_token_id, 9]
    assert body["content_parts"] == [{"type": "image_url", "url": data_url(image.image.data)}]
    assert body["return_token_ids"] is True
    assert output.output_ids == direct.output_ids and output.logprobs == direct.logprobs


async def test_a_server_whose_processor_expands_otherwise_is_refused(zoom_caller_dir, tmp_path):
    other = other_processor(zoom_caller_dir, tmp_path)
    ids, image = image_prompt(VisionProcessor(zoom_caller_dir), png_bytes(84, 56, seed=3))
    async with vllm_engine_on(zoom_caller_dir, processor_dir=other) as (_, engine):
        with pytest.raises(FailedPreconditionError, match="image processor settings"):
            await engine.generate(ids, SamplingParams(max_new_tokens=2), "r", images=[image])
