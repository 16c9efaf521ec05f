"""The vision side of the tiny model of the `zoom` task (turnrl_demo.tiny_model builds it): a
Qwen2.5-VL of the tiny text model's size, its image processor settings, its chat template, and
the tool's answers its warm start is taught.

Qwen2.5-VL rather than Qwen3-VL: the same M-RoPE and vision tokens, without DeepStack's extra
feature paths, so the smallest real VLM architecture. The image processor is Qwen2-VL's, with
`min_pixels` and `max_pixels` of one 28 x 28 image (2 x 2 patches of 14, merged into one token):
the task's 112 x 112 image is seen at a quarter of its side, where its digits are a blur, and a
zoomed cell, returned at 28 x 28, as drawn.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from tool_svc.tools.image_zoom import ImageZoomTool
from turnrl.images import data_url, trajectory_images
from turnrl.vision import VisionProcessor
from turnrl.zoom_digits import CELL, ZoomProblem
from turnrl_demo.settings import TinyModelSettings

CHAT_TEMPLATE = Path(__file__).with_name("chat_template_vl.jinja")
# Qwen's vision tokens, by the config key of each one's id; added after the chat tokens.
VISION_TOKENS = {
    "<|vision_start|>": "vision_start_token_id",
    "<|vision_end|>": "vision_end_token_id",
    "<|image_pad|>": "image_token_id",
    "<|video_pad|>": "video_token_id",
}
# Every image is resized to 28 x 28 pixels: 2 x 2 patches of 14, merged into one token.
IMAGE_PIXELS = (2 * CELL) ** 2
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": IMAGE_PIXELS,
    "max_pixels": IMAGE_PIXELS,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    # CLIP's normalization, as Qwen2.5-VL's.
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# The zoomed cell comes back at twice its size, the size the processor takes: the digit as drawn,
# its pixels doubled.
ZOOM_OPTIONS = {"zoomed_size": 2 * CELL, "resample": "nearest"}
# Steps of the vision tower's pretraining (`pretrain_vision_tower`), 16 zoomed cells a step.
VISION_PRETRAIN_STEPS = 150
VISION_TOWER = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": IMAGE_PROCESSOR["patch_size"],
    "spatial_merge_size": IMAGE_PROCESSOR["merge_size"],
    "temporal_patch_size": IMAGE_PROCESSOR["temporal_patch_size"],
    "window_size": 112,
    "fullatt_block_indexes": [1],
}


def vision_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The config's `*_token_id` of each vision token, by its id in `tokenizer`."""
    return {key: tokenizer.convert_tokens_to_ids(token) for token, key in VISION_TOKENS.items()}


def vision_model_config(
    tokenizer: PreTrainedTokenizerFast, settings: TinyModelSettings
) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL whose language model has the settings' shape, with VISION_TOWER."""
    head_dim = settings.hidden_size // settings.num_attention_heads
    # M-RoPE splits each head's rotary half over time, height and width as Qwen2.5-VL does
    # (16, 24, 24 of 64), scaled to this head.
    temporal = head_dim // 8
    spatial = (head_dim // 2 - temporal) // 2
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": settings.hidden_size,
            "intermediate_size": settings.intermediate_size,
            "num_hidden_layers": settings.num_hidden_layers,
            "num_attention_heads": settings.num_attention_heads,
            "num_key_value_heads": settings.num_key_value_heads,
            "max_position_embeddings": settings.max_position_embeddings,
            "rope_scaling": {
                "type": "mrope",
                "mrope_section": [temporal, spatial, head_dim // 2 - temporal - spatial],
            },
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": True,
        },
        vision_config={**VISION_TOWER, "out_hidden_size": settings.hidden_size},
        **vision_token_ids(tokenizer),
        tie_word_embeddings=True,
        dtype="float32",
    )


def pretrain_vision_tower(
    model: Qwen2_5_VLForConditionalGeneration,
    conversations: list[list[dict[str, Any]]],
    vision: VisionProcessor,
    seed: int,
) -> float:
    """Trains the vision tower (with a linear probe, dropped after) to tell apart the digits of
    the zoomed cells of the solved `conversations` (the tool message's image, the answer's
    digit), VISION_PRETRAIN_STEPS steps; returns the last batch's accuracy.

    A real VLM's vision tower comes pretrained. A random one's features barely differ from digit
    to digit, and the language model's gradient through them is too weak to make them differ:
    SFT alone left the reading at chance. After this, SFT teaches the reading in a few hundred
    steps."""
    cells = [
        (vision.process(image), int(messages[-1]["content"].removeprefix("#### ")))
        for messages in conversations
        for message in messages
        if message["role"] == "tool"
        for image in trajectory_images([message])
    ]
    probe = torch.nn.Linear(model.config.text_config.hidden_size, 10)
    optimizer = torch.optim.AdamW([*model.model.visual.parameters(), *probe.parameters()], lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(VISION_PRETRAIN_STEPS):
        batch = [cells[i] for i in torch.randint(len(cells), (16,), generator=generator)]
        # One tensor of merged-patch features per image, averaged: the probe reads the image.
        features = model.model.get_image_features(
            torch.cat([image.pixel_values for image, _ in batch]),
            torch.tensor([image.grid_thw for image, _ in batch]),
        ).pooler_output
        per_image = torch.stack([image_features.mean(0) for image_features in features])
        logits = probe(per_image)
        labels = torch.tensor([digit for _, digit in batch])
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (logits.argmax(-1) == labels).float().mean().item()


def save_image_processor(folder: Path) -> None:
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))


def zoomed_tool_messages(problems: list[ZoomProblem]) -> dict[ZoomProblem, dict[str, Any]]:
    """The tool message of each problem's solved call: what the `image_zoom` tool, with
    ZOOM_OPTIONS, answers it (its text, then the zoomed cell as an image_url part)."""

    async def zoom_all() -> dict[ZoomProblem, dict[str, Any]]:
        [tool] = await ImageZoomTool.from_config("image_zoom", ZOOM_OPTIONS, None)
        messages = {}
        for problem in problems:
            session = await tool.create(image=problem.image_url)
            result = await tool.execute(session, {"bbox_2d": problem.bbox})
            [image] = result.images
            url = data_url(image.data, image.mime_type)
            messages[problem] = {
                "role": "tool",
                "content": [
                    {"type": "text", "text": result.text},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        return messages

    return asyncio.run(zoom_all())
