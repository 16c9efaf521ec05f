"""NQ and HotpotQA as search-tool prompts in verl's dataset format, for
examples/search_r1/config.yaml.

Search-R1's data (github.com/PeterGriffinJin/Search-R1, scripts/data_process/
qa_search_train_merge.py and qa_search_test_merge.py): train on NQ train + HotpotQA train, test
on NQ test + HotpotQA dev. Reads:

- NQ-open JSONL (github.com/google-research-datasets/natural-questions, nq_open/), one
  `{"question", "answer": [golds]}` per line. Its dev file is the NQ test set of DPR, FlashRAG
  and Search-R1 (3,610 questions).
- HotpotQA JSON (hotpotqa.github.io): one list of `{"question", "answer", ...}`, the answer a
  string; other keys (`_id`, `context`, `supporting_facts`, `type`, `level`) are not used.

and writes `train.parquet` and `test.parquet`, one row per question, NQ's rows first:

- `prompt`: one user message, Search-R1's instruction with its `<search>` syntax replaced by
  the `search` tool (as verl's examples/sglang_multiturn/search_r1_like adapts it), then the
  question, stripped and ending in "?" as Search-R1 writes it;
- `data_source`: "nq" or "hotpotqa", which the reward service grades by exact match (search_em);
- `reward_model`: {"style": "rule", "ground_truth": {"target": [golds]}};
- `extra_info`: `split`, `index` (the row's place in its file, so prompt ids are unique across
  the two sources) and `question`.

    python examples/search_r1/prepare_data.py --nq-train F --nq-test F \\
        --hotpotqa-train F --hotpotqa-dev F [--output-dir DIR]
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from turnrl.config import REPO_ROOT

NQ = "nq"
HOTPOTQA = "hotpotqa"
# The tool the prompt names; examples/search_r1/config.yaml serves and offers it.
SEARCH_TOOL = "search"
INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    f"you can call the `{SEARCH_TOOL}` tool with a query and it will return the top searched "
    "results between <tool_response> and </tool_response>. You can search as many times as "
    "you want. If you find no further external knowledge needed, you can directly provide the "
    "answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: "
)
DEFAULT_OUTPUT_DIR = REPO_ROOT / "data" / "search_r1"


def question_text(question: str) -> str:
    """The question as Search-R1 asks it: stripped, ending in a question mark."""
    question = question.strip()
    return question if question.endswith("?") else f"{question}?"


def read_nq(path: Path) -> list[tuple[str, list[str]]]:
    """(question, golds) of each line of an NQ-open JSONL file."""
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            pairs.append(_question_and_golds(row, row.get("answer"), f"{path}:{number}"))
    return pairs


def read_hotpotqa(path: Path) -> list[tuple[str, list[str]]]:
    """(question, [answer]) of each question of a HotpotQA JSON file."""
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected HotpotQA's JSON list of questions")
    return [
        _question_and_golds(row, [row.get("answer")], f"{path}, question {index}")
        for index, row in enumerate(rows)
    ]


def _question_and_golds(row: Any, golds: Any, where: str) -> tuple[str, list[str]]:
    question = row.get("question") if isinstance(row, dict) else None
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: no question in {str(row)[:200]!r}")
    if not isinstance(golds, list) or not golds or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"{where}: the answer is not a string or a list of strings: {golds!r}")
    return question, golds


def to_row(
    data_source: str, question: str, golds: list[str], split: str, index: int
) -> dict[str, Any]:
    """One question as a verl-format row (see the module docstring)."""
    asked = question_text(question)
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": INSTRUCTION + asked}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
        "extra_info": {"split": split, "index": index, "question": asked},
    }


def write_split(sources: list[tuple[str, Path]], split: str, output_dir: Path) -> int:
    """Writes `<output_dir>/<split>.parquet` from (data_source, file) pairs, in order; returns
    its rows."""
    readers = {NQ: read_nq, HOTPOTQA: read_hotpotqa}
    questions = [
        (data_source, question, golds)
        for data_source, path in sources
        for question, golds in readers[data_source](path)
    ]
    rows = [to_row(*question, split, index) for index, question in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), output_dir / f"{split}.parquet")
    return len(rows)


def convert(
    nq_train: Path, nq_test: Path, hotpotqa_train: Path, hotpotqa_dev: Path, output_dir: Path
) -> dict[str, int]:
    """Writes train.parquet and test.parquet into `output_dir`; returns the rows of each."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return {
        "train": write_split([(NQ, nq_train), (HOTPOTQA, hotpotqa_train)], "train", output_dir),
        "test": write_split([(NQ, nq_test), (HOTPOTQA, hotpotqa_dev)], "test", output_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    inputs = {
        "--nq-train": "NQ-open train JSONL (NQ-open.train.jsonl)",
        "--nq-test": "NQ-open dev JSONL, Search-R1's NQ test set (NQ-open.dev.jsonl)",
        "--hotpotqa-train": "HotpotQA train JSON (hotpot_train_v1.1.json)",
        "--hotpotqa-dev": "HotpotQA dev JSON, Search-R1's HotpotQA test set "
        "(hotpot_dev_distractor_v1.json)",
    }
    for flag, help_text in inputs.items():
        parser.add_argument(flag, type=Path, required=True, help=help_text)
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        help="where train.parquet and test.parquet go (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        counts = convert(
            args.nq_train, args.nq_test, args.hotpotqa_train, args.hotpotqa_dev, args.output_dir
        )
    except (OSError, ValueError) as e:
        print(f"prepare_data: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for split, count in counts.items():
        print(f"{split}: {count} rows -> {args.output_dir / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
