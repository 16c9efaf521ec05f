"""The calculator: exact results, and clear errors for anything that is not arithmetic."""

import pytest

from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool, format_value


@pytest.fixture
def calculator() -> CalculatorTool:
    return CalculatorTool("calculator", CalculatorOptions())


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 1", "2"),
        ("0.1 + 0.2", "0.3"),
        ("(3 + 4.5) * 2 / 5", "3"),
        ("1/3", "1/3 ≈ 0.333333333333"),
        ("-2/3", "-2/3 ≈ -0.666666666667"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("12.50 * 4", "50"),
        ("0.000125 * 8", "0.001"),
        ("1e3", "1000"),
        ("3 \u00d7 4 \u00f7 2", "6"),  # the multiplication and division signs
        ("2^8", "256"),
        ("((((5))))", "5"),
        ("10**30 + 1", "1000000000000000000000000000001"),
    ],
)
def test_exact_arithmetic(calculator, expression, expected):
    assert format_value(calculator.evaluate(expression)) == expected


@pytest.mark.parametrize(
    ("expression", "kind", "message"),
    [
        ("9**9**9", ToolErrorKind.EXECUTION_FAILED, "too large"),
        ("2**2**2**2**2", ToolErrorKind.EXECUTION_FAILED, "too large"),
        ("10**2000", ToolErrorKind.EXECUTION_FAILED, "too large"),
        ("1/0", ToolErrorKind.EXECUTION_FAILED, "division by zero"),
        ("5 % 0", ToolErrorKind.EXECUTION_FAILED, "division by zero"),
        ("0**-1", ToolErrorKind.EXECUTION_FAILED, "division by zero"),
        ("2**0.5", ToolErrorKind.INVALID_ARGUMENTS, "whole-number exponents"),
        ("1,000", ToolErrorKind.INVALID_ARGUMENTS, "thousands separators"),
        ("x + 1", ToolErrorKind.INVALID_ARGUMENTS, "unsupported 'x'"),
        ("__import__('os').system('id')", ToolErrorKind.INVALID_ARGUMENTS, "unsupported"),
        ("'a' * 3", ToolErrorKind.INVALID_ARGUMENTS, "unsupported"),
        ("1 +", ToolErrorKind.INVALID_ARGUMENTS, "not an arithmetic expression"),
        ("-" * 999 + "1", ToolErrorKind.INVALID_ARGUMENTS, ""),
        ("1" * 2000, ToolErrorKind.INVALID_ARGUMENTS, "at most 1000"),
    ],
)
def test_rejections_explain_themselves(calculator, expression, kind, message):
    with pytest.raises(ToolCallError) as info:
        calculator.evaluate(expression)
    assert info.value.kind == kind
    assert message in info.value.message


def test_bit_bound_is_configurable():
    small = CalculatorTool("calculator", CalculatorOptions(max_value_bits=16))
    assert format_value(small.evaluate("2**15")) == "32768"
    with pytest.raises(ToolCallError, match="too large"):
        small.evaluate("2**16 * 2")


def test_operations_per_call_can_be_limited():
    one_step = CalculatorTool("calculator", CalculatorOptions(max_operations=1))
    assert format_value(one_step.evaluate("(12 + 7)")) == "19"
    assert format_value(one_step.evaluate("-7 // 2")) == "-4"  # a sign is no operation
    with pytest.raises(ToolCallError) as info:
        one_step.evaluate("(12 + 7) * 3")
    assert info.value.kind == ToolErrorKind.INVALID_ARGUMENTS
    assert "'(12 + 7) * 3' has 2 operations" in info.value.message


async def test_execute_returns_the_formatted_value(calculator):
    result = await calculator.execute({}, calculator.parse_args('{"expression": "6*7"}'))
    assert result.text == "42" and result.error_kind is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["6*7"]', "must be a JSON object"),
        ('{"expr": "1"}', "'expression' is a required property"),
        ('{"expression": 5}', "expression: 5 is not of type 'string'"),
        ('{"expression": "1", "extra": 1}', "Additional properties"),
    ],
)
def test_parse_args_rejects_bad_arguments(calculator, raw, message):
    with pytest.raises(ToolCallError) as info:
        calculator.parse_args(raw)
    assert info.value.kind == ToolErrorKind.INVALID_ARGUMENTS
    assert message in info.value.message
