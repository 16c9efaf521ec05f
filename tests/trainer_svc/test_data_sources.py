"""`datasets` sources in trainer.data (trainer_svc/data.py): a save_to_disk folder and a local
dataset repository read through `datasets.load_dataset`, offline, giving the same records as a
file; their errors; and the config's syntax for them."""

import json
import re

import datasets
import pytest
from pydantic import ValidationError

from trainer_svc.config import DataConfig, DatasetSource
from trainer_svc.data import load_datasets, read_conversations, read_records
from turnrl.errors import ConfigError

from .test_data import VERL_ROWS, parquet_and_jsonl


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Nothing downloaded, and `datasets`' cache in the test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def dataset_repo(folder, rows_by_split: dict[str, list[dict]]):
    """A local dataset repository: one <split>.jsonl per split, as on the Hub."""
    folder.mkdir()
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_save_to_disk_folder_gives_the_records_of_the_same_rows_in_a_file(tmp_path):
    [from_file, _] = parquet_and_jsonl(tmp_path, "train", VERL_ROWS)
    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(tmp_path / "saved")
    records = read_records(DatasetSource(disk=tmp_path / "saved"))
    expected = read_records(from_file)
    assert [r.prompt_id for r in records] == ["saved-0", "saved-1"]
    for record, wanted in zip(records, expected, strict=True):
        assert record.messages == wanted.messages
        assert record.ground_truth == wanted.ground_truth
        assert record.tools_kwargs == wanted.tools_kwargs
        assert record.interaction_kwargs == wanted.interaction_kwargs
        assert record.extra_info == wanted.extra_info

    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(VERL_ROWS), test=datasets.Dataset.from_list(VERL_ROWS[1:])
    )
    splits.save_to_disk(tmp_path / "splits")
    [test] = read_records(DatasetSource(disk=tmp_path / "splits", split="test"))
    assert test.prompt_id == "splits-test-1" and test.ground_truth == "2"


def test_a_dataset_repository_loads_by_path_and_split_through_load_dataset(tmp_path):
    repo = dataset_repo(tmp_path / "gsm8k", {"train": VERL_ROWS, "test": VERL_ROWS[1:]})
    config = DataConfig(
        train_files=[DatasetSource(hf=str(repo), split="train")],
        eval_files=[DatasetSource(hf=str(repo), split="test")],
    )
    train, held_out = load_datasets(config, seed=0)
    assert [r.prompt_id for r in train] == ["gsm8k-train-0", "gsm8k-train-1"]
    assert train[0].tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}}
    assert [r.messages[-1]["content"] for r in held_out] == ["What is 1 + 1?"]


def test_sft_conversations_load_from_a_dataset_folder(tmp_path):
    conversation = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    datasets.Dataset.from_list([conversation]).save_to_disk(tmp_path / "sft")
    [loaded] = read_conversations(DatasetSource(disk=tmp_path / "sft"))
    assert loaded.conversation_id == "sft-0" and loaded.messages == conversation["messages"]


def test_a_missing_split_names_the_dataset_and_the_splits_there(tmp_path):
    repo = dataset_repo(tmp_path / "repo", {"train": VERL_ROWS})
    with pytest.raises(
        ConfigError, match=rf"dataset '{re.escape(str(repo))}' split 'validation': .*validation"
    ):
        read_records(DatasetSource(hf=str(repo), split="validation"))
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(VERL_ROWS))
    splits.save_to_disk(tmp_path / "splits")
    with pytest.raises(ConfigError, match=r"the split None is not there; splits: \['train'\]"):
        read_records(DatasetSource(disk=tmp_path / "splits"))
    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(tmp_path / "one")
    with pytest.raises(ConfigError, match="holds one dataset, no splits; drop `split`"):
        read_records(DatasetSource(disk=tmp_path / "one", split="train"))


def test_a_bad_column_names_the_dataset_record_and_field(tmp_path):
    rows = [{"question": "What is 6 * 7?", "answer": "42"}]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "raw")
    with pytest.raises(
        ConfigError, match=r"dataset '.*raw', record raw-0: `prompt` must be a non-empty list"
    ):
        read_records(DatasetSource(disk=tmp_path / "raw"))
    no_truth = [{**VERL_ROWS[0], "reward_model": {"style": "rule"}}]
    repo = dataset_repo(tmp_path / "repo", {"train": no_truth})
    with pytest.raises(ConfigError, match=r"record repo-train-0: `reward_model.ground_truth`"):
        read_records(DatasetSource(hf=str(repo), split="train"))


def test_missing_dataset_folders_and_unknown_hub_ids_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=rf"dataset '{re.escape(str(tmp_path / 'nowhere'))}'"):
        read_records(DatasetSource(disk=tmp_path / "nowhere"))
    # Offline, a Hub id not in the cache cannot be read; the error names it.
    with pytest.raises(ConfigError, match=r"dataset 'no-such-owner/no-such-set' split 'train'"):
        read_records(DatasetSource(hf="no-such-owner/no-such-set", split="train"))


def test_the_config_tells_files_from_dataset_sources(tmp_path):
    config = DataConfig.model_validate(
        {
            "train_files": ["a.parquet", {"hf": "openai/gsm8k", "name": "main", "split": "train"}],
            "eval_files": [{"disk": "saved"}],
        }
    )
    assert str(config.train_files[0]) == "a.parquet"
    assert config.train_files[1] == DatasetSource(hf="openai/gsm8k", name="main", split="train")
    assert config.eval_files[0] == DatasetSource(disk="saved")
    with pytest.raises(ValidationError, match=r"dataset 'openai/gsm8k': `split` is missing"):
        DataConfig.model_validate({"train_files": [{"hf": "openai/gsm8k"}]})
    with pytest.raises(ValidationError, match="exactly one of `hf`"):
        DataConfig.model_validate({"train_files": [{"hf": "x", "disk": "y", "split": "train"}]})
    with pytest.raises(ValidationError, match="`name` is for `hf` only"):
        DataConfig.model_validate({"eval_files": [{"disk": "y", "name": "main"}]})


def test_held_out_files_alone_go_with_the_generated_training_problems(tmp_path):
    [parquet, _] = parquet_and_jsonl(tmp_path, "held", VERL_ROWS)
    train, held_out = load_datasets(
        DataConfig(eval_files=[parquet], generated_train_size=3), seed=0
    )
    assert len(train) == 3 and train[0].prompt_id == "calculator-train-0"
    assert [r.prompt_id for r in held_out] == ["held-0", "held-1"]
