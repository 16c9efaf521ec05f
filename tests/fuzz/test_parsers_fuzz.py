"""Every tool-call parser of `PARSERS` on arbitrary text and on text made of call-like
fragments: it returns a `ParsedTurn` whose calls hold the contract (ids call_0, call_1, ...; a
name and JSON-object arguments that go on the wire as UTF-8) and reports everything else as
errors, never raising. Well-formed calls written into text come back as written."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_svc.parsers import MAX_ERROR_TEXT_CHARS, PARSERS, ParsedToolCall, ParsedTurn

# Pieces of text a model might write around, inside or instead of a tool call.
FRAGMENTS = (
    *("<tool_call>", "</tool_call>", "<|python_tag|>", "<think>", "</think>", "<|im_end|>"),
    *('{"name":', '"calculator"', '"arguments":', '"parameters":', '{"expression": "1+1"}'),
    *("{", "}", "[", "]", '"', ":", ",", ";", "\\", "\n", " ", "\t"),
    *("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "null", "true", "0"),
    *('"\\ud800"', '"\\udc00"', '"\\u0000"', "\\u", "é", "東京", "🙂", "\x00", "\u2028"),
)
# JSON values of every kind (floats finite: JSON has no others).
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)
# JSON text whose leaves may be what JSON has no value for: huge numbers, constants, escaped
# lone surrogates, digits past Python's int limit.
ODD_LITERALS = ("1e999", "-1e999", "NaN", "Infinity", '"\\ud800"', '"a\\udc00"', "9" * 5000)
JSON_TEXT_KEYS = st.text(max_size=6).map(json.dumps) | st.sampled_from(['"\\ud800"'])
JSON_TEXT = st.recursive(
    JSON_VALUES.map(json.dumps) | st.sampled_from(ODD_LITERALS),
    lambda children: (
        st.lists(children, max_size=3).map(lambda items: f"[{', '.join(items)}]")
        | st.lists(st.tuples(JSON_TEXT_KEYS, children), max_size=3).map(
            lambda pairs: "{" + ", ".join(f"{key}: {value}" for key, value in pairs) + "}"
        )
    ),
    max_leaves=6,
)
# One call as a model writes it, its name and arguments any JSON text, in either parser's form.
CALL_TEXT = st.builds(
    lambda name, key, arguments: f'{{"name": {name}, "{key}": {arguments}}}',
    st.one_of(st.text(max_size=8).map(json.dumps), st.sampled_from(ODD_LITERALS)),
    st.sampled_from(["arguments", "parameters"]),
    JSON_TEXT,
)
CALL_LIKE_TEXT = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(max_size=8),
        JSON_VALUES.map(json.dumps),
        CALL_TEXT,
        CALL_TEXT.map(lambda call: f"<tool_call>\n{call}\n</tool_call>"),
        st.integers(1, 3000).map(lambda depth: "[" * depth),
    ),
    max_size=12,
).map("".join)
TEXTS = st.one_of(st.text(), CALL_LIKE_TEXT)
# Characters that end a call's JSON in a parser's markup; a call holding them cannot be written.
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>")


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_contract(turn: ParsedTurn) -> None:
    assert isinstance(turn, ParsedTurn)
    assert isinstance(turn.content, str)
    assert [call.id for call in turn.tool_calls] == [
        f"call_{i}" for i in range(len(turn.tool_calls))
    ]
    for call in turn.tool_calls:
        assert isinstance(call, ParsedToolCall) and isinstance(call.name, str)
        # Both go on the wire (ExecuteRequest), which takes UTF-8 only.
        call.name.encode()
        call.arguments.encode()
        arguments = _strict_json(call.arguments)
        assert isinstance(arguments, dict), call.arguments
        assert json.dumps(arguments, ensure_ascii=False) == call.arguments
        assert all(math.isfinite(v) for v in _numbers(arguments)), (
            f"non-finite number in {call.arguments!r}"
        )
    for error in turn.errors:
        assert isinstance(error, str) and error.startswith("malformed tool call (")
        # The offending text is clipped; its repr may escape each character in up to 10.
        assert len(error) < 200 + 10 * (MAX_ERROR_TEXT_CHARS + 3)


def _numbers(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, float):
        yield value


@pytest.mark.parametrize("name", sorted(PARSERS))
@given(text=TEXTS)
def test_a_parser_holds_its_contract_on_any_text(name: str, text: str):
    turn = PARSERS[name](text)
    check_contract(turn)


@given(text=TEXTS)
def test_hermes_reports_every_block_and_keeps_none_in_content(text: str):
    turn = PARSERS["hermes"](text)
    assert "<tool_call>" not in turn.content
    assert len(turn.tool_calls) + len(turn.errors) >= text.count("<tool_call>")
    if "<tool_call>" not in text and "</tool_call>" not in text:
        assert turn == ParsedTurn(content=text)


@given(text=TEXTS)
def test_llama3_json_leaves_text_that_is_no_call_alone(text: str):
    if "<|python_tag|>" not in text and not text.lstrip().startswith(("{", "[")):
        assert PARSERS["llama3_json"](text) == ParsedTurn(content=text)


CALLS = st.lists(
    st.tuples(st.text(min_size=1, max_size=20), st.dictionaries(st.text(max_size=8), JSON_VALUES)),
    min_size=1,
    max_size=3,
)
PLAIN_TEXT = st.text(max_size=30).filter(lambda text: not any(m in text for m in MARKUP))


@given(calls=CALLS, before=PLAIN_TEXT, after=PLAIN_TEXT)
def test_hermes_calls_come_back_as_written(calls, before: str, after: str):
    blocks = [json.dumps({"name": name, "arguments": arguments}) for name, arguments in calls]
    text = before + "".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks) + after
    turn = PARSERS["hermes"](text)
    assert turn.errors == []
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == calls


@given(calls=CALLS, before=PLAIN_TEXT, separator=st.sampled_from([";", "\n", "; "]))
def test_llama3_json_calls_come_back_as_written(calls, before: str, separator: str):
    written = separator.join(
        json.dumps({"name": name, "parameters": arguments}) for name, arguments in calls
    )
    turn = PARSERS["llama3_json"](f"{before}<|python_tag|>{written}")
    assert turn.errors == []
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == calls
    assert turn.content == before.strip()


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        # Found by fuzzing: json reads 1e999 as inf, which json.dumps writes as `Infinity`.
        ('{"x": 1e999}', "number 1e999 is out of range"),
        # Found by fuzzing: a lone surrogate, which no request can carry.
        ('{"x": "\\ud800"}', "half a surrogate pair"),
        ('{"\\udc00": 1}', "half a surrogate pair"),
    ],
)
def test_calls_no_request_can_carry_are_errors(name: str, arguments: str, problem: str):
    call = f'{{"name": "f", "arguments": {arguments}}}'
    text = f"<tool_call>\n{call}\n</tool_call>" if name == "hermes" else call
    turn = PARSERS[name](text)
    assert turn.tool_calls == []
    assert len(turn.errors) == 1 and problem in turn.errors[0], turn.errors
