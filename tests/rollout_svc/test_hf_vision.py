"""The hf engine's VLM inputs (rollout_svc/engines/hf_vision.py) on a tiny random Qwen2.5-VL:
a prefill in chunks, one of them stopping inside an image, and decode steps past the images
give the logits of one forward over the whole sequence with the images' pixel values."""

import pytest
import torch
from transformers import DynamicCache

from rollout_svc.engines.hf_vision import RequestVision, check_images
from tests.tiny_vlm import IMAGE_TOKEN, image_tokens, random_image, tiny_vlm
from turnrl.errors import InvalidArgumentError


def test_chunked_prefill_and_decode_equal_one_forward_with_pixel_values():
    model = tiny_vlm()
    first = random_image(3, (1, 4, 6), seed=1)
    ids = [5, 6, *image_tokens(first), 7, 8, 9]
    second = random_image(len(ids) + 1, (1, 2, 4), seed=2)
    ids += [*image_tokens(second), 12, 13]
    images = [first, second]
    vision = RequestVision(model, ids, images)
    sampled = [14, 15]  # decoded one at a time after the prompt
    whole = ids + sampled
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor([whole]),
            pixel_values=torch.cat([image.processed.pixel_values for image in images]),
            image_grid_thw=torch.tensor([image.processed.grid_thw for image in images]),
            mm_token_type_ids=(torch.tensor([whole]) == IMAGE_TOKEN).int(),
        ).logits[0]
        cache = DynamicCache(config=model.config)
        logits = []
        for start, end in ((0, 6), (6, 15), (15, len(ids))):  # 6 is inside the first image
            output = model(
                inputs_embeds=vision.embeds(ids[start:end], start)[None],
                position_ids=vision.position_ids(start, end)[:, None, :],
                cache=cache,
                use_cache=True,
            )
            logits.append(output.logits[0])
        for index, token in enumerate(sampled, start=len(ids)):
            output = model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[index + vision.rope_delta]]),
                cache=cache,
                use_cache=True,
            )
            logits.append(output.logits[0])
    assert vision.rope_delta < 0  # the images' tokens outnumber their positions
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-5, rtol=0)


def test_images_that_do_not_fit_their_tokens_are_refused():
    image = random_image(2, (1, 2, 4), seed=1)
    ids = [5, *image_tokens(image), 6]
    moved = random_image(1, (1, 2, 4), seed=1)
    with pytest.raises(
        InvalidArgumentError, match=r"image 0 \(1x2x4 patches\) is not 2 image tokens at 1"
    ):
        check_images(ids, [moved], IMAGE_TOKEN)
    with pytest.raises(InvalidArgumentError, match="4 image tokens for 1 images of 2 tokens"):
        check_images(ids + image_tokens(image), [image], IMAGE_TOKEN)
    with pytest.raises(InvalidArgumentError, match="1 images for a text-only model"):
        check_images(ids, [image], None)
    check_images(ids, [image], IMAGE_TOKEN)
