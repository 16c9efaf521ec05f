"""ReTool's cold-start data (ReTool-SFT) as multi-turn tool conversations in verl's multi-turn
SFT format, for examples/retool/sft.yaml (and qwen3_sft.yaml).

Reads ReTool-SFT's parquet or JSON lines (huggingface.co/datasets/JoeYing/ReTool-SFT, about
2,000 rows `{"messages": [user, assistant]}`): the user message is ReTool's prompt with the
problem after `*user question:*`; the assistant message is one text that interleaves reasoning,
code cells `<code>```python ...```</code>`, each followed by its result
`<interpreter>...</interpreter>`, and ends with `<answer>\\boxed{...}</answer>`. Each row becomes
a conversation the policy could have had in RL:

- the user message of prepare_rl_data.py (the instruction the RL prompts give) around the
  problem;
- per code cell, an assistant turn of the reasoning before it with one `python` tool call of
  the cell's code, then a `tool` message of the cell's result;
- a last assistant turn of the reasoning after the last result and the `\\boxed{}` answer
  (the `<answer>` tags dropped, as verl's conversion drops them);
- `tools`: the `python` tool's schema as the tool service serves it with
  `enable_stateful_sessions` (config.yaml), as JSON text.

With `--thinking` (Qwen3 with thinking on) each turn's reasoning is its `reasoning_content`,
which Qwen3's template writes in a `<think>` block, and only the tool call or the answer is
its content. Without it the reasoning is the content (Qwen2.5; and Qwen3 with thinking off,
whose template then writes an empty `<think>` block in every turn, as Qwen3 does itself).

Writes `train.parquet` and, from the last `--held-out` rows, `held_out.parquet`.

    python examples/retool/prepare_sft_data.py --retool-sft-file F [--thinking] [--output-dir DIR]
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

# Beside this script, whose folder Python puts on the path: the RL prompts' user message.
from prepare_rl_data import PYTHON_TOOL, read_rows, user_message

from tool_svc.tools.python import STATEFUL_NOTE, PythonTool
from turnrl.config import REPO_ROOT

QUESTION_MARKER = "*user question:*"
# What ReTool's prompt says after the problem.
REMINDER = "\n\nRemember to place the final answer"
# A code cell, then its result; the code is the ```python fence inside <code> when it has one.
CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
RESULT = re.compile(r"\s*<interpreter>(.*?)</interpreter>", re.DOTALL)
FENCE = re.compile(r"```python(.*?)```", re.DOTALL)
ANSWER = re.compile(r"(.*)<answer>(.*?)</answer>\s*", re.DOTALL)
# The rollout names the calls of a turn call_0, call_1, ... (rollout_svc/parsers.py).
CALL_ID = "call_0"
PYTHON_SCHEMA = {
    **PythonTool.schema,
    "description": f"{PythonTool.schema['description']} {STATEFUL_NOTE}",
}
TOOLS = [{"type": "function", "function": PYTHON_SCHEMA}]
DEFAULT_OUTPUT_DIR = REPO_ROOT / "data" / "retool" / "sft"
DEFAULT_THINKING_OUTPUT_DIR = REPO_ROOT / "data" / "retool" / "sft_thinking"


def question_of(prompt_text: str) -> str:
    """The problem inside ReTool's prompt. Raises ValueError without `*user question:*`."""
    _, marker, after = prompt_text.partition(QUESTION_MARKER)
    if not marker:
        raise ValueError(f"no {QUESTION_MARKER!r} in the prompt {prompt_text[:80]!r}")
    return after.partition(REMINDER)[0].strip()


def assistant_turn(reasoning: str, answer: str, thinking: bool) -> dict[str, Any]:
    """An assistant turn of `reasoning`, then `answer` ("" in a turn that calls a tool); with
    `thinking` the reasoning is its reasoning_content and the answer its content."""
    if thinking:
        return {
            "role": "assistant",
            "content": answer.strip(),
            "reasoning_content": reasoning.strip(),
        }
    return {"role": "assistant", "content": (reasoning + answer).strip()}


def code_turns(prose: str, code: str, result: str, thinking: bool) -> list[dict[str, Any]]:
    """One code cell: the assistant turn that calls `python` with it, then its result."""
    fenced = FENCE.search(code)
    arguments = {"code": (fenced.group(1) if fenced else code).strip()}
    call = {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": PYTHON_TOOL, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
    turn = {**assistant_turn(prose, "", thinking), "tool_calls": [call]}
    tool = {"role": "tool", "content": result.strip(), "tool_call_id": CALL_ID, "name": PYTHON_TOOL}
    return [turn, tool]


def solution_messages(solution: str, thinking: bool) -> list[dict[str, Any]]:
    """The turns of one ReTool-SFT solution text. Raises ValueError for a code cell without
    its result or a solution that does not end with `<answer>...</answer>`."""
    messages = []
    position = 0
    while (code := CODE.search(solution, position)) is not None:
        result = RESULT.match(solution, code.end())
        if result is None:
            raise ValueError(f"a code cell without its <interpreter> result: {code[0][:200]!r}")
        prose = solution[position : code.start()]
        messages += code_turns(prose, code[1], result[1], thinking)
        position = result.end()
    answer = ANSWER.fullmatch(solution, position)
    if answer is None:
        raise ValueError(
            f"the solution does not end with <answer>...</answer>: {solution[position:][-200:]!r}"
        )
    reasoning, boxed = answer.groups()
    return [*messages, assistant_turn(reasoning, boxed, thinking)]


def to_row(row: dict[str, Any], thinking: bool) -> dict[str, Any]:
    """One ReTool-SFT row as a verl multi-turn SFT row (see the module docstring)."""
    first = {}  # the first message's text of each role
    for message in row["messages"]:
        first.setdefault(message["role"], message["content"])
    if not {"user", "assistant"} <= first.keys():
        raise ValueError(f"expected a user and an assistant message, got roles {list(first)}")
    return {
        "messages": [
            user_message(question_of(first["user"])),
            *solution_messages(first["assistant"], thinking),
        ],
        "tools": json.dumps(TOOLS),
    }


def convert(
    retool_sft_file: Path, output_dir: Path, thinking: bool, held_out: int
) -> dict[str, int]:
    """Writes train.parquet and held_out.parquet into `output_dir`; returns the rows of each."""
    rows = []
    for index, row in enumerate(read_rows(retool_sft_file)):
        try:
            rows.append(to_row(row, thinking))
        except ValueError as e:
            raise ValueError(f"{retool_sft_file}, row {index}: {e}") from None
    split = len(rows) - held_out
    if split < 1:
        raise ValueError(f"holding out {held_out} of {len(rows)} rows leaves none to train on")
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, part in (("train.parquet", rows[:split]), ("held_out.parquet", rows[split:])):
        pq.write_table(pa.Table.from_pylist(part), output_dir / name)
        counts[name] = len(part)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--retool-sft-file", type=Path, required=True, help="ReTool-SFT's parquet file"
    )
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="reasoning as reasoning_content, for Qwen3 with thinking on",
    )
    parser.add_argument(
        "--held-out", type=int, default=64, help="rows held out (default: %(default)s)"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        help=f"default: {DEFAULT_OUTPUT_DIR}, or {DEFAULT_THINKING_OUTPUT_DIR} with --thinking",
    )
    args = parser.parse_args(argv)
    output_dir = args.output_dir or (
        DEFAULT_THINKING_OUTPUT_DIR if args.thinking else DEFAULT_OUTPUT_DIR
    )
    try:
        counts = convert(args.retool_sft_file, output_dir, args.thinking, args.held_out)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"prepare_sft_data: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for name, count in counts.items():
        print(f"{count} conversations -> {output_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
