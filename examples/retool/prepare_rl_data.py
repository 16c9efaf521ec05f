"""DAPO-Math-17k (training) and AIME 2024 (held out) as ReTool prompts in verl's dataset rows,
for examples/retool/config.yaml.

Reads DAPO-Math-17k's `dapo-math-17k.parquet` (huggingface.co/datasets/BytedTsinghua-SIA/
DAPO-Math-17k: verl rows whose one user message wraps the problem in DAPO's "Answer:"
instruction, `reward_model.ground_truth` the answer; every problem appears about 100 times)
and AIME 2024 (huggingface.co/datasets/Maxwell-Jia/AIME_2024: rows `{ID, Problem, Solution,
Answer}`), parquet or JSON lines, and writes one row per distinct problem:

- `prompt`: one user message, ReTool's instruction (the ReTool paper's prompt, with the code
  going through the `python` tool instead of `<code>` tags) around the problem;
- `data_source`: "math_dapo" or "aime2024", which the reward service grades with its `math`
  scorer (math-verify on the `\\boxed{}` answer);
- `reward_model`: {"style": "rule", "ground_truth": the answer};
- `extra_info`: `split`, `index`, and `tools_kwargs` that open a `python` session for each
  trajectory, so its cells share variables as the cells of ReTool's SFT data do. They are JSON
  text, which the trainer decodes: parquet cannot store the session's empty `create_kwargs`
  as a struct.

The rows are written as parquet, `dapo_math_17k.parquet` and `aime2024.parquet`.

    python examples/retool/prepare_rl_data.py --dapo-file F --aime-file F [--output-dir DIR]
"""

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from turnrl.config import REPO_ROOT

PYTHON_TOOL = "python"
TRAIN_DATA_SOURCE = "math_dapo"
EVAL_DATA_SOURCE = "aime2024"
# ReTool's prompt, the one ReTool-SFT's conversations open with, with the `python` tool where
# it had `<code>` and `<interpreter>` tags; its `<answer>` tags are gone too, as verl's
# recipe/retool drops them from the SFT data: the `\\boxed{}` answer is what is graded.
INSTRUCTION = (
    "Solve the following problem step by step. You now have the ability to selectively write "
    "executable Python code to enhance your reasoning process. Call the `python` tool with the "
    "code: it runs in a sandbox, and its output is returned to aid your reasoning and help you "
    "arrive at the final answer. The code should be complete, including necessary imports; "
    "variables and imports persist from call to call.\n"
    "The last part of your response should be in the following format:\n"
    "\\boxed{'The final answer goes here.'}\n\n"
    "*user question:*\n{question}\n\n"
    "Remember to place the final answer in the last part using the format: \n"
    "\\boxed{'The final answer goes here.'}"
)
# What DAPO-Math-17k writes around each problem.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
TRAIN_FILE = "dapo_math_17k.parquet"
EVAL_FILE = "aime2024.parquet"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "data" / "retool" / "rl"


def user_message(question: str) -> dict[str, str]:
    """The prompt's one message: ReTool's instruction around `question`. The SFT data's
    conversations open with it too (prepare_sft_data.py)."""
    return {"role": "user", "content": INSTRUCTION.replace("{question}", question.strip())}


def dapo_question(prompt_text: str) -> str:
    """The problem inside DAPO-Math-17k's prompt text. Raises ValueError when the text lacks
    DAPO's instruction around it."""
    if not (prompt_text.startswith(DAPO_PREFIX) and prompt_text.endswith(DAPO_SUFFIX)):
        raise ValueError(f"not a DAPO-Math-17k prompt: {prompt_text[:80]!r}")
    return prompt_text[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)]


def to_row(question: str, answer: Any, data_source: str, split: str, index: int) -> dict:
    """One problem as a verl-format row (see the module docstring)."""
    return {
        "data_source": data_source,
        "prompt": [user_message(question)],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "tools_kwargs": json.dumps({PYTHON_TOOL: {"create_kwargs": {}}}),
        },
    }


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a parquet or JSON lines file, a batch at a time (DAPO-Math-17k's parquet
    holds 1.8 million)."""
    if path.suffix == ".parquet":
        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
    else:
        with path.open() as lines:
            yield from (json.loads(line) for line in lines if line.strip())


def dapo_rows(path: Path) -> list[dict]:
    """DAPO-Math-17k's distinct problems as rows, in the order they first appear."""
    answers: dict[str, Any] = {}
    for row in read_rows(path):
        question = dapo_question(row["prompt"][0]["content"])
        answers.setdefault(question, row["reward_model"]["ground_truth"])
    return [
        to_row(question, answer, TRAIN_DATA_SOURCE, "train", index)
        for index, (question, answer) in enumerate(answers.items())
    ]


def aime_rows(path: Path) -> list[dict]:
    """AIME 2024's problems as rows."""
    return [
        to_row(row["Problem"], row["Answer"], EVAL_DATA_SOURCE, "test", index)
        for index, row in enumerate(read_rows(path))
    ]


def convert(dapo_file: Path, aime_file: Path, output_dir: Path) -> dict[str, int]:
    """Writes the training and held-out files into `output_dir`; returns the rows of each."""
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in ((TRAIN_FILE, dapo_rows(dapo_file)), (EVAL_FILE, aime_rows(aime_file))):
        pq.write_table(pa.Table.from_pylist(rows), output_dir / name)
        counts[name] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dapo-file", type=Path, required=True, help="DAPO-Math-17k's dapo-math-17k.parquet"
    )
    parser.add_argument(
        "--aime-file", type=Path, required=True, help="AIME 2024 (Maxwell-Jia/AIME_2024)"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        help=f"where {TRAIN_FILE} and {EVAL_FILE} go (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        counts = convert(args.dapo_file, args.aime_file, args.output_dir)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        print(f"prepare_rl_data: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for name, count in counts.items():
        print(f"{count} rows -> {args.output_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
