"""What SGLang 0.5.23 and vLLM 0.32 do with images beside token ids, for their stand-ins: the
ids hold one image pad per image, and the server's own processor expands each pad by its count
(SGLang's `multimodal/processors/base_processor.py` with SGLANG_MM_AVOID_RETOKENIZE, on by
default; vLLM's `multimodal/processing/processor.py` `_apply_prompt_updates`). A run of pads
already expanded fails SGLang's processor, which runs out of images (a server error); another
number of pads than images is refused with HTTP 400 by both."""

from dataclasses import dataclass

from starlette.responses import JSONResponse

from rollout_svc.engines.base import EngineImage
from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2
from turnrl.vision import VisionProcessor


@dataclass
class ServedPrompt:
    """A prompt as the server made it: the expanded ids and the images among them."""

    input_ids: list[int]
    images: list[EngineImage]


def served_prompt(
    ids: list[int], urls: list[str], vision: VisionProcessor | None
) -> ServedPrompt | JSONResponse:
    """The prompt of `ids` with the images of `urls` (data URLs) expanded by `vision` (the
    server's processor), or the error reply the server gives."""
    if not urls:
        return ServedPrompt(ids, [])
    if vision is None:
        return error_reply(400, "the served model is not multimodal")
    pad = vision.image_token_id
    runs = [i for i, token in enumerate(ids) if token == pad and (i == 0 or ids[i - 1] != pad)]
    if any(i + 1 < len(ids) and ids[i + 1] == pad for i in runs):
        return error_reply(500, "StopIteration (the processor expands every image pad)")
    if len(runs) != len(urls):
        return error_reply(400, f"{len(runs)} image placeholders for {len(urls)} images")
    try:
        loaded = [
            load_image(common_pb2.Image(url=url), ImageSettings(), f"image {i}")
            for i, url in enumerate(urls)
        ]
    except InvalidArgumentError as e:
        return error_reply(400, str(e))
    processed = [vision.process(image) for image in loaded]
    expanded = vision.expand_image_tokens(ids, processed)
    images, position = [], 0
    for image, done in zip(loaded, processed, strict=True):
        position = expanded.index(pad, position)
        images.append(EngineImage(position, image, done))
        position += done.token_count
    return ServedPrompt(expanded, images)


def sglang_served_prompt(body: dict, vision: VisionProcessor | None) -> ServedPrompt | JSONResponse:
    """`served_prompt` of a /generate body of SGLang 0.5.23: its `image_data` one item or a
    list, each a string (here, a data URL); its API contract refuses objects of other keys
    than `url` and the like."""
    items = body.get("image_data") or []
    items = items if isinstance(items, list) else [items]
    if not all(isinstance(item, str) for item in items):
        return error_reply(400, "unknown field in image_data, expected one of `url`, ...")
    return served_prompt(body["input_ids"], items, vision)


def error_reply(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)
