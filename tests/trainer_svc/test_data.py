"""Datasets in verl's formats (parquet and JSONL; RL prompts and multi-turn SFT conversations),
the generated calculator data, and the seeded, resumable order of training batches."""

import base64
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from google.protobuf import json_format
from pydantic import ValidationError

from tests.tiny_vlm import png_bytes
from trainer_svc.config import DataConfig, TrainerConfig
from trainer_svc.controller import Controller
from trainer_svc.data import (
    EpochSampler,
    load_conversations,
    load_datasets,
    read_conversations,
    read_records,
)
from trainer_svc.ranks import Ranks
from turnrl import code_problems, search_world
from turnrl.calculator_data import TOOLS
from turnrl.errors import ConfigError

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

GENERATORS = {
    "search": search_world.generate_questions,
    "code": code_problems.generate_problems,
}


def parquet_and_jsonl(folder: Path, stem: str, rows: list[dict]) -> tuple[Path, Path]:
    """`rows` written as <stem>.parquet and as <stem>.jsonl in `folder`."""
    parquet, jsonl = folder / f"{stem}.parquet", folder / f"{stem}.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return parquet, jsonl


def test_parquet_and_jsonl_give_the_same_records(tmp_path):
    parquet, jsonl = parquet_and_jsonl(tmp_path, "train", VERL_ROWS)
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

    prompt = first.to_proto(["calculator"])
    assert prompt.tool_names == ["calculator"]
    assert json_format.MessageToDict(prompt.ground_truth) == "42"
    assert prompt.data_source == "openai/gsm8k"


def test_tools_kwargs_as_json_text_let_parquet_hold_an_empty_struct(tmp_path):
    """pyarrow refuses `{"python": {"create_kwargs": {}}}` as a struct column; as JSON text it
    is a string column and arrives as the object."""
    kwargs = {"python": {"create_kwargs": {}}}
    row = {**VERL_ROWS[1], "extra_info": {"index": 5, "tools_kwargs": kwargs}}
    with pytest.raises(pa.ArrowNotImplementedError):
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / "struct.parquet")
    row["extra_info"]["tools_kwargs"] = json.dumps(kwargs)
    for path in parquet_and_jsonl(tmp_path, "rl", [row]):
        [record] = read_records(path)
        assert record.tools_kwargs == kwargs and record.extra_info == {"index": 5}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": [], "reward_model": {"ground_truth": "1"}}\n', "non-empty list"),
        ('{"prompt": [{"role": "user", "content": "hi"}]}\n', "reward_model.ground_truth"),
        ("{not json\n", "data file"),
        (
            '{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": '
            '"1"}, "extra_info": {"tools_kwargs": "{python"}}\n',
            "tools_kwargs` is not valid JSON",
        ),
        (
            '{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": '
            '"1"}, "extra_info": {"tools_kwargs": "[1]"}}\n',
            "object of per-tool kwargs",
        ),
    ],
)
def test_malformed_records_are_config_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_records(path)


def prompt_row(messages: list, **extra_info) -> str:
    row = {"prompt": messages, "reward_model": {"ground_truth": "1"}, "extra_info": extra_info}
    return json.dumps(row) + "\n"


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("content", "field", "bad_value"),
    [
        (
            prompt_row([USER, {"role": "developer", "content": "x"}]),
            "prompt[1].role",
            "'developer'",
        ),
        (prompt_row([{"role": "user", "content": 5}]), "prompt[0].content", "5"),
        (
            prompt_row([{"role": "user", "content": [{"type": "audio"}]}]),
            "prompt[0].content",
            "audio",
        ),
        (prompt_row(["hi"]), "prompt[0]", "'hi'"),
        (prompt_row([USER], tools_kwargs={"calculator": 5}), "tools_kwargs.calculator", "5"),
    ],
)
def test_a_malformed_prompt_row_names_its_file_row_and_field(tmp_path, content, field, bad_value):
    """Rows are checked as they load, so that none fails later, mid-run, when its Generate
    request is built (the async loop once hung on one)."""
    path = tmp_path / "bad.jsonl"
    path.write_text(prompt_row([USER]) + content)
    with pytest.raises(ConfigError) as info:
        read_records(path)
    message = str(info.value)
    assert f"data file {path}, record bad-1" in message
    assert f"`{field}`" in message and bad_value in message


def test_a_parquet_value_a_prompt_cannot_carry_names_its_field(tmp_path):
    row = {**VERL_ROWS[1], "extra_info": {"index": 3, "blob": b"\x00"}}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "binary.parquet")
    with pytest.raises(
        ConfigError, match=r"record binary-0: `extra_info\.blob` is b'\\x00', a bytes"
    ):
        read_records(tmp_path / "binary.parquet")


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


@pytest.mark.parametrize(
    ("task", "data_source"), [("search", "turnrl_search"), ("code", "turnrl_code")]
)
def test_generated_search_and_code_prompts_are_their_tasks(task, data_source):
    config = DataConfig(generated_task=task, generated_train_size=40, generated_eval_size=8)
    train, held_out = load_datasets(config, seed=0)
    assert len(train) == 40 and len(held_out) == 8
    assert [r.prompt_id for r in held_out[:2]] == [f"{task}-test-0", f"{task}-test-1"]
    assert {r.data_source for r in train + held_out} == {data_source}
    assert not {r.messages[-1]["content"] for r in train} & {
        r.messages[-1]["content"] for r in held_out
    }
    problems = GENERATORS[task](8, seed=0, split="test")
    assert [r.ground_truth for r in held_out] == [str(p.answer) for p in problems]
    assert [r.messages for r in held_out] == [p.prompt_messages for p in problems]


def test_an_sft_run_without_files_is_refused_for_a_task_but_the_calculator():
    with pytest.raises(ValidationError, match="generates the calculator's conversations only"):
        TrainerConfig.model_validate({"mode": "sft", "data": {"generated_task": "search"}})


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


# verl's multi-turn SFT rows: OpenAI messages, tool-call arguments and tool schemas as JSON text
# (as OpenAI's API gives arguments, and as parquet keeps heterogeneous structs intact).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SFT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": json.dumps([WEATHER_TOOL]),
    },
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
        "tools": None,
    },
]


def test_sft_conversations_from_parquet_and_jsonl_are_what_templates_render(tmp_path):
    parquet, jsonl = parquet_and_jsonl(tmp_path, "sft", SFT_ROWS)
    from_parquet, from_jsonl = read_conversations(parquet), read_conversations(jsonl)
    assert [(c.messages, c.tools) for c in from_parquet] == [
        (c.messages, c.tools) for c in from_jsonl
    ]
    first = from_parquet[0]
    assert first.conversation_id == "sft-0"
    assert first.tools == [WEATHER_TOOL]
    call = {"id": "a", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
    # Null fields (OpenAI's content beside tool calls, parquet's absent keys) are gone.
    assert first.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert first.messages[0] == {"role": "user", "content": "Weather in Paris?"}
    assert from_parquet[1].tools is None


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": []}, r"record bad-0: `messages` must be a non-empty list"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            r"record bad-0, message 0: expected a chat message with a role in",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": "[{"},
            r"record bad-0: `tools` is not valid JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}},
            r"record bad-0: `tools` must be a list of tool schemas",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                ]
            },
            r"record bad-0, message 1: a tool call needs `function.name`",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}],
                    },
                ]
            },
            r"record bad-0, message 1: tool call arguments must be an object, got \[1, 2\]",
        ),
    ],
)
def test_malformed_conversations_are_config_errors_naming_the_record(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=message):
        read_conversations(path)


def test_generated_conversations_are_the_solved_calculator_problems():
    config = DataConfig(generated_train_size=20, generated_eval_size=5)
    train, held_out = load_conversations(config, seed=3)
    prompts, _ = load_datasets(config, seed=3)
    assert [c.conversation_id for c in train] == [p.prompt_id for p in prompts]
    assert [c.messages[:2] for c in train] == [p.messages for p in prompts]
    assert all(c.messages[-1]["content"].startswith("#### ") for c in train + held_out)
    assert all(c.tools == TOOLS for c in train + held_out)
    assert len(held_out) == 5 and held_out[0].conversation_id == "calculator-test-0"


def test_chat_template_kwargs_go_with_every_rl_prompt(tmp_path):
    config = TrainerConfig.model_validate(
        {"data": {"chat_template_kwargs": {"enable_thinking": False}}}
    )
    controller = Controller(config, tmp_path, lambda event: None, Ranks())
    prompts, _ = load_datasets(DataConfig(generated_train_size=2), seed=0)
    request = controller._generate_request(prompts, ["a", "b"], "step1", training=True)
    assert [json_format.MessageToDict(p.chat_template_kwargs) for p in request.prompts] == [
        {"enable_thinking": False}
    ] * 2


def test_verl_multimodal_rows_put_their_images_in_place_of_the_markers(tmp_path):
    """verl's `images` column, bytes as `datasets` stores them in parquet or a path relative
    to the file, each where its `<image>` is; read and inlined at load."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "b.png").write_bytes(png_bytes(8, 6, seed=2))
    first = png_bytes(10, 10, seed=1)
    row = {
        **VERL_ROWS[1],
        "prompt": [{"role": "user", "content": "Compare <image> with<image>."}],
        "images": [{"bytes": first, "path": None}, {"bytes": None, "path": "images/b.png"}],
    }
    parquet = tmp_path / "mm.parquet"
    pq.write_table(pa.Table.from_pylist([row]), parquet)
    (record,) = read_records(parquet)
    parts = record.messages[0]["content"]
    assert [part["type"] for part in parts] == ["text", "image_url", "text", "image_url", "text"]
    assert [parts[0]["text"], parts[2]["text"], parts[4]["text"]] == ["Compare ", " with", "."]
    urls = [part["image_url"]["url"] for part in parts if part["type"] == "image_url"]
    assert urls[0] == f"data:image/png;base64,{base64.b64encode(first).decode()}"
    second = (tmp_path / "images" / "b.png").read_bytes()
    assert urls[1] == f"data:image/png;base64,{base64.b64encode(second).decode()}"
    assert record.to_proto([]).messages[0].content[1].image.url == urls[0]


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([{"bytes": None, "path": "a.png"}] * 2, "have 1 <image> markers for 2 `images`"),
        ([{"bytes": b"not a png"}], r"messages\[0\]\.content\[1\]: not a readable image"),
        (["missing.png"], r"cannot read .*missing\.png"),
        (["/etc/hostname"], "outside the folders images may be read from"),
    ],
)
def test_a_bad_image_fails_the_load_naming_its_record(tmp_path, images, message):
    row = {**VERL_ROWS[1], "prompt": [{"role": "user", "content": "See <image>"}], "images": images}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(ConfigError, match=f"data file {path}, record bad-0: .*{message}"):
        read_records(path)


def test_without_an_images_column_a_marker_is_text(tmp_path):
    row = {**VERL_ROWS[1], "prompt": [{"role": "user", "content": "Write <image> in HTML."}]}
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (record,) = read_records(path)
    assert record.messages == row["prompt"]
