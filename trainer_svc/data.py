"""Training and held-out data: prompts (RL) or written conversations (SFT), from verl-format
parquet/JSONL files, `datasets` sources (the Hub, a dataset folder, a save_to_disk folder) or a
generated task's problems (calculator, search, code, zoom), and the epoch-wise order the controller
draws batches in.

A verl RL record is {"prompt": [chat messages], "data_source": str, "reward_model":
{"ground_truth": ...}, "extra_info": {"tools_kwargs": {...}, "interaction_kwargs": {...}, ...}};
`tools_kwargs` may be JSON text, for parquet, which cannot store an empty struct. A multimodal
record adds verl's "images" (bytes or paths, relative to the file's folder), each in the place
of an `<image>` in the prompt's text, or holds image_url parts in its messages.
A verl multi-turn SFT record is {"messages": [chat messages], "tools": [tool schemas]}; in
parquet, `tools` and tool-call `arguments` are best stored as JSON text, since a parquet struct
takes the union of all rows' keys.
"""

import base64
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import pyarrow.parquet as pq
from google.protobuf import json_format

from trainer_svc.config import DataConfig, DatasetSource, DataSource
from turnrl import calculator_data, code_problems, search_world, zoom_digits
from turnrl.calculator_data import TOOLS, CalculatorProblem
from turnrl.code_problems import CodeProblem
from turnrl.errors import ConfigError, InvalidArgumentError
from turnrl.images import ImageSettings, load_message_images
from turnrl.messages import ROLES_BY_NAME, dict_to_message
from turnrl.search_world import SearchQuestion
from turnrl.splits import Split
from turnrl.v1 import rollout_pb2
from turnrl.zoom_digits import ZoomProblem

# Where an image of a row's `images` column goes in its prompt's text (verl's multimodal rows).
IMAGE_MARKER = "<image>"

# The data source of each generated task's prompts, which picks the reward service's scorer.
GENERATED_DATA_SOURCES = {
    "calculator": "openai/gsm8k",
    "search": search_world.DATA_SOURCE,
    "code": code_problems.DATA_SOURCE,
    "zoom": zoom_digits.DATA_SOURCE,
}
GeneratedProblem = CalculatorProblem | SearchQuestion | CodeProblem | ZoomProblem
Record = TypeVar("Record")


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

    def to_proto(self, tool_names: list[str]) -> rollout_pb2.RolloutPrompt:
        prompt = rollout_pb2.RolloutPrompt(
            prompt_id=self.prompt_id,
            messages=[dict_to_message(m) for m in self.messages],
            tool_names=tool_names,
            data_source=self.data_source,
            interaction_name=self.interaction_name,
        )
        json_format.ParseDict(self.ground_truth, prompt.ground_truth)
        prompt.tools_kwargs.update(self.tools_kwargs)
        prompt.interaction_kwargs.update(self.interaction_kwargs)
        prompt.extra_info.update(self.extra_info)
        return prompt


@dataclass(frozen=True)
class ConversationRecord:
    """One written conversation to fine-tune on, in the form chat templates render."""

    conversation_id: str
    messages: list[dict[str, Any]]  # OpenAI chat messages; tool-call arguments as objects
    tools: list[dict[str, Any]] | None  # OpenAI tool schemas rendered with the messages


def load_datasets(config: DataConfig, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training and held-out prompts. Raises ConfigError for unreadable or malformed files."""
    return _load(config, seed, read_records, _prompt_of_problem)


def load_conversations(
    config: DataConfig, seed: int
) -> tuple[list[ConversationRecord], list[ConversationRecord]]:
    """The training and held-out conversations. Raises ConfigError for unreadable or malformed
    files, naming the record."""
    return _load(config, seed, read_conversations, _conversation_of_problem)


def read_records(source: DataSource) -> list[PromptRecord]:
    """The prompt records of one verl-format parquet or JSONL file or `datasets` source."""
    name, where, rows = _rows(source)
    # Image paths in a file's rows are relative to its folder.
    folder = source.parent if isinstance(source, Path) else Path.cwd()
    return [_record(row, name, index, where, folder) for index, row in enumerate(rows)]


def read_conversations(source: DataSource) -> list[ConversationRecord]:
    """The conversations of one file or `datasets` source in verl's multi-turn SFT format."""
    name, where, rows = _rows(source)
    folder = source.parent if isinstance(source, Path) else Path.cwd()
    return [_conversation(row, f"{name}-{index}", where, folder) for index, row in enumerate(rows)]


def _load(
    config: DataConfig,
    seed: int,
    read_file: Callable[[DataSource], list[Record]],
    of_problem: Callable[[GeneratedProblem, str, str], Record],
) -> tuple[list[Record], list[Record]]:
    """Training and held-out records from the configured files and `datasets` sources, or
    from the generated task's problems (`of_problem` makes a record of a problem, its id and
    its task): held-out ones when `eval_files` is empty and so is `train_files`."""
    task = config.generated_task

    def generated(count: int, split: Split) -> list[Record]:
        problems = _generated_problems(config, count, seed, split)
        return [of_problem(p, f"{task}-{split}-{index}", task) for index, p in enumerate(problems)]

    if config.train_files:
        train = [r for source in config.train_files for r in read_file(source)]
    else:
        train = generated(config.generated_train_size, "train")
    if config.eval_files or config.train_files:
        held_out = [r for source in config.eval_files for r in read_file(source)]
    else:
        held_out = generated(config.generated_eval_size, "test")
    if config.max_eval_prompts is not None:
        held_out = held_out[: config.max_eval_prompts]
    return train, held_out


def _generated_problems(
    config: DataConfig, count: int, seed: int, split: Split
) -> list[GeneratedProblem]:
    if config.generated_task == "search":
        return search_world.generate_questions(count, seed=seed, split=split)
    if config.generated_task == "code":
        return code_problems.generate_problems(count, seed=seed, split=split)
    if config.generated_task == "zoom":
        return zoom_digits.generate_problems(count, seed=seed, split=split)
    return calculator_data.generate_problems(
        count, seed=seed, split=split, settings=config.generated_problems
    )


def _rows(source: DataSource) -> tuple[str, str, list[dict[str, Any]]]:
    """The rows of one parquet or JSONL file or `datasets` source, with the name its records'
    ids open with and the source as error messages name it."""
    if isinstance(source, DatasetSource):
        return _dataset_rows(source)
    where = f"data file {source}"
    try:
        if source.suffix == ".parquet":
            return source.stem, where, pq.read_table(source).to_pylist()
        if source.suffix in (".jsonl", ".json"):
            lines = source.read_text().splitlines()
            return source.stem, where, [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(
        f"{where}: expected .parquet or .jsonl (a `datasets` source is an object: {{hf: ID, "
        "split: SPLIT}} or {disk: FOLDER})"
    )


def _dataset_rows(source: DatasetSource) -> tuple[str, str, list[dict[str, Any]]]:
    """The rows of a split of a Hub dataset or dataset folder (`datasets.load_dataset`, which
    downloads to the Hugging Face cache unless HF_HUB_OFFLINE=1) or of a save_to_disk folder."""
    # Imported here, not at the top: the lent GPU machine's image has no `datasets`, and its
    # tests import the trainer (scripts/gpu_wheels.sh carries only what they need).
    import datasets

    place = source.hf or str(source.disk)
    where = f"dataset {place!r}" + "".join(
        f" {key} {value!r}"
        for key, value in (("name", source.name), ("split", source.split))
        if value is not None
    )
    try:
        if source.hf is not None:
            loaded = datasets.load_dataset(source.hf, source.name, split=source.split)
        else:
            loaded = datasets.load_from_disk(str(source.disk))
    except (OSError, ValueError) as e:  # DatasetNotFoundError is an OSError
        raise ConfigError(f"{where}: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise ConfigError(
                f"{where}: the split {source.split!r} is not there; splits: {sorted(loaded)}"
            )
        loaded = loaded[source.split]
    elif source.disk is not None and source.split is not None:
        raise ConfigError(f"{where}: the folder holds one dataset, no splits; drop `split`")
    name = "-".join(filter(None, (Path(place).name, source.name, source.split)))
    return name, where, loaded.to_list()


def _record(row: dict[str, Any], name: str, index: int, source: str, folder: Path) -> PromptRecord:
    """The prompt of row `index` of a source's rows (its records' ids open with `name`;
    `source` names it in errors; image paths are relative to `folder`), checked whole here:
    a row the rollout service's request cannot carry fails the load, naming its field, never
    a step mid-run."""
    default_id = f"{name}-{index}"
    where = f"{source}, record {default_id}"
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: `prompt` must be a non-empty list of chat messages")
    extra_info = _json_object(row.get("extra_info") or {}, f"{where}: `extra_info")
    interaction = _json_object(
        extra_info.pop("interaction_kwargs", None) or {}, f"{where}: `extra_info.interaction_kwargs"
    )
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ConfigError(f"{where}: `reward_model.ground_truth` is missing")
    _check_json(reward_model["ground_truth"], f"{where}: `reward_model.ground_truth")
    given_index = extra_info.get("index")
    return PromptRecord(
        prompt_id=f"{name}-{index if given_index is None else given_index}",
        messages=_with_images(
            [_prompt_message(m, f"{where}: `prompt[{i}]") for i, m in enumerate(messages)],
            row.get("images"),
            where,
            folder,
        ),
        data_source=str(row.get("data_source", "")),
        ground_truth=reward_model["ground_truth"],
        tools_kwargs=_kwargs(extra_info.pop("tools_kwargs", None), f"{where}: `tools_kwargs"),
        interaction_name=str(interaction.get("name", "")),
        interaction_kwargs=_drop_nulls(interaction),
        extra_info=_drop_nulls(extra_info),
    )


def _prompt_message(message: Any, where: str) -> dict[str, Any]:
    """A prompt's chat message as the rollout service takes it: a known role, and text or a
    list of text and image_url parts (`where` opens the field's name, closed here)."""
    if not isinstance(message, dict):
        raise ConfigError(f"{where}` must be a chat message (an object), got {message!r}")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES_BY_NAME:
        raise ConfigError(f"{where}.role` is {role!r}; known: {sorted(ROLES_BY_NAME)}")
    if not isinstance(content, str) and not (
        isinstance(content, list) and all(map(_is_content_part, content))
    ):
        raise ConfigError(
            f"{where}.content` must be text or a list of text and image_url parts, got {content!r}"
        )
    return {"role": role, "content": content}


def _with_images(
    messages: list[dict[str, Any]], images: Any, where: str, folder: Path
) -> list[dict[str, Any]]:
    """`messages` with their images read and inlined: verl's `images` column (each image a
    `{"bytes", "path"}` object, as `datasets` stores one, a path, or a data URL) in the places
    of the `<image>` markers of the messages' text, in order, and any image_url part's file.
    Each image is decoded here (turnrl.images), so a missing or corrupt one fails the load."""
    images = list(images or [])
    markers = sum(
        m["content"].count(IMAGE_MARKER) for m in messages if isinstance(m["content"], str)
    )
    # Without an `images` column, `<image>` is text (a text row may spell it).
    if images and markers != len(images):
        raise ConfigError(
            f"{where}: the messages have {markers} {IMAGE_MARKER} markers for {len(images)} "
            "`images`"
        )
    urls = iter(
        [_image_url(image, folder, f"{where}: `images[{i}]") for i, image in enumerate(images)]
    )
    with_parts = [_marked_images(message, urls) for message in messages] if images else messages
    settings = ImageSettings(file_dirs=[str(folder)])
    try:
        inlined, _ = load_message_images(with_parts, settings, f"{where}: messages")
    except InvalidArgumentError as e:
        raise ConfigError(str(e)) from None
    return inlined


def _image_url(image: Any, folder: Path, where: str) -> str:
    """The URL of one entry of the `images` column: a data URL of its bytes, or the file URL
    of its path (relative to `folder`); `where` opens the entry's name, closed here."""
    if isinstance(image, dict) and image.get("bytes"):
        if not isinstance(image["bytes"], bytes):
            raise ConfigError(f"{where}.bytes` must be bytes (parquet); in JSON, give a path")
        return f"data:;base64,{base64.b64encode(image['bytes']).decode()}"
    path = image.get("path") if isinstance(image, dict) else image
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}` must be an image's bytes or path, got {image!r:.80}")
    return path if path.startswith("data:") else (folder / path).resolve().as_uri()


def _marked_images(message: dict[str, Any], urls: Iterator[str]) -> dict[str, Any]:
    """`message` with each `<image>` marker of its text as an image_url part of the next URL."""
    content = message["content"]
    if not isinstance(content, str) or IMAGE_MARKER not in content:
        return message
    parts: list[dict[str, Any]] = []
    for index, text in enumerate(content.split(IMAGE_MARKER)):
        if index:
            parts.append({"type": "image_url", "image_url": {"url": next(urls)}})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def _is_content_part(part: Any) -> bool:
    """An OpenAI content part turnrl.messages.dict_to_message converts: text or an image URL."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    image = part.get("image_url")
    return part.get("type") == "image_url" and isinstance(image, dict) and "url" in image


def _conversation(
    row: dict[str, Any], record_id: str, source: str, folder: Path
) -> ConversationRecord:
    """A conversation of verl's multi-turn SFT format, its images (an `images` column and
    `<image>` markers, or image_url parts of its user and tool messages) read and inlined."""
    where = f"{source}, record {record_id}"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: `messages` must be a non-empty list of chat messages")
    tools = _from_json_text(row.get("tools"), f"{where}: `tools`")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)
    ):
        raise ConfigError(f"{where}: `tools` must be a list of tool schemas, got {tools!r}")
    return ConversationRecord(
        conversation_id=record_id,
        messages=_with_images(
            [
                _chat_message(message, f"{where}, message {index}")
                for index, message in enumerate(messages)
            ],
            row.get("images"),
            where,
            folder,
        ),
        tools=_drop_nulls(tools) or None,
    )


def _chat_message(message: Any, where: str) -> dict[str, Any]:
    """An OpenAI chat message as chat templates take it: no null fields, tool-call arguments
    as an object (OpenAI's API gives them as JSON text; templates write them with `tojson`)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES_BY_NAME:
        raise ConfigError(
            f"{where}: expected a chat message with a role in {sorted(ROLES_BY_NAME)}, "
            f"got {message!r}"
        )
    message = _drop_nulls(message)
    message.setdefault("content", "")  # OpenAI leaves it null beside tool calls
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConfigError(f"{where}: a tool call needs `function.name`, got {call!r}")
        arguments = _from_json_text(function.get("arguments", {}), f"{where}: tool call arguments")
        if not isinstance(arguments, dict):
            raise ConfigError(f"{where}: tool call arguments must be an object, got {arguments!r}")
        function["arguments"] = arguments
    return message


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """`value`, checked to be an object of JSON values (`what` opens the field's name)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what}` must be an object, got {value!r}")
    _check_json(value, what)
    return dict(value)


def _check_json(value: Any, what: str) -> None:
    """Raises ConfigError naming the first part of `value` that is not a JSON value (parquet
    can hold bytes, dates, ...), which a prompt's Struct fields cannot carry."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{what}` has the key {key!r}; keys must be text")
            _check_json(item, f"{what}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{what}[{index}]")
    elif value is not None and not isinstance(value, str | int | float | bool):
        raise ConfigError(
            f"{what}` is {value!r}, a {type(value).__name__}; a prompt carries JSON values only"
        )


def _kwargs(value: Any, what: str) -> dict[str, Any]:
    """Per-tool kwargs, an object of one object per tool name, or its JSON text (parquet
    cannot store an empty struct such as `{"python": {"create_kwargs": {}}}`). `what` opens the
    field's name, closed here."""
    kwargs = _from_json_text(value, f"{what}`") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{what}` must be an object of per-tool kwargs, got {kwargs!r}")
    kwargs = _drop_nulls(kwargs)
    _check_json(kwargs, what)
    for tool, tool_kwargs in kwargs.items():
        if not isinstance(tool_kwargs, dict):
            raise ConfigError(
                f"{what}.{tool}` must be an object (the kwargs of tool {tool!r}), got "
                f"{tool_kwargs!r}"
            )
    return kwargs


def _from_json_text(value: Any, what: str) -> Any:
    """`value` decoded when it is JSON text, else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None


def _drop_nulls(value: Any) -> Any:
    """Parquet gives every struct the union of all rows' keys, absent ones as None."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(item) for item in value]
    return value


def _prompt_of_problem(problem: GeneratedProblem, record_id: str, task: str) -> PromptRecord:
    return PromptRecord(
        prompt_id=record_id,
        messages=problem.prompt_messages,
        data_source=GENERATED_DATA_SOURCES[task],
        ground_truth=str(problem.answer),
        # The image tool's session opens on the prompt's image.
        tools_kwargs=problem.tools_kwargs if isinstance(problem, ZoomProblem) else {},
    )


def _conversation_of_problem(
    problem: GeneratedProblem, record_id: str, task: str
) -> ConversationRecord:
    if not isinstance(problem, CalculatorProblem):
        # TrainerConfig refuses such a config when it loads; this is its guard in code.
        raise ConfigError(f"generated SFT conversations are the calculator's only, not {task}'s")
    return ConversationRecord(conversation_id=record_id, messages=problem.messages, tools=TOOLS)


class EpochSampler(Generic[Record]):
    """Batches of training records (prompts or conversations), epoch after epoch, in a seeded
    order per epoch.

    `position` (records drawn so far) is all a checkpoint needs to continue the same sequence.
    """

    def __init__(self, records: list[Record], seed: int, shuffle: bool) -> None:
        if not records:
            raise ConfigError("the training set is empty")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self.position = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def next_batch(self, size: int) -> list[Record]:
        return [self.record_at(position) for position in self.next_positions(size)]

    def next_positions(self, size: int) -> list[int]:
        """The positions of the next `size` records, drawn: a position names one draw of one
        record (its epoch and place in that epoch's order), so it identifies a prompt of the
        run in the prompt ledger and in a checkpoint's prompts in flight."""
        positions = list(range(self.position, self.position + size))
        self.position += size
        return positions

    def record_at(self, position: int) -> Record:
        epoch, index = divmod(position, len(self._records))
        if self._epoch_order[0] != epoch:
            order = list(range(len(self._records)))
            if self._shuffle:
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._records[self._epoch_order[1][index]]
