"""A streamed turn's content, id by id, against the content the session records for the whole
turn: every delta joined so far is where that content begins, a tool call's text never
streams, and the deltas are many where the text allows."""

import json

import pytest
from transformers import AutoTokenizer

from rollout_svc.gateway.requests import parse_request
from rollout_svc.gateway.streamed_content import StreamedContent
from rollout_svc.parsers import parse_hermes
from turnrl.calculator_data import TOOLS
from turnrl.chat_tokens import ConversationTokens

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "52 + 98"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def streamed(tokenizer, text: str, **request) -> tuple[list[str], str]:
    """The deltas of a turn that writes `text` and stops, sent id by id, and the content the
    session records for it (sessions.py: the parsed content when the turn holds calls, else
    the text)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **request}
    chat = parse_request(json.dumps(body).encode())
    tokens = ConversationTokens(
        tokenizer, None, chat.tool_schemas(), stop_token_ids=[tokenizer.eos_token_id]
    )
    content = StreamedContent(tokens, chat, parse_hermes, tokenizer)
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    recorded = tokens.model_turn_text(ids)
    parsed = parse_hermes(recorded) if chat.calls_tools else None
    if parsed is not None and parsed.tool_calls and not parsed.errors:
        recorded = parsed.content
    deltas = []
    for token_id in ids:
        content.extend([token_id])
        deltas.append(content.delta())
        assert recorded.startswith(content.sent), (content.sent, recorded)
    assert "".join(deltas) == content.sent
    return [d for d in deltas if d], recorded


def test_content_before_a_call_streams_and_the_call_never_does(tokenizer):
    deltas, recorded = streamed(tokenizer, f"Let me add them. {CALL}", tools=TOOLS)
    assert recorded == "".join(deltas) == "Let me add them."
    assert len(deltas) > 1


def test_a_call_opening_part_written_is_held_until_it_is_not_one(tokenizer):
    deltas, recorded = streamed(tokenizer, "a <tool_cal> b", tools=TOOLS)
    assert recorded == "a <tool_cal> b"
    assert "".join(deltas) == "a <tool_cal> b"
    assert "a <" not in deltas  # the "<" waited for the text that showed it is no call


@pytest.mark.parametrize(
    "text",
    [
        f"  Leading space. {CALL}",  # stripped when a call follows, kept when none does
        "  Leading space, no call.",
        "Malformed: <tool_call>not json</tool_call> so the text stays",
        f"Trailing newlines\n\n{CALL}",
        "Größe ≈ 15 ✓ 你好",  # characters of several byte-level tokens
    ],
)
def test_what_streams_is_where_the_recorded_content_begins(tokenizer, text):
    deltas, recorded = streamed(tokenizer, text, tools=TOOLS)
    assert recorded.startswith("".join(deltas))
    assert "\ufffd" not in "".join(deltas)


def test_without_tools_the_whole_text_streams(tokenizer):
    text = f"  Spaces and a call that is only text: {CALL}"
    deltas, recorded = streamed(tokenizer, text)
    assert recorded == text
    assert "".join(deltas) == text


def test_a_stop_string_and_its_start_are_held(tokenizer):
    deltas, _ = streamed(tokenizer, "x = 5 #### 5", stop="####")
    assert "".join(deltas) == "x = 5"


def test_a_tokenizer_that_cleans_up_spaces_streams_what_stays(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(
        tiny_model_dir,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    deltas, recorded = streamed(tokenizer, "it 's so , is n't it ? yes .")
    assert recorded == "it's so, isn't it? yes."
    assert "".join(deltas) == "it's so, isn't it?"  # " yes." may still lose its space
    assert len(deltas) > 1
