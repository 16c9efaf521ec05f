"""The hf engine on a vision-language model (a tiny random Qwen2.5-VL): requests with images
sample what one forward over the whole sequence with the images' pixel values gives, greedy
token for token and logprob for logprob; two prompts whose ids are alike but whose images
differ are not taken for one; a session's next turn, with a new image, reuses its KV."""

import asyncio
from pathlib import Path

import pytest
import torch

from rollout_svc.engines.base import EngineImage, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from tests.rollout_svc.hf_engine_fixtures import model_dir as model_dir  # the text model
from tests.tiny_vlm import IMAGE_TOKEN, image_tokens, random_image, save_tiny_vlm, tiny_vlm
from turnrl.errors import InvalidArgumentError

MAX_MODEL_LEN = 256
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, fixtures: Path) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), fixtures)


@torch.no_grad()
def reference_greedy(
    model, ids: list[int], images: list[EngineImage], new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, each from a forward over the whole sequence."""
    pixel_values = torch.cat([image.processed.pixel_values for image in images])
    grids = torch.tensor([image.processed.grid_thw for image in images])
    tokens, logprobs = list(ids), []
    for _ in range(new_tokens):
        input_ids = torch.tensor([tokens])
        logits = model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=grids,
            mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
        ).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
    return tokens[len(ids) :], logprobs


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)


async def test_prompts_alike_but_for_their_images_sample_what_their_images_give(vlm_dir):
    model = type(tiny_vlm()).from_pretrained(vlm_dir, dtype=torch.float32).eval()
    engine = await HfEngine.create(HfEngineOptions(), str(vlm_dir), MAX_MODEL_LEN)
    try:
        first, second = random_image(3, (1, 4, 6), seed=1), random_image(3, (1, 4, 6), seed=2)
        ids = [5, 6, *image_tokens(first), *range(20, 60)]
        outputs = await asyncio.gather(
            *(
                engine.generate(ids, greedy(), f"r{index}", images=[image])
                for index, image in enumerate([first, second, first])
            )
        )
    finally:
        await engine.close()
    for output, image in zip(outputs, [first, second, first], strict=True):
        expected_ids, expected_logprobs = reference_greedy(model, ids, [image], NEW_TOKENS)
        assert output.output_ids == expected_ids
        assert output.logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert outputs[0].logprobs != outputs[1].logprobs  # the image changed what was sampled


async def test_a_sessions_next_turn_with_a_new_image_reuses_the_first_turns_kv(vlm_dir):
    model = type(tiny_vlm()).from_pretrained(vlm_dir, dtype=torch.float32).eval()
    engine = await HfEngine.create(HfEngineOptions(), str(vlm_dir), MAX_MODEL_LEN)
    try:
        first = random_image(3, (1, 4, 6), seed=1)
        prompt = [5, 6, *image_tokens(first), 7, 8]
        turn = await engine.generate(prompt, greedy(), "t0", "session", images=[first])
        before_tool = [*prompt, *turn.output_ids, 30, 31]
        second = random_image(len(before_tool) + 1, (1, 2, 4), seed=3)
        ids = [*before_tool, *image_tokens(second), 32, 33]
        images = [first, second]
        next_turn = await engine.generate(ids, greedy(), "t1", "session", images=images)
    finally:
        await engine.close()
    assert next_turn.metrics["cached_prompt_tokens"] >= len(prompt)
    expected_ids, expected_logprobs = reference_greedy(model, ids, images, NEW_TOKENS)
    assert next_turn.output_ids == expected_ids
    assert next_turn.logprobs == pytest.approx(expected_logprobs, abs=1e-4)


async def test_images_for_a_text_model_or_off_their_tokens_are_refused(vlm_dir, model_dir):
    image = random_image(3, (1, 4, 6), seed=1)
    ids = [5, 6, *image_tokens(image), 7]
    text_engine = await HfEngine.create(HfEngineOptions(), str(model_dir), MAX_MODEL_LEN)
    vision_engine = await HfEngine.create(HfEngineOptions(), str(vlm_dir), MAX_MODEL_LEN)
    try:
        with pytest.raises(InvalidArgumentError, match="1 images for a text-only model"):
            await text_engine.generate([1, 2, 3], greedy(), "r", images=[image])
        with pytest.raises(InvalidArgumentError, match="is not 6 image tokens at 2"):
            await vision_engine.generate(ids, greedy(), "r", images=[random_image(2, (1, 4, 6), 1)])
        assert (await vision_engine.generate(ids, greedy(), "r", images=[image])).output_ids
    finally:
        await text_engine.close()
        await vision_engine.close()
