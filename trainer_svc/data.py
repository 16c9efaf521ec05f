"""Training and held-out prompts: verl-format parquet/JSONL files, or generated calculator
problems, and the epoch-wise order the controller draws batches in.

A verl record is {"prompt": [chat messages], "data_source": str, "reward_model":
{"ground_truth": ...}, "extra_info": {"tools_kwargs": {...}, "interaction_kwargs": {...}, ...}}.
"""

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from google.protobuf import json_format

from trainer_svc.config import DataConfig
from turnrl.calculator_data import ProblemSettings, generate_problems
from turnrl.errors import ConfigError
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2, rollout_pb2

CALCULATOR_DATA_SOURCE = "openai/gsm8k"


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset, as the rollout service takes it."""

    prompt_id: str
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_name: str = ""
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)

    def to_proto(self, tools: list[common_pb2.ToolSchema]) -> rollout_pb2.RolloutPrompt:
        prompt = rollout_pb2.RolloutPrompt(
            prompt_id=self.prompt_id,
            messages=[dict_to_message(m) for m in self.messages],
            tools=tools,
            data_source=self.data_source,
            interaction_name=self.interaction_name,
        )
        json_format.ParseDict(self.ground_truth, prompt.ground_truth)
        prompt.tools_kwargs.update(self.tools_kwargs)
        prompt.interaction_kwargs.update(self.interaction_kwargs)
        prompt.extra_info.update(self.extra_info)
        return prompt


def load_datasets(config: DataConfig, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training and held-out prompts. Raises ConfigError for unreadable or malformed files."""
    if not config.train_files:
        try:
            settings = ProblemSettings(**config.generated_problems)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"trainer.data.generated_problems: {e}") from None
        train = _calculator_records(config.generated_train_size, seed, "train", settings)
        held_out = _calculator_records(config.generated_eval_size, seed, "test", settings)
    else:
        train = [r for path in config.train_files for r in read_records(path)]
        held_out = [r for path in config.eval_files for r in read_records(path)]
    if config.max_eval_prompts is not None:
        held_out = held_out[: config.max_eval_prompts]
    return train, held_out


def read_records(path: Path) -> list[PromptRecord]:
    """The records of one verl-format parquet or JSONL file."""
    try:
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix in (".jsonl", ".json"):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            raise ConfigError(f"data file {path}: expected .parquet or .jsonl")
    except (OSError, ValueError) as e:
        raise ConfigError(f"data file {path}: {e}") from None
    return [_record(row, f"{path.stem}-{index}", path) for index, row in enumerate(rows)]


def _record(row: dict[str, Any], default_id: str, path: Path) -> PromptRecord:
    where = f"data file {path}, record {default_id}"
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: `prompt` must be a non-empty list of chat messages")
    extra_info = dict(row.get("extra_info") or {})
    interaction = extra_info.pop("interaction_kwargs", None) or {}
    reward_model = row.get("reward_model") or {}
    if "ground_truth" not in reward_model:
        raise ConfigError(f"{where}: `reward_model.ground_truth` is missing")
    index = extra_info.get("index")
    return PromptRecord(
        prompt_id=f"{path.stem}-{index}" if index is not None else default_id,
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        data_source=str(row.get("data_source", "")),
        ground_truth=reward_model["ground_truth"],
        tools_kwargs=_drop_nulls(extra_info.pop("tools_kwargs", None) or {}),
        interaction_name=str(interaction.get("name", "")),
        interaction_kwargs=_drop_nulls(interaction),
        extra_info=_drop_nulls(extra_info),
    )


def _drop_nulls(value: Any) -> Any:
    """Parquet gives every struct the union of all rows' keys, absent ones as None."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return value


def _calculator_records(
    count: int, seed: int, split: str, settings: ProblemSettings
) -> list[PromptRecord]:
    return [
        PromptRecord(
            prompt_id=f"calculator-{split}-{index}",
            messages=problem.prompt_messages,
            data_source=CALCULATOR_DATA_SOURCE,
            ground_truth=str(problem.answer),
        )
        for index, problem in enumerate(
            generate_problems(count, seed=seed, split=split, settings=settings)
        )
    ]


class PromptSampler:
    """Batches of training prompts, epoch after epoch, in a seeded order per epoch.

    `position` (prompts drawn so far) is all a checkpoint needs to continue the same sequence.
    """

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool) -> None:
        if not records:
            raise ConfigError("the training set is empty")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self.position = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def next_batch(self, size: int) -> list[PromptRecord]:
        batch = [self._record_at(self.position + i) for i in range(size)]
        self.position += size
        return batch

    def _record_at(self, position: int) -> PromptRecord:
        epoch, index = divmod(position, len(self._records))
        if self._epoch_order[0] != epoch:
            order = list(range(len(self._records)))
            if self._shuffle:
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._records[self._epoch_order[1][index]]
