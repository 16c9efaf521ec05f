"""`calculator`: exact arithmetic on integers, decimals and fractions, without eval.

The expression is parsed with `ast` and only numbers, parentheses and + - * / // % ** are
allowed. Values are `Fraction`s, so 0.1 + 0.2 is exactly 0.3 and 1/3 stays 1/3. Every
intermediate value is capped in size, so `9**9**9` is an error, not a hung service.
"""

import ast
import operator
from fractions import Fraction
from typing import Any, ClassVar

from pydantic import Field

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from turnrl.calculator_data import CALCULATOR_TOOL
from turnrl.config import StrictModel

BINARY_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Symbols models write that Python spells differently: times, divide, minus sign, caret.
SYMBOL_REPLACEMENTS = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "^": "**"}
DECIMAL_PLACES = 12


class CalculatorOptions(StrictModel):
    """Size bounds of the calculator."""

    max_expression_length: int = Field(
        default=1000, gt=0, description="Longest expression accepted, in characters."
    )
    max_value_bits: int = Field(
        default=4096,
        gt=0,
        description="Largest numerator or denominator of any intermediate value, in bits "
        "(4096 bits is about 1233 decimal digits).",
    )
    max_operations: int | None = Field(
        default=None,
        gt=0,
        description="Most binary operations (+ - * / // % **) in one expression; null: any. "
        "1 makes a chained problem take one call per step (benchmarks/turn_credit.py).",
    )


class CalculatorTool(Tool):
    """Evaluates an arithmetic expression exactly."""

    # One schema for the served tool and the calculator task's conversations (which the tiny
    # model is fine-tuned on), so the model learns the schema it is later shown.
    schema: ClassVar[dict[str, Any]] = CALCULATOR_TOOL["function"]
    Options = CalculatorOptions

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        # Microseconds of work, bounded by the size caps: no need to leave the event loop.
        return ToolResult(text=format_value(self.evaluate(args["expression"])))

    def evaluate(self, expression: str) -> Fraction:
        """The exact value of `expression`; ToolCallError explains what is not allowed."""
        options: CalculatorOptions = self.options
        if len(expression) > options.max_expression_length:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"expression is {len(expression)} characters; at most "
                f"{options.max_expression_length} are allowed",
            )
        for symbol, replacement in SYMBOL_REPLACEMENTS.items():
            expression = expression.replace(symbol, replacement)
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS, f"not an arithmetic expression: {expression!r}"
            ) from None
        operations = sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))
        if options.max_operations is not None and operations > options.max_operations:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"{expression!r} has {operations} operations; this calculator takes at most "
                f"{options.max_operations} per call: compute one step a call",
            )
        try:
            return _Evaluator(expression, options.max_value_bits).visit(tree.body)
        except RecursionError:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS, "expression is nested too deeply"
            ) from None


class _Evaluator:
    def __init__(self, source: str, max_value_bits: int) -> None:
        self._source = source
        self._max_bits = max_value_bits

    def visit(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            # The literal's own text, so 0.1 is exactly 1/10 rather than the nearest float.
            return self._checked(Fraction(ast.get_source_segment(self._source, node) or "0"))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATORS:
            return UNARY_OPERATORS[type(node.op)](self.visit(node.operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return self._power(self.visit(node.left), self.visit(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS:
            left, right = self.visit(node.left), self.visit(node.right)
            if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
                raise ToolCallError(ToolErrorKind.EXECUTION_FAILED, "division by zero")
            return self._checked(BINARY_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.Tuple):
            hint = "; write numbers without thousands separators" if node.elts else ""
            raise ToolCallError(ToolErrorKind.INVALID_ARGUMENTS, f"commas are not arithmetic{hint}")
        segment = ast.get_source_segment(self._source, node) or type(node).__name__
        raise ToolCallError(
            ToolErrorKind.INVALID_ARGUMENTS,
            f"unsupported {segment!r}: only numbers, parentheses and + - * / // % ** are allowed",
        )

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"only whole-number exponents are exact; got {format_value(exponent)}",
            )
        if base == 0 and exponent < 0:
            raise ToolCallError(ToolErrorKind.EXECUTION_FAILED, "division by zero")
        size = max(base.numerator.bit_length(), base.denominator.bit_length())
        if base not in (0, 1, -1) and (size - 1) * abs(exponent.numerator) > self._max_bits:
            raise ToolCallError(
                ToolErrorKind.EXECUTION_FAILED,
                f"result too large: {format_value(base)}**{exponent.numerator} exceeds "
                f"{self._max_bits} bits",
            )
        return self._checked(base**exponent.numerator)

    def _checked(self, value: Fraction) -> Fraction:
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > self._max_bits:
            raise ToolCallError(
                ToolErrorKind.EXECUTION_FAILED, f"result too large: exceeds {self._max_bits} bits"
            )
        return value


def format_value(value: Fraction) -> str:
    """An integer as is, a terminating decimal exactly, anything else as a fraction with a
    decimal approximation: '42', '0.75', '1/3 ≈ 0.333333333333'."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:  # a terminating decimal: print every digit
        places = 0
        while (value * 10**places).denominator != 1:
            places += 1
        scaled = abs(value.numerator * 10**places // value.denominator)
        digits = str(scaled).rjust(places + 1, "0")
        sign = "-" if value < 0 else ""
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    approximation = round(value, DECIMAL_PLACES)
    return f"{value.numerator}/{value.denominator} ≈ {format_value(approximation)}"
