"""turnrl.vision on the real Qwen2.5-VL and Qwen3-VL processor configs and chat templates: each
image's placeholder becomes as many image tokens as the processor's grid has merged patches, in
a prompt and in a tool result."""

import io
import shutil
from pathlib import Path

import PIL.Image
import pytest
from transformers import AutoTokenizer

from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2
from turnrl.vision import VisionProcessor, with_image_placeholders

# Each VLM fixture folder, and the text tokenizer it pairs with.
MODELS = {"qwen2.5-vl": "qwen2.5", "qwen3-vl": "qwen3"}


def model_folder(fixtures: Path, name: str, tmp_path: Path) -> Path:
    """A model folder of the fixture's config, processor config, template and tokenizer."""
    folder = tmp_path / name
    shutil.copytree(fixtures / "tokenizers" / MODELS[name], folder)
    for file in ("config.json", "preprocessor_config.json", "chat_template.jinja"):
        shutil.copy(fixtures / "vlm" / name / file, folder / file)
    return folder


def png(width: int, height: int):
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (width, height), (10, 200, 90)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return load_image(common_pb2.Image(data=data, mime_type="image/png"), ImageSettings(), "x")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_image_placeholder_becomes_its_grids_merged_patches(fixtures, name, tmp_path):
    folder = model_folder(fixtures, name, tmp_path)
    vision = VisionProcessor(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = (folder / "chat_template.jinja").read_text()
    images = [vision.process(png(96, 64)), vision.process(png(300, 700))]
    processor = vision._image_processor
    for image, (width, height) in zip(images, [(96, 64), (300, 700)], strict=True):
        t, h, w = image.grid_thw
        # The count vLLM reads from the processor without an image, and the patches made.
        assert t * h * w == processor.get_number_of_image_patches(height, width)
        assert image.pixel_values.shape[0] == t * h * w
        assert image.token_count == t * h * w // processor.merge_size**2
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Zoom?"}]},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": [{"type": "text", "text": "Here:"}, {"type": "image"}]},
    ]
    ids = tokenizer.apply_chat_template(messages, chat_template=template, return_dict=False)
    expanded = vision.expand_image_tokens(ids, images)
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    runs = []
    for at, token in enumerate(expanded):
        if token == start:
            runs.append(expanded.index(end, at) - at - 1)
            assert set(expanded[at + 1 : at + 1 + runs[-1]]) == {vision.image_token_id}
    assert runs == [image.token_count for image in images]
    assert len(expanded) == len(ids) - 2 + sum(runs)
    with pytest.raises(InvalidArgumentError, match="2 image placeholders for 1 images"):
        vision.expand_image_tokens(ids, images[:1])


def test_a_text_model_folder_is_not_a_vision_model(tiny_model_dir):
    with pytest.raises(FailedPreconditionError, match="not a vision-language model"):
        VisionProcessor(tiny_model_dir)


@pytest.mark.parametrize(
    "image_part", [{"type": "image"}, {"type": "image_url", "image_url": {"url": "data:..."}}]
)
def test_a_conversation_with_images_in_its_prompt_and_a_tool_result_is_token_exact(
    fixtures, tmp_path, image_part
):
    """Prompt, a written model turn, a tool result with an image, another model turn: the ids
    built turn by turn equal the render of the whole conversation, each image's placeholder
    expanded, with no image tokens on the model's turns."""
    folder = model_folder(fixtures, "qwen3-vl", tmp_path)
    vision = VisionProcessor(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = (folder / "chat_template.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
    call = {"id": "c0", "type": "function", "function": {"name": "zoom", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [image_part, {"type": "text", "text": "What number?"}]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "c0",
            "content": [{"type": "text", "text": "Zoomed:"}, image_part],
        },
        {"role": "assistant", "content": "#### 7"},
    ]
    images = [vision.process(png(96, 64)), vision.process(png(40, 220))]
    tokens = ConversationTokens(tokenizer, template, tools, vision=vision)
    ids = tokens.prompt_ids(messages[:1], images[:1])
    first_turn = tokens.append_assistant_message(messages[1])
    ids += first_turn + tokens.append_messages(messages[2:3], images[1:])
    last_turn = tokens.append_assistant_message(messages[3])
    ids += last_turn + tokens.closing_ids()

    placeheld, count = with_image_placeholders(messages)
    whole = tokenizer.apply_chat_template(
        placeheld, tools=tools, chat_template=template, return_dict=False
    )
    assert count == 2 and ids == vision.expand_image_tokens(whole, images)
    assert ids.count(vision.image_token_id) == sum(image.token_count for image in images)
    assert vision.image_token_id not in first_turn + last_turn


def test_images_need_a_vision_model_and_one_processed_image_each(
    fixtures, tmp_path, tiny_model_dir
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(InvalidArgumentError, match="1 images for a text-only model"):
        ConversationTokens(tokenizer, None, None).prompt_ids(prompt)
    folder = model_folder(fixtures, "qwen3-vl", tmp_path)
    vision = VisionProcessor(folder)
    tokens = ConversationTokens(AutoTokenizer.from_pretrained(folder), None, None, vision=vision)
    with pytest.raises(InvalidArgumentError, match="hold 1 images, given 0"):
        tokens.prompt_ids(prompt)
