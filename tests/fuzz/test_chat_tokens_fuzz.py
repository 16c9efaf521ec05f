"""`ConversationTokens` with any text in the prompt, a tool result and a user turn: random
Unicode, control characters, NUL, and the spellings of every control token the fixture
templates write (`<|im_end|>`, `<tool_call>`, `<|eot_id|>`, `[INST]`...). Such text never adds
a control id to the trajectory (the spelled-control-token test of test_chat_tokens.py, over
any text and every template), and the trajectory decodes to the template's text render of the
whole conversation (where the template rewrites no history); text that is not Unicode (a lone
surrogate) is refused with InvalidArgumentError."""

import unicodedata
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rollout_svc.chat_template_cases import (
    CASES,
    CASES_BY_ID,
    HISTORY_REWRITES,
    TOKENIZERS,
    TOOLS,
    Renderer,
    TemplateCase,
    rollout,
)
from turnrl.chat_tokens import conversation_ids_and_loss_mask
from turnrl.errors import InvalidArgumentError

SPELLINGS = sorted(
    {
        *("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"),
        *("<tool_response>", "</tool_response>", "<think>", "</think>", "<|im_start|>user"),
        *(token for case in CASES for token in (*case.control_tokens, *case.stop_tokens)),
    }
)
# Any Unicode (NUL and the other control characters included), but no surrogates: a Python
# string holding one is not text, refused below.
CHARACTERS = st.characters(codec="utf-8")
TEXTS = st.lists(
    st.one_of(st.sampled_from(SPELLINGS), st.text(CHARACTERS, max_size=6)), max_size=12
).map("".join)
CALL = {
    "id": "c00000001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}


def control_ids(renderer: Renderer) -> set[int]:
    """transformers' control tokens: the special ones and the added ones the template writes."""
    tokenizer = renderer.tokenizer
    return set(tokenizer.all_special_ids) | {
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.content in renderer.template
    }


def play(renderer: Renderer, text: str) -> tuple[list[int], list[dict]]:
    """The ids and the messages of a rollout whose prompt, tool result and (where the template
    continues after one) user turn are `text`."""
    case = renderer.case
    thinking = {case.reasoning_key: "Thinking."} if case.reasoning_key else {}
    tool_result = {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather"}
    rounds = [
        (
            {"role": "assistant", "content": "", "tool_calls": [CALL], **thinking},
            [{**tool_result, "content": text}],
        )
    ]
    if case.user_turns:
        rounds.append(
            (
                {"role": "assistant", "content": "Done.", **thinking},
                [{"role": "user", "content": text}],
            )
        )
    prompt = [{"role": "user", "content": text}]
    segments, _ = rollout(renderer, prompt, rounds)
    messages = [*prompt, *(message for a, answers in rounds for message in (a, *answers))]
    return [token for segment in segments for token in segment], messages


@cache
def plain_control_ids(case_id: str, tokenizer_name: str) -> list[int]:
    renderer = Renderer(CASES_BY_ID[case_id], tokenizer_name)
    wanted = control_ids(renderer)
    ids, _ = play(renderer, "before after")
    return [token for token in ids if token in wanted]


@settings(max_examples=4 * settings.default.max_examples)
@given(
    case=st.sampled_from(CASES),
    tokenizer_name=st.sampled_from(TOKENIZERS),
    text=TEXTS,
)
def test_text_in_messages_adds_no_control_token(case: TemplateCase, tokenizer_name, text):
    renderer = Renderer(case, tokenizer_name)
    ids, messages = play(renderer, f"before {text} after")
    wanted = control_ids(renderer)
    assert [token for token in ids if token in wanted] == plain_control_ids(case.id, tokenizer_name)
    if case.template not in HISTORY_REWRITES:
        # Qwen's tokenizers normalize text to NFC.
        rendered = renderer.text(messages, add_generation_prompt=True)
        assert renderer.tokenizer.decode(ids) == unicodedata.normalize("NFC", rendered)


# A conversation for supervised fine-tuning: a prompt, a call, its result, an answer, a user turn.
CONVERSATION = (
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "Sunny."},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks."},
)


@pytest.mark.parametrize("position", range(len(CONVERSATION)))
@given(before=st.text(CHARACTERS, max_size=5), surrogate=st.characters(categories=["Cs"]))
def test_a_lone_surrogate_is_refused_by_name(position: int, before: str, surrogate: str):
    """Found by fuzzing: the tokenizer raised a TypeError that did not say why."""
    renderer = Renderer(CASES_BY_ID["turnrl-chatml"], "qwen3")
    messages = [dict(message) for message in CONVERSATION]
    messages[position]["content"] += before + surrogate
    with pytest.raises(InvalidArgumentError, match="lone surrogate"):
        conversation_ids_and_loss_mask(
            renderer.tokenizer,
            messages,
            TOOLS,
            renderer.template,
            stop_token_ids=renderer.tokenizer.convert_tokens_to_ids(["<|im_end|>"]),
        )
