"""A calculator agent written with the `openai` SDK's function calling alone: it runs as is
against any OpenAI-compatible server, and turnrl trains it unchanged (config.yaml beside it).

turnrl calls `solve(prompt, base_url, api_key)` once per episode, in a process of its own,
with the base URL of the episode's gateway session; the model's tool calls are run here, by
the agent, as they would be in production. The answer it returns is scored by the reward
service (the calculator task's `#### <answer>` rule).
"""

import ast
import json
import operator
from fractions import Fraction
from typing import Any

import openai

# The schema the policy was fine-tuned with (one place in turnrl); an agent of your own has
# its own tools.
from turnrl.calculator_data import CALCULATOR_TOOL

MAX_TURNS = 4
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def solve(prompt: dict[str, Any], base_url: str, api_key: str) -> str:
    """Runs the model with the calculator until it answers; returns its final message."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    messages: list[Any] = list(prompt["messages"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR_TOOL]
        )
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def calculator(arguments: str) -> str:
    """The calculator tool on a call's JSON arguments, or what was wrong with them."""
    try:
        return calculate(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


def calculate(expression: str) -> str:
    """Exact arithmetic on `expression`, or what was wrong with it."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return Fraction(OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")
