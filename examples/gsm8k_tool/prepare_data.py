"""GSM8K as multi-turn tool prompts in verl's dataset format, for examples/gsm8k_tool/config.yaml.

Reads the GSM8K release's `train.jsonl` and `test.jsonl` (rows `{"question", "answer"}`, the
answer a worked solution ending `#### <number>`; github.com/openai/grade-school-math) and writes
`train.parquet` and `test.parquet`, one row per problem, the rows of verl's
examples/data_preprocess/gsm8k_multiturn_w_tool.py:

- `prompt`: a system message naming the tools and the `#### <answer>` ending, then the question;
- `data_source`: "openai/gsm8k", which the reward service grades with its `gsm8k` scorer;
- `reward_model`: {"style": "rule", "ground_truth": the final number, thousands commas removed};
- `extra_info`: `split`, `index`, and `tools_kwargs` opening each trajectory's `gsm8k_answer`
  session on the same ground truth.

verl's example offers one tool, `calc_gsm8k_reward` (turnrl's `gsm8k_answer`), which checks a
submitted answer; this one offers the `calculator` as well.

    python examples/gsm8k_tool/prepare_data.py --gsm8k-dir DIR [--output-dir DIR]

DIR holds the two files of the release (grade_school_math/data/ in that repository).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from turnrl.config import REPO_ROOT

DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")
# The tools the prompt names; examples/gsm8k_tool/config.yaml serves and offers these.
CALCULATOR_TOOL = "calculator"
ANSWER_TOOL = "gsm8k_answer"
SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    f"Use the `{CALCULATOR_TOOL}` tool for arithmetic. Before you give your final answer, "
    f"submit it with the `{ANSWER_TOOL}` tool at least once and refine it if it is wrong. "
    "Put your final answer in the format of `#### <answer>`."
)
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
DEFAULT_OUTPUT_DIR = REPO_ROOT / "data" / "gsm8k_tool"


def final_answer(solution: str) -> str:
    """The number after a GSM8K solution's `####`, without thousands commas: "1,080" -> "1080".

    Raises ValueError when the solution has no `####`.
    """
    _, marker, after = solution.rpartition("####")
    if not marker:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return after.strip().replace(",", "")


def to_row(problem: dict[str, str], split: str, index: int) -> dict[str, Any]:
    """One GSM8K problem as a verl-format row (see the module docstring)."""
    answer = final_answer(problem["answer"])
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{problem['question']} {INSTRUCTION}"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "tools_kwargs": {ANSWER_TOOL: {"create_kwargs": {"ground_truth": answer}}},
        },
    }


def convert(gsm8k_dir: Path, output_dir: Path) -> dict[str, int]:
    """Writes `<output_dir>/<split>.parquet` for both splits; returns the rows of each."""
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        lines = (gsm8k_dir / f"{split}.jsonl").read_text().splitlines()
        problems = [json.loads(line) for line in lines if line.strip()]
        rows = [to_row(problem, split, index) for index, problem in enumerate(problems)]
        pq.write_table(pa.Table.from_pylist(rows), output_dir / f"{split}.parquet")
        counts[split] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gsm8k-dir",
        type=Path,
        required=True,
        help="folder with GSM8K's train.jsonl and test.jsonl",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        help="where train.parquet and test.parquet go (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        counts = convert(args.gsm8k_dir, args.output_dir)
    except (OSError, ValueError, KeyError) as e:
        print(f"prepare_data: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for split, count in counts.items():
        print(f"{split}: {count} rows -> {args.output_dir / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
