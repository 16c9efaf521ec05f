"""Tool-call parsers against what the real chat templates render: calls rendered into an
assistant turn parse back to the same calls, and malformed calls each give one error."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollout_svc.parsers import PARSERS, ParsedToolCall, parse_hermes, parse_llama3_json

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# What each template appends after an assistant turn; the model's turn ends before it.
END_OF_TURN = {"qwen": "<|im_end|>\n", "llama": "<|eot_id|>"}
TEMPLATES = {
    "qwen2.5-instruct": ("hermes", END_OF_TURN["qwen"]),
    "qwen3": ("hermes", END_OF_TURN["qwen"]),
    "llama-3.1-instruct": ("llama3_json", END_OF_TURN["llama"]),
    "llama-3.2-instruct": ("llama3_json", END_OF_TURN["llama"]),
}


@pytest.fixture(scope="module")
def tokenizer(fixtures: Path):
    return AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")


def assistant_turn(tokenizer, template: str, message: dict) -> str:
    """The text a model writes for `message`: the rendered conversation after the generation
    prompt, up to the end-of-turn token."""
    user = {"role": "user", "content": "What is the weather in Zürich and in 東京?"}
    kwargs = {"tools": [WEATHER_TOOL], "chat_template": template, "tokenize": False}
    prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, **kwargs)
    full = tokenizer.apply_chat_template([user, message], **kwargs)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def call_message(content: str, *calls: tuple[str, dict], **extra) -> dict:
    tool_calls = [
        {"type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls, **extra}


@pytest.mark.parametrize("template_name", sorted(TEMPLATES))
def test_calls_rendered_by_a_real_template_parse_back(tokenizer, fixtures, template_name):
    template = (fixtures / "chat_templates" / f"{template_name}.jinja").read_text()
    parser_name, end_of_turn = TEMPLATES[template_name]
    arguments = {"city": "Zürich", "unit": "°C", "note": '東京 🚀 "quoted" \\ back'}
    # The Llama templates render calls only, without the message's text.
    content = "Let me look that up." if parser_name == "hermes" else ""
    message = call_message(content, ("get_weather", arguments))
    rendered = assistant_turn(tokenizer, template, message)
    assert rendered.endswith(end_of_turn)
    turn = PARSERS[parser_name](rendered.removesuffix(end_of_turn))
    assert turn.errors == []
    assert turn.tool_calls == [
        ParsedToolCall(
            id="call_0", name="get_weather", arguments=json.dumps(arguments, ensure_ascii=False)
        )
    ]
    # The parsed turn renders back to the very same text: content was cut where the template
    # joins text and calls, and the arguments are the template's own JSON text.
    rebuilt = call_message(
        turn.content,
        *((call.name, json.loads(call.arguments)) for call in turn.tool_calls),
    )
    assert assistant_turn(tokenizer, template, rebuilt) == rendered


@pytest.mark.parametrize("template_name", ["qwen2.5-instruct", "qwen3"])
def test_parallel_calls_keep_their_order(tokenizer, fixtures, template_name):
    template = (fixtures / "chat_templates" / f"{template_name}.jinja").read_text()
    calls = [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "東京", "unit": "K"})]
    rendered = assistant_turn(tokenizer, template, call_message("", *calls))
    turn = parse_hermes(rendered.removesuffix(END_OF_TURN["qwen"]))
    assert [(c.id, c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("call_0", "get_weather", {"city": "Zürich"}),
        ("call_1", "get_weather", {"city": "東京", "unit": "K"}),
    ]
    assert turn.errors == []


def test_qwen3_reasoning_stays_in_content(tokenizer, fixtures):
    template = (fixtures / "chat_templates" / "qwen3.jinja").read_text()
    message = call_message(
        "I'll check.", ("get_weather", {"city": "Zürich"}), reasoning_content="Need weather."
    )
    rendered = assistant_turn(tokenizer, template, message)
    turn = parse_hermes(rendered.removesuffix(END_OF_TURN["qwen"]))
    assert turn.content == "<think>\nNeed weather.\n</think>\n\nI'll check."
    assert [c.name for c in turn.tool_calls] == ["get_weather"]


def test_llama_parallel_calls_separated_by_semicolons_or_in_an_array():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
        '{"name": "get_time", "parameters": {}}\n{"name": "ping", "arguments": {"n": 1}}'
    )
    turn = parse_llama3_json(text)
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Zürich"}'),
        ("call_1", "get_time", "{}"),
        ("call_2", "ping", '{"n": 1}'),
    ]
    array = parse_llama3_json('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]')
    assert [c.name for c in array.tool_calls] == ["a", "b"]
    assert turn.errors == array.errors == []


def test_llama_text_around_the_calls_is_content():
    turn = parse_llama3_json(
        'Checking now.<|python_tag|>{"name": "get_time", "parameters": {}} done'
    )
    assert turn.content == "Checking now.\ndone"
    assert [c.name for c in turn.tool_calls] == ["get_time"]


@pytest.mark.parametrize(
    ("bad_block", "problem"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Zürich"}', "not JSON"),
        ('{"arguments": {"city": "Zürich"}}', "no string 'name'"),
        ('{"name": 7, "arguments": {}}', "no string 'name'"),
        ('{"name": "get_weather", "arguments": ["Zürich"]}', "'arguments' is a JSON array"),
        ('{"name": "get_weather", "arguments": null}', "'arguments' is a JSON null"),
        ('{"name": "get_weather"}', "no 'arguments' object"),
        ('{"name": "get_weather", "arguments": {"x": NaN}}', "NaN is not valid JSON"),
        ('["get_weather"]', "a JSON array, not an object"),
    ],
)
def test_hermes_malformed_block_gives_one_error_and_valid_calls_still_parse(bad_block, problem):
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"Trying.\n{good}\n<tool_call>\n{bad_block}\n</tool_call>\n{good}"
    turn = parse_hermes(text)
    assert [(c.id, c.name) for c in turn.tool_calls] == [
        ("call_0", "get_time"),
        ("call_1", "get_time"),
    ]
    assert len(turn.errors) == 1
    assert problem in turn.errors[0]
    assert bad_block in turn.errors[0]
    assert turn.content == "Trying."


def test_hermes_unclosed_last_block_is_an_error():
    text = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zü'
    )
    turn = parse_hermes(text)
    assert [c.name for c in turn.tool_calls] == ["get_time"]
    assert len(turn.errors) == 1
    assert "never closed" in turn.errors[0]
    assert '"city": "Zü' in turn.errors[0]


def test_hermes_unclosed_block_followed_by_another_block():
    text = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    )
    turn = parse_hermes(text)
    assert [c.name for c in turn.tool_calls] == ["ping"]
    assert len(turn.errors) == 1
    assert "get_time" in turn.errors[0]


def test_hermes_stray_closing_tag_is_an_error():
    turn = parse_hermes('{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert turn.tool_calls == []
    assert len(turn.errors) == 1
    assert "without an opening <tool_call>" in turn.errors[0]


def test_error_quotes_at_most_200_chars_of_the_offending_text():
    turn = parse_hermes("<tool_call>" + "x" * 1000 + "</tool_call>")
    (error,) = turn.errors
    assert "x" * 200 + "..." in error
    assert "x" * 201 not in error


@pytest.mark.parametrize(
    ("bad_call", "problem"),
    [
        ('{"name": "get_weather", "parameters": {"city": }}', "not JSON"),
        ('{"parameters": {}}', "no string 'name'"),
        ('{"name": "get_weather", "parameters": "Zürich"}', "'parameters' is a JSON string"),
    ],
)
def test_llama_malformed_call_gives_one_error_and_valid_calls_still_parse(bad_call, problem):
    good = '{"name": "get_time", "parameters": {}}'
    turn = parse_llama3_json(f"<|python_tag|>{good}; {bad_call}; {good}")
    assert [c.id for c in turn.tool_calls] == ["call_0", "call_1"]
    assert len(turn.errors) == 1
    assert problem in turn.errors[0]
    assert bad_call in turn.errors[0]


def test_llama_builtin_tool_call_is_not_json():
    turn = parse_llama3_json('<|python_tag|>brave_search.call(query="weather Zürich")')
    assert turn.tool_calls == []
    assert len(turn.errors) == 1
    assert "brave_search.call" in turn.errors[0]


@pytest.mark.parametrize("parse", [parse_hermes, parse_llama3_json])
@pytest.mark.parametrize(
    "text", ["It is 21 °C in Zürich.\n", "  Sunny; no call needed.  ", "", "<think>\nok\n</think>"]
)
def test_text_without_calls_is_unchanged(parse, text):
    turn = parse(text)
    assert turn.content == text
    assert turn.tool_calls == turn.errors == []


def test_call_inside_think_is_parsed():
    # Decided: calls written while thinking run like any other (verl does the same); the
    # reward service's format scorer is what penalizes them.
    text = (
        "<think>\nI need the weather.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        "</think>\n\nLet me check."
    )
    turn = parse_hermes(text)
    assert [c.name for c in turn.tool_calls] == ["get_weather"]
    assert turn.content == "<think>\nI need the weather.\n\n</think>\n\nLet me check."


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_registered_parser_finds_no_calls_in_plain_text(name):
    turn = PARSERS[name]("The answer is 42.")
    assert turn.content == "The answer is 42."
    assert turn.tool_calls == []
