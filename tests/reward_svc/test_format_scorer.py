"""The tool-call format scorer on Hermes/Qwen `<tool_call>` text."""

import json
import re
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from reward_svc.scorers import format as format_scorer
from reward_svc.scorers.base import ScoringRequest

ADD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


def grade(*assistant_texts: str, **extra_info):
    """Scores a conversation of one user turn and these assistant messages."""
    messages = [{"role": "user", "content": "What is 2+3?"}]
    messages += [{"role": "assistant", "content": text} for text in assistant_texts]
    return grade_messages(messages, **extra_info)


def grade_messages(messages: list[dict], **extra_info):
    return format_scorer.score(
        ScoringRequest(
            data_source="calculator",
            response_text="",
            messages=messages,
            extra_info=extra_info,
        )
    )


def qwen_assistant_text(fixtures: Path, tool_calls: list[dict]) -> str:
    """The assistant turn the Qwen2.5 chat template writes for these calls: the model's text."""
    source = (fixtures / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        source
    )
    messages = [
        {"role": "user", "content": "Compute."},
        {"role": "assistant", "content": "", "tool_calls": tool_calls},
    ]
    rendered = template.render(messages=messages, add_generation_prompt=False)
    return rendered.rpartition("<|im_start|>assistant\n")[2].removesuffix("<|im_end|>\n")


def test_calls_as_the_qwen_template_writes_them_are_well_formed(fixtures):
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
        for e in ("2+3", "4*5")
    ]
    text = qwen_assistant_text(fixtures, calls)
    assert text.count("<tool_call>") == 2
    result = grade(text, "The answers are 5 and 20.", tool_names=["calculator"])
    assert result.score == 1.0
    assert result.extras == {"tool_calls": 2, "malformed": 0, "calls_in_think": 0}


def test_a_conversation_without_tool_calls_is_well_formed():
    result = grade("It is 5.")
    assert result.score == 1.0
    assert result.extras == {"tool_calls": 0, "malformed": 0, "calls_in_think": 0}


@pytest.mark.parametrize(
    "bad_call",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}\n</tool_call>',
        '<tool_call>\n["calculator", {"expression": "2+3"}]\n</tool_call>',
        '<tool_call>\n{"arguments": {"expression": "2+3"}}\n</tool_call>',
        '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": "2+3"}\n</tool_call>',
        '<tool_call>\n{"name": "calculator"}\n</tool_call>',
        # Unclosed: the model stopped (or went on) before `</tool_call>`.
        '<tool_call>\n{"name": "calculator", "arguments": {}}',
        '<tool_call>\n{"name": "calculator", "arguments": {}}\n<tool_call>',
        # A closing tag with no opening one.
        '{"name": "calculator", "arguments": {}}\n</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ],
)
def test_one_malformed_call_scores_zero(bad_call):
    result = grade(ADD, f"Checking.\n{bad_call}")
    assert result.score == 0.0
    assert result.extras["malformed"] >= 1
    assert result.extras["tool_calls"] == 1 + result.extras["malformed"]


def test_an_unknown_tool_name_is_malformed_only_when_names_are_given():
    assert grade(ADD, tool_names=["calculator", "search"]).score == 1.0
    assert grade(ADD, tool_names=["search"]).extras["malformed"] == 1
    assert grade(ADD, tool_names=["search"]).score == 0.0
    assert grade(ADD).score == 1.0


def test_a_call_inside_think_costs_the_penalty():
    text = f"<think>I will call it.\n{ADD}\n</think>\n{ADD}"
    result = grade(text)
    assert result.score == 0.5
    assert result.extras == {"tool_calls": 2, "malformed": 0, "calls_in_think": 1}
    assert grade(text, think_tool_call_penalty=0.2).score == pytest.approx(0.8)
    assert grade(f"<think>{ADD}</think>", f"<think>{ADD}</think>").score == 0.5


def test_thinking_that_the_prompt_opened_or_that_never_closed_counts():
    assert grade(f"Let me call it. {ADD}\n</think>\nDone.").extras["calls_in_think"] == 1
    assert grade(f"<think>Hmm. {ADD}").extras["calls_in_think"] == 1
    assert grade(f"<think>Hmm.</think>\n{ADD}").extras["calls_in_think"] == 0


def test_calls_in_reasoning_content_are_inside_think():
    message = {"role": "assistant", "content": "", "reasoning_content": f"Maybe {ADD}"}
    result = grade_messages([message])
    assert result.extras == {"tool_calls": 1, "malformed": 0, "calls_in_think": 1}


def test_a_malformed_call_inside_think_floors_at_zero():
    result = grade("<think><tool_call>oops</tool_call></think>")
    assert result.score == 0.0
    assert result.extras == {"tool_calls": 1, "malformed": 1, "calls_in_think": 1}


def test_only_assistant_messages_are_checked():
    messages = [
        {"role": "system", "content": "Write calls as <tool_call>{...}</tool_call>."},
        {"role": "assistant", "content": [{"type": "text", "text": ADD}]},
        {"role": "tool", "content": "5 </tool_call>"},
    ]
    result = grade_messages(messages)
    assert (result.score, result.extras["tool_calls"]) == (1.0, 1)


def test_calls_already_split_into_the_tool_calls_field_are_graded_there():
    def message(arguments):
        call = {"id": "c1", "type": "function", "function": {"name": "calculator"}}
        call["function"]["arguments"] = arguments
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    good = grade_messages([message(json.dumps({"expression": "2+3"}))])
    assert (good.score, good.extras["tool_calls"]) == (1.0, 1)
    assert grade_messages([message({"expression": "2+3"})]).score == 1.0
    assert grade_messages([message('{"expression": ')]).score == 0.0
    flat = {"role": "assistant", "content": "", "tool_calls": [{"name": "x", "arguments": "{}"}]}
    assert grade_messages([flat], tool_names=["calculator"]).extras["malformed"] == 1


def test_a_message_with_raw_calls_is_not_counted_twice():
    parsed = {"type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    message = {"role": "assistant", "content": ADD, "tool_calls": [parsed]}
    assert grade_messages([message]).extras["tool_calls"] == 1


def test_without_messages_the_response_text_is_graded():
    result = format_scorer.score(
        ScoringRequest(data_source="x", response_text=f"<think>{ADD}</think>")
    )
    assert result.extras == {"tool_calls": 1, "malformed": 0, "calls_in_think": 1}


@pytest.mark.parametrize("tool_names", ["calculator", [1, 2], {"calculator": 1}])
def test_tool_names_of_the_wrong_shape_are_rejected_by_value(tool_names):
    with pytest.raises(ValueError, match=re.escape(repr(tool_names))):
        grade(ADD, tool_names=tool_names)
