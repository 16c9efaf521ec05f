"""Images for the server engines (SGLang, vLLM), which process images themselves.

Both servers take a vision-language prompt as token ids with ONE image pad per image, beside the
images' encoded bytes, and expand each pad by their own processor's count (SGLang 0.5.23's
`image_data`, `multimodal/processors/base_processor.py`; vLLM 0.32's `content_parts`,
`multimodal/processing/processor.py` `_apply_prompt_updates`); a run already expanded is misread
(SGLang's processor runs out of images, strands-sglang#31; vLLM's replaces the first pads). The
trajectory's ids hold each image expanded by turnrl's processor, so each run is cut to one pad
on the way out, and the prompt the server made, which both return on request, must be those ids
again: a server whose image settings differ made other image tokens, and its turn is refused.
"""

from collections.abc import Sequence

from rollout_svc.engines.base import EngineImage
from turnrl.errors import FailedPreconditionError


def one_pad_per_image(input_ids: list[int], images: Sequence[EngineImage]) -> list[int]:
    """`input_ids` with each image's run of tokens cut to its first."""
    ids: list[int] = []
    position = 0
    for image in images:
        ids += input_ids[position : image.token_offset + 1]
        position = image.token_offset + image.processed.token_count
    return ids + input_ids[position:]


def check_served_prompt(
    server: str, served_ids: list[int] | None, input_ids: list[int], images: Sequence[EngineImage]
) -> None:
    """Raises FailedPreconditionError unless `server` (its name, for the message) made the
    prompt `input_ids` of `images`, as `served_ids` says it did."""
    if served_ids is None:
        raise FailedPreconditionError(
            f"the {server} did not return the prompt ids it made: the tokens of the prompt's "
            f"{len(images)} images cannot be checked"
        )
    if served_ids != input_ids:
        raise FailedPreconditionError(
            f"the {server} made a prompt of {len(served_ids)} tokens of the {len(input_ids)} "
            f"turnrl's processor made with its {len(images)} images: the server's image "
            "processor settings (min/max pixels) differ from the model folder's "
            "preprocessor_config.json"
        )
