"""SFT on conversations with images (issue 35): a prompt image and a tool result's image take
the tokens the processor gives them, never trained; the loss is on the assistant turns, and a
tiny VLM learns them (the zoom caller)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.tiny_vlm import (
    ZOOM_ANSWER,
    ZOOM_TOOLS,
    forward_logprobs,
    png_bytes,
    zoom_conversation,
)
from trainer_svc.data import ConversationRecord, read_conversations
from trainer_svc.sft import tokenize_conversations
from turnrl.errors import ConfigError
from turnrl.images import trajectory_images
from turnrl.vision import IMAGE_PLACEHOLDER, VisionProcessor, model_class


def test_images_take_their_processed_tokens_and_only_assistant_turns_are_trained(
    zoom_caller_dir,
):
    tokenizer = AutoTokenizer.from_pretrained(zoom_caller_dir)
    vision = VisionProcessor(zoom_caller_dir)
    messages = zoom_conversation(png_bytes(84, 56, seed=11))
    [example] = tokenize_conversations(
        tokenizer, [ConversationRecord("c", messages, ZOOM_TOOLS)], 4096, vision=vision
    )
    processed = [vision.process(image) for image in trajectory_images(messages)]
    assert [image.grid_thw for image in example.images] == [p.grid_thw for p in processed]
    assert [image.token_count for image in example.images] == [6, 4]  # 84x56, then 56x56
    # The template's render of the whole conversation, each image's one pad expanded.
    placeheld = [
        {
            **m,
            "content": [IMAGE_PLACEHOLDER if p["type"] == "image_url" else p for p in m["content"]],
        }
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    rendered = tokenizer.apply_chat_template(
        placeheld, tools=ZOOM_TOOLS, tokenize=True, return_dict=False
    )
    assert example.token_ids == vision.expand_image_tokens(rendered, example.images)
    pad = vision.image_token_id
    image_positions = [i for i, token in enumerate(example.token_ids) if token == pad]
    assert len(image_positions) == 10
    assert not any(example.loss_mask[i] for i in image_positions)
    trained = tokenizer.decode([t for t, m in zip(*example[:2], strict=True) if m])
    assert trained == (
        '<tool_call>\n{"name": "image_zoom", "arguments": {"bbox_2d": [0, 0, 28, 28]}}\n'
        f"</tool_call><|im_end|>{ZOOM_ANSWER}<|im_end|>"
    )


def test_the_zoom_caller_learned_its_assistant_turns(zoom_caller_dir):
    """The SFT fixture trained for real: on a conversation of an image it never saw, each
    assistant token is its most likely next token, with the images' pixel values."""
    tokenizer = AutoTokenizer.from_pretrained(zoom_caller_dir)
    vision = VisionProcessor(zoom_caller_dir)
    messages = zoom_conversation(png_bytes(56, 56, seed=99))
    [example] = tokenize_conversations(
        tokenizer, [ConversationRecord("c", messages, ZOOM_TOOLS)], 4096, vision=vision
    )
    model = model_class(zoom_caller_dir).from_pretrained(zoom_caller_dir, dtype=torch.float32)
    logprobs = forward_logprobs(
        model.eval(), example.token_ids, example.images, vision.image_token_id
    )
    trained = torch.tensor(example.loss_mask[1:])
    assert logprobs[trained].exp().min() > 0.5, logprobs[trained].exp()


def test_conversation_rows_read_their_images(tmp_path: Path, zoom_caller_dir):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56, seed=1))
    row = {
        "messages": [
            {"role": "user", "content": "<image>Which number?"},
            {"role": "assistant", "content": "7"},
        ],
        "images": ["a.png"],
    }
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [record] = read_conversations(path)
    [image] = trajectory_images(record.messages)
    assert image.data == (tmp_path / "a.png").read_bytes()
    assert record.messages[0]["content"][1] == {"type": "text", "text": "Which number?"}
    tokenizer = AutoTokenizer.from_pretrained(zoom_caller_dir)
    [example] = tokenize_conversations(
        tokenizer, [record], 4096, vision=VisionProcessor(zoom_caller_dir)
    )
    assert len(example.images) == 1


@pytest.mark.parametrize(
    "messages, images, words",
    [
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<image>7"}],
            ["a.png"],
            "an assistant message holds an image",
        ),
        (
            [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "7"}],
            ["missing.png"],
            "cannot read",
        ),
    ],
)
def test_bad_image_conversations_are_refused_naming_the_record(
    tmp_path: Path, zoom_caller_dir, messages, images, words
):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56, seed=1))
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": messages, "images": images}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(zoom_caller_dir)
    with pytest.raises(ConfigError) as caught:
        records = read_conversations(path)
        tokenize_conversations(tokenizer, records, 4096, vision=VisionProcessor(zoom_caller_dir))
    assert "record sft-0" in str(caught.value) or "conversation sft-0" in str(caught.value)
    assert words in str(caught.value)


def test_images_for_a_text_only_policy_are_refused(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    record = ConversationRecord("c", zoom_conversation(png_bytes(56, 56, seed=1)), ZOOM_TOOLS)
    with pytest.raises(ConfigError, match=r"conversation c: .*text-only model"):
        tokenize_conversations(tokenizer, [record], 4096)
