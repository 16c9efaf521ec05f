"""A tiny random Qwen2.5-VL for tests: 2 text layers, a 2-block vision tower, Qwen's vocabulary
size (its image tokens are Qwen's ids), and images of random patches for it; the same on a small
vocabulary, and that one taught to call image_zoom (the zoom caller)."""

import asyncio
import base64
import io
import shutil
from pathlib import Path

import PIL.Image
import torch
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollout_svc.engines.base import EngineImage
from tool_svc.tools.base import ToolResult
from tool_svc.tools.image_zoom import ImageZoomTool
from trainer_svc.config import SftConfig, TrainSettings
from trainer_svc.data import ConversationRecord
from trainer_svc.sft import sft_in_process, tokenize_conversations
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2
from turnrl.vision import ProcessedImage, VisionProcessor

IMAGE_TOKEN, VISION_START, VISION_END = 151655, 151652, 151653
PATCH, MERGE, TEMPORAL = 14, 2, 2
# Qwen's vision tokens, by the config key of each one's id.
VISION_TOKENS = {
    "<|image_pad|>": "image_token_id",
    "<|video_pad|>": "video_token_id",
    "<|vision_start|>": "vision_start_token_id",
    "<|vision_end|>": "vision_end_token_id",
}


def tiny_vlm(
    seed: int = 0,
    vocab_size: int = 151936,
    vision_token_ids: dict[str, int] | None = None,
    eos_token_id: int = 151645,
) -> Qwen2_5_VLForConditionalGeneration:
    """`vision_token_ids`: the config's image, video, vision start and end token ids
    (`*_token_id`), default Qwen's."""
    torch.manual_seed(seed)
    token_ids = vision_token_ids or {
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": 151656,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        **token_ids,
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def save_tiny_vlm(folder: Path, fixtures: Path) -> Path:
    """`tiny_vlm()` saved in `folder` with the Qwen2.5 tokenizer, and Qwen2.5-VL's real image
    processor config and chat template (the fixtures'): a model folder services load."""
    tiny_vlm().save_pretrained(folder)
    AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5").save_pretrained(folder)
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        shutil.copy(fixtures / "vlm" / "qwen2.5-vl" / name, folder / name)
    return folder


def save_small_vlm(folder: Path, fixtures: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen2.5-VL on a small vocabulary, for tests that train it: the tokenizer
    of `tokenizer_dir` (a tiny model's ChatML one) with Qwen's vision tokens added, Qwen2.5-VL's
    image processor config and Qwen3-VL's chat template (Qwen2.5-VL's renders no tools)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(VISION_TOKENS)}, replace_extra_special_tokens=False
    )
    ids = {key: tokenizer.convert_tokens_to_ids(token) for token, key in VISION_TOKENS.items()}
    tiny_vlm(
        vocab_size=len(tokenizer), vision_token_ids=ids, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shutil.copy(fixtures / "vlm" / "qwen2.5-vl" / "preprocessor_config.json", folder)
    shutil.copy(fixtures / "vlm" / "qwen3-vl" / "chat_template.jinja", folder)
    return folder


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def random_image(token_offset: int, grid_thw: tuple[int, int, int], seed: int) -> EngineImage:
    """An image at `token_offset` whose patches are random (a grid of t x h x w patches, so
    t * h * w / MERGE**2 tokens); its bytes are a small PNG named by the seed."""
    t, h, w = grid_thw
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=generator)
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (4, 4), (seed % 256, 0, 0)).save(buffer, format="PNG")
    image = common_pb2.Image(data=buffer.getvalue(), mime_type="image/png")
    processed = ProcessedImage(pixels, grid_thw, t * h * w // MERGE**2)
    return EngineImage(token_offset, load_image(image, ImageSettings(), "test"), processed)


def image_tokens(image: EngineImage) -> list[int]:
    return [VISION_START] + [IMAGE_TOKEN] * image.processed.token_count + [VISION_END]


@torch.no_grad()
def forward_logprobs(
    model, token_ids: list[int], images: list[ProcessedImage], image_token: int = IMAGE_TOKEN
) -> torch.Tensor:
    """The logprob of each token after the first given those before it, from one forward over
    them all with the images' pixel values: what an engine and a trainer must match."""
    input_ids = torch.tensor([token_ids])
    logits = model(
        input_ids=input_ids,
        pixel_values=torch.cat([image.pixel_values for image in images]),
        image_grid_thw=torch.tensor([image.grid_thw for image in images]),
        mm_token_type_ids=(input_ids == image_token).int(),
    ).logits[0]
    return logits[:-1].log_softmax(-1).gather(1, input_ids[0, 1:, None])[:, 0]


# The zoom caller's task: one question about an image, answered after one image_zoom call.
ZOOM_QUESTION = "Which number is in the corner?"
ZOOM_BOX = [0, 0, 28, 28]
ZOOM_ANSWER = "7"
ZOOM_OPTIONS = {"zoomed_size": 56}  # the tool's options the caller is taught with
ZOOM_TOOLS = [{"type": "function", "function": ImageZoomTool.schema}]


def zoom_conversation(image: bytes) -> list[dict]:
    """The zoom caller's conversation on `image` (a PNG): the question, the image_zoom call, the
    real tool's result (its text and the enlarged region), the answer."""

    async def zoomed() -> ToolResult:
        [tool] = await ImageZoomTool.from_config("image_zoom", ZOOM_OPTIONS, None)
        session = await tool.create(image=data_url(image))
        return await tool.execute(session, {"bbox_2d": ZOOM_BOX})

    result = asyncio.run(zoomed())
    call = {
        "type": "function",
        "function": {"name": "image_zoom", "arguments": {"bbox_2d": ZOOM_BOX}},
    }
    return [
        {"role": "user", "content": [image_part(image), {"type": "text", "text": ZOOM_QUESTION}]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "tool",
            "content": [{"type": "text", "text": result.text}, image_part(result.images[0].data)],
        },
        {"role": "assistant", "content": ZOOM_ANSWER},
    ]


def save_zoom_caller(folder: Path, fixtures: Path, tokenizer_dir: Path) -> Path:
    """`save_small_vlm` fine-tuned (the SFT path: `sft_in_process`, 100 steps) on the zoom
    conversations of four random images, until it answers ZOOM_QUESTION on an image with the
    image_zoom call of ZOOM_BOX, and the call's result with ZOOM_ANSWER."""
    save_small_vlm(folder, fixtures, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    records = [
        ConversationRecord(f"zoom-{seed}", zoom_conversation(png_bytes(56, 56, seed)), ZOOM_TOOLS)
        for seed in range(4)
    ]
    examples = tokenize_conversations(tokenizer, records, 4096, vision=VisionProcessor(folder))
    models = sft_in_process(
        folder,
        examples,
        tokenizer.pad_token_id,
        sft=SftConfig(conversations_per_step=2),
        optim=TrainSettings(learning_rate=1e-2),
        steps=100,
        seed=0,
    )
    models.policy.model.save_pretrained(folder)
    models.policy.close()
    return folder


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
