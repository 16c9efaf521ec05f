"""Datasets in verl's format (parquet and JSONL), the generated calculator data, and the
seeded, resumable order of training batches."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from google.protobuf import json_format

from trainer_svc.config import DataConfig
from trainer_svc.data import EpochSampler, load_datasets, read_records
from turnrl.errors import ConfigError
from turnrl.v1 import common_pb2

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {
            "index": 0,
            "split": "train",
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}},
            "interaction_kwargs": {
                "name": "gsm8k",
                "query": "What is 6 * 7?",
                "ground_truth": "42",
            },
        },
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 1 + 1?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 1, "split": "train"},
    },
]


def test_parquet_and_jsonl_give_the_same_records(tmp_path):
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), parquet)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in VERL_ROWS))
    from_parquet, from_jsonl = read_records(parquet), read_records(jsonl)
    assert from_parquet[1] == from_jsonl[1]
    first = from_parquet[0]
    assert first.prompt_id == "train-0"
    assert first.messages == [{"role": "user", "content": "What is 6 * 7?"}]
    assert first.ground_truth == "42"
    assert first.tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}}
    assert first.interaction_name == "gsm8k"
    assert first.interaction_kwargs["ground_truth"] == "42"
    assert first.extra_info == {"index": 0, "split": "train"}
    # Parquet fills absent struct keys with nulls; they must not reach the prompt.
    assert from_parquet[1].tools_kwargs == {} and from_parquet[1].interaction_name == ""

    schema = common_pb2.ToolSchema(name="calculator", parameters_json="{}")
    prompt = first.to_proto([schema])
    assert prompt.tools[0].name == "calculator"
    assert json_format.MessageToDict(prompt.ground_truth) == "42"
    assert prompt.data_source == "openai/gsm8k"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": [], "reward_model": {"ground_truth": "1"}}\n', "non-empty list"),
        ('{"prompt": [{"role": "user", "content": "hi"}]}\n', "reward_model.ground_truth"),
        ("{not json\n", "data file"),
    ],
)
def test_malformed_records_are_config_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_records(path)


def test_unknown_suffix_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"\.parquet or \.jsonl"):
        read_records(tmp_path / "data.csv")
    with pytest.raises(ConfigError, match=r"missing\.jsonl"):
        read_records(tmp_path / "missing.jsonl")


def test_generated_calculator_data_has_disjoint_splits():
    train, held_out = load_datasets(
        DataConfig(generated_train_size=50, generated_eval_size=10, max_eval_prompts=7), seed=3
    )
    assert len(train) == 50 and len(held_out) == 7
    questions = {r.messages[-1]["content"] for r in train}
    assert not questions & {r.messages[-1]["content"] for r in held_out}
    assert all(
        r.data_source == "openai/gsm8k" and r.ground_truth.lstrip("-").isdigit() for r in train
    )


def test_sampler_order_is_seeded_covers_each_epoch_and_resumes():
    train, _ = load_datasets(DataConfig(generated_train_size=10), seed=0)
    sampler = EpochSampler(train, seed=1, shuffle=True)
    first_epoch = sampler.next_batch(4) + sampler.next_batch(6)
    assert sorted(r.prompt_id for r in first_epoch) == sorted(r.prompt_id for r in train)
    assert [r.prompt_id for r in first_epoch] != [r.prompt_id for r in train]  # shuffled
    later = sampler.next_batch(7)

    resumed = EpochSampler(train, seed=1, shuffle=True)
    resumed.position = 10
    assert resumed.next_batch(7) == later
    assert EpochSampler(train, seed=1, shuffle=False).next_batch(3) == train[:3]
    with pytest.raises(ConfigError, match="empty"):
        EpochSampler([], seed=0, shuffle=True)
