"""examples/retool: the ReTool GPU recipe checked without a GPU.

There are no ReTool-SFT, DAPO-Math-17k or AIME 2024 fixtures, so the rows below are written
here in those datasets' schemas: ReTool-SFT's `{"messages": [user, assistant]}`, the user
message ReTool's prompt, the assistant message reasoning with `<code>` cells, `<interpreter>`
results and an `<answer>`; DAPO-Math-17k's verl rows, each problem inside DAPO's "Answer:"
instruction and repeated; AIME_2024's `{ID, Problem, Solution, Answer}`. The problems are our
own, and their cells' results are what the sandbox prints. The rest is real: the converters'
files read by the trainer's loaders, the SFT path's tokenization with the fixture Qwen2.5 and
Qwen3 tokenizers and chat templates, the reward service's math scorer, the configs loaded as
the README's commands load them, and a ToolService started from the config's tool section.
"""

import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from rollout_svc.engines.sglang import SglangEngineOptions
from tool_svc.service import ToolService
from trainer_svc.data import ConversationRecord, load_conversations, load_datasets
from trainer_svc.run_loop import FINAL_MODEL
from trainer_svc.sft import tokenize_conversations
from turnrl.chat_tokens import ConversationTokens, conversation_ids_and_loss_mask
from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import ProjectConfig, load_project_config

from ..turnrl.test_conversation_loss_mask import masked_runs
from .recipes import load_script

EXAMPLE = REPO_ROOT / "examples" / "retool"


prepare_rl_data = load_script(EXAMPLE, "prepare_rl_data")
prepare_sft_data = load_script(EXAMPLE, "prepare_sft_data")

# ReTool's prompt as ReTool-SFT's user messages hold it (its braces doubled, as there).
RETOOL_PROMPT = (
    "Solve the following problem step by step. You now have the ability to selectively write "
    "executable Python code to enhance your reasoning process. The Python code will be executed "
    "by an external sandbox, and the output (wrapped in `<interpreter>output_str</interpreter>`) "
    "can be returned to aid your reasoning and help you arrive at the final answer. The Python "
    "code should be complete scripts, including necessary imports. \nEach code snippet is "
    "wrapped with `<code>\n```python\ncode snippet\n```\n</code>`.\nThe last part of your "
    "response should be in the following format:\n<answer>\n\\boxed{{'The final answer goes "
    "here.'}}\n</answer>\n\n*user question:*\nQUESTION\n\nRemember to place the final answer in "
    "the last part using the format: \n<answer>\n\\boxed{{'The final answer goes here.'}}\n"
    "</answer>"
)
DIGITS_QUESTION = "What is the sum of the digits of $2^{100}$?"
POWER = "1267650600228229401496703205376"


def cell(code: str, result: str) -> str:
    return f"<code>\n```python\n{code}\n```\n</code>\n<interpreter>\n{result}\n</interpreter>\n\n"


def retool_sft_row(question: str, solution: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": RETOOL_PROMPT.replace("QUESTION", question)},
            {"role": "assistant", "content": solution},
        ]
    }


RETOOL_SFT_ROWS = [
    # Two cells, the second using the first one's `n`.
    retool_sft_row(
        DIGITS_QUESTION,
        "First compute the power exactly.\n\n"
        + cell("n = 2**100\nprint(n)", POWER)
        + "Now add its digits.\n"
        + cell("print(sum(int(d) for d in str(n)))", "115")
        + "The digits add up to 115.\n\n<answer>\n\\boxed{115}\n</answer>",
    ),
    # A cell with no reasoning before it.
    retool_sft_row(
        "What is the smallest positive integer that leaves a remainder of 4 when divided by 5 "
        "and a remainder of 6 when divided by 7?",
        "Search the numbers that leave 4 when divided by 5.\n"
        + cell("n = 4\nwhile n % 7 != 6:\n    n += 5\nprint(n)", "34")
        + cell("print(34 % 5, 34 % 7)", "4 6")
        + "So 34 is the smallest.\n\n<answer>\n\\boxed{34}\n</answer>",
    ),
    # No cell at all; held out.
    retool_sft_row("What is $7 \\cdot 8$?", "7 times 8 is 56.\n\n<answer>\n\\boxed{56}\n</answer>"),
]


def dapo_row(question: str, answer: str, uuid: str) -> dict:
    content = prepare_rl_data.DAPO_PREFIX + question + prepare_rl_data.DAPO_SUFFIX
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": uuid},
    }


DAPO_ROWS = [
    dapo_row(DIGITS_QUESTION, "115", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
    dapo_row("Find the integer $x$ such that $x^3 = -27$.", "-3", "6ff0b17f-7e5c-4ae9-b5e9-62d1"),
    # DAPO-Math-17k holds each problem about 100 times.
    dapo_row(DIGITS_QUESTION, "115", "b426d104-244d-4831-a2c4-cd756b61700a"),
]
AIME_ROWS = [
    {
        "ID": "2024-I-1",
        "Problem": "Find the remainder when $2^{2024}$ is divided by $1000$.",
        "Solution": "By the Chinese remainder theorem ...",
        "Answer": 216,
    },
    {
        "ID": "2024-I-2",
        "Problem": "Find the number of positive divisors of $2024$.",
        "Solution": "$2024 = 2^3 \\cdot 11 \\cdot 23$ ...",
        "Answer": 16,
    },
]


def write_parquet(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def with_files(config: ProjectConfig, folder: Path):
    """The config's data section with its file names, in `folder`."""
    data = config.trainer.data
    return data.model_copy(
        update={
            "train_files": [folder / path.name for path in data.train_files],
            "eval_files": [folder / path.name for path in data.eval_files],
        }
    )


@pytest.fixture(scope="module")
def config() -> ProjectConfig:
    return load_project_config(EXAMPLE / "config.yaml")


@pytest.fixture(scope="module")
def sft_config() -> ProjectConfig:
    return load_project_config(EXAMPLE / "sft.yaml")


@pytest.fixture(scope="module")
def sft_records(tmp_path_factory, sft_config) -> dict[bool, list[ConversationRecord]]:
    """The SFT converter's conversations, without and with --thinking, as sft.yaml loads them
    (the last row held out)."""
    source = write_parquet(RETOOL_SFT_ROWS, tmp_path_factory.mktemp("hub") / "retool.parquet")
    records = {}
    for thinking in (False, True):
        output_dir = tmp_path_factory.mktemp("sft")
        argv = [
            *("--retool-sft-file", str(source)),
            *("--held-out", "1"),
            *("--output-dir", str(output_dir)),
            *(["--thinking"] if thinking else []),
        ]
        assert prepare_sft_data.main(argv) == 0
        train, held_out = load_conversations(with_files(sft_config, output_dir), seed=0)
        assert len(train) == 2 and len(held_out) == 1
        records[thinking] = train + held_out
    return records


@pytest.fixture(scope="module")
def rl_records(tmp_path_factory, config):
    """The RL converter's prompts, as config.yaml loads them."""
    hub = tmp_path_factory.mktemp("hub")
    output_dir = tmp_path_factory.mktemp("rl")
    argv = [
        *("--dapo-file", str(write_parquet(DAPO_ROWS, hub / "dapo-math-17k.parquet"))),
        *("--aime-file", str(write_parquet(AIME_ROWS, hub / "aime_2024_problems.parquet"))),
        *("--output-dir", str(output_dir)),
    ]
    assert prepare_rl_data.main(argv) == 0
    return load_datasets(with_files(config, output_dir), seed=0)


@pytest.fixture(scope="module")
def qwen3_max_length() -> int:
    return load_project_config(EXAMPLE / "qwen3_sft.yaml").trainer.sft.max_length


@pytest.fixture(scope="module")
def qwen25(fixtures: Path):
    """Qwen2.5-Instruct's tokenizer with its own chat template, as its model folder holds it."""
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    tokenizer.chat_template = (fixtures / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="module")
def qwen3(fixtures: Path):
    """Qwen3's tokenizer with its hybrid-thinking chat template."""
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen3")
    tokenizer.chat_template = (fixtures / "chat_templates" / "qwen3.jinja").read_text()
    return tokenizer


def python_call(code: str) -> dict:
    """A tool call as the trainer's loader gives it: arguments as an object."""
    return {
        "id": "call_0",
        "type": "function",
        "function": {"name": "python", "arguments": {"code": code}},
    }


def tool_result(text: str) -> dict:
    return {"role": "tool", "content": text, "tool_call_id": "call_0", "name": "python"}


def test_sft_rows_become_python_tool_conversations(sft_records):
    conversation = sft_records[False][0]
    assert conversation.messages == [
        prepare_rl_data.user_message(DIGITS_QUESTION),
        {
            "role": "assistant",
            "content": "First compute the power exactly.",
            "tool_calls": [python_call("n = 2**100\nprint(n)")],
        },
        tool_result(POWER),
        {
            "role": "assistant",
            "content": "Now add its digits.",
            "tool_calls": [python_call("print(sum(int(d) for d in str(n)))")],
        },
        tool_result("115"),
        {"role": "assistant", "content": "The digits add up to 115.\n\n\n\\boxed{115}"},
    ]
    assert conversation.tools == prepare_sft_data.TOOLS
    without_reasoning = sft_records[False][1].messages[3]
    assert without_reasoning["content"] == ""
    assert without_reasoning["tool_calls"] == [python_call("print(34 % 5, 34 % 7)")]
    assert [m["role"] for m in sft_records[False][2].messages] == ["user", "assistant"]


def test_thinking_puts_each_turns_reasoning_in_reasoning_content(sft_records):
    assistant_turns = [m for m in sft_records[True][0].messages if m["role"] == "assistant"]
    assert [(m["reasoning_content"], m["content"]) for m in assistant_turns] == [
        ("First compute the power exactly.", ""),
        ("Now add its digits.", ""),
        ("The digits add up to 115.", "\\boxed{115}"),
    ]
    assert assistant_turns[0]["tool_calls"] == [python_call("n = 2**100\nprint(n)")]


def test_a_code_cell_without_its_result_is_refused(tmp_path, capsys):
    broken = retool_sft_row(
        "Q?", "Try.\n<code>\n```python\nprint(1)\n```\n</code>\n<answer>1</answer>"
    )
    source = write_parquet([RETOOL_SFT_ROWS[0], broken], tmp_path / "retool.parquet")
    argv = ["--retool-sft-file", str(source), "--output-dir", str(tmp_path / "out")]
    assert prepare_sft_data.main(argv) == 1
    error = capsys.readouterr().err
    assert "row 1" in error and "<interpreter>" in error and "print(1)" in error


def test_sft_loss_is_on_the_assistant_turns_only(qwen25, sft_records, sft_config):
    """The SFT path with Qwen2.5-Instruct's template: the ids are the template's render of the
    whole conversation (prefix-preserving for it), the loss on each assistant turn through its
    <|im_end|>, not on the prompt or the interpreter's results."""
    records = sft_records[False]
    examples = tokenize_conversations(qwen25, records, sft_config.trainer.sft.max_length)
    ids, loss_mask, _ = examples[0]
    whole = qwen25.apply_chat_template(
        records[0].messages, tools=records[0].tools, tokenize=True, return_dict=False
    )
    assert ids == whole
    call = '<tool_call>\n{{"name": "python", "arguments": {}}}\n</tool_call><|im_end|>'
    assert [qwen25.decode(run) for run in masked_runs(ids, loss_mask)] == [
        "First compute the power exactly.\n"
        + call.format(json.dumps({"code": "n = 2**100\nprint(n)"})),
        "Now add its digits.\n"
        + call.format(json.dumps({"code": "print(sum(int(d) for d in str(n)))"})),
        "The digits add up to 115.\n\n\n\\boxed{115}<|im_end|>",
    ]
    unmasked = qwen25.decode([t for t, m in zip(ids, loss_mask, strict=True) if not m])
    assert POWER in unmasked and "<tool_response>\n115\n</tool_response>" in unmasked
    assert DIGITS_QUESTION in unmasked


def test_rl_rows_hold_each_problem_once_with_the_retool_prompt(rl_records):
    train, held_out = rl_records
    assert [(r.data_source, r.ground_truth) for r in train] == [
        ("math_dapo", "115"),
        ("math_dapo", "-3"),
    ]
    assert [(r.data_source, r.ground_truth) for r in held_out] == [
        ("aime2024", "216"),
        ("aime2024", "16"),
    ]
    assert len({r.prompt_id for r in train + held_out}) == 4
    assert train[0].messages == [prepare_rl_data.user_message(DIGITS_QUESTION)]
    assert held_out[0].messages == [prepare_rl_data.user_message(AIME_ROWS[0]["Problem"])]
    content = train[1].messages[0]["content"]
    assert "*user question:*\nFind the integer $x$ such that $x^3 = -27$.\n\n" in content
    assert "Answer:" not in content, "DAPO's own instruction is left out"
    for record in train + held_out:
        assert record.tools_kwargs == {"python": {"create_kwargs": {}}}


def test_a_prompt_without_dapos_instruction_is_refused(tmp_path, capsys):
    other = {**DAPO_ROWS[1], "prompt": [{"role": "user", "content": "What is 2 + 2?"}]}
    argv = [
        *("--dapo-file", str(write_parquet([DAPO_ROWS[0], other], tmp_path / "dapo.parquet"))),
        *("--aime-file", str(write_parquet(AIME_ROWS, tmp_path / "aime.parquet"))),
        *("--output-dir", str(tmp_path / "out")),
    ]
    assert prepare_rl_data.main(argv) == 1
    assert "not a DAPO-Math-17k prompt: 'What is 2 + 2?'" in capsys.readouterr().err


def test_sft_and_rl_prompts_are_the_same_tokens(qwen25, sft_records, rl_records):
    """A cold-start conversation opens with the ids an RL prompt of the same problem renders to."""
    conversation, prompt = sft_records[False][0], rl_records[0][0]
    sft_ids, loss_mask = conversation_ids_and_loss_mask(
        qwen25, conversation.messages, conversation.tools
    )
    rl_ids = ConversationTokens(qwen25, None, conversation.tools).prompt_ids(prompt.messages)
    assert sft_ids[: len(rl_ids)] == rl_ids
    assert not any(loss_mask[: len(rl_ids)]) and loss_mask[len(rl_ids)]


def test_answers_score_one_and_a_wrong_answer_zero(rl_records):
    """Graded as the rollout hands a trajectory to the reward service: the last assistant
    message, which ends with the \\boxed{} answer."""
    train, held_out = rl_records
    for record in train + held_out:
        scorer = SCORERS[record.data_source]
        assert scorer.name == "math", record.data_source
        score = scorer.ref.load()
        wrong = str(int(record.ground_truth) + 1)
        for answer, expected in ((record.ground_truth, 1.0), (wrong, 0.0)):
            request = ScoringRequest(
                data_source=record.data_source,
                response_text=f"The code printed 1024 and 3, so:\n\n\\boxed{{{answer}}}",
                ground_truth=record.ground_truth,
                extra_info=record.extra_info,
            )
            assert score(request).score == expected, (record.prompt_id, answer)


def readme_configs() -> list[ProjectConfig]:
    """The config of each `turnrl run` in the README, loaded with its overrides."""
    readme = (EXAMPLE / "README.md").read_text()
    commands = re.findall(r"^turnrl run --config (.*)$", readme, re.MULTILINE)
    configs = []
    for command in commands:
        path, *overrides = shlex.split(command.partition("  #")[0])
        configs.append(load_project_config(REPO_ROOT / path, overrides))
    return configs


def test_the_readme_runs_sft_then_rl_from_its_final_model():
    """Each RL run of the README trains from the final model of an SFT run the README starts
    (every SFT run feeds one), on SGLang with NCCL weight pushes, offering the python tool, with
    the anchor's DAPO settings."""
    configs = readme_configs()
    sft_runs = [config.trainer for config in configs if config.trainer.mode == "sft"]
    rl_runs = [config for config in configs if config.trainer.mode == "rl"]
    assert len(sft_runs) == len(rl_runs) == 4
    final_models = {str(run.output_dir / run.run_name / FINAL_MODEL): run for run in sft_runs}
    assert {config.trainer.model_path for config in rl_runs} == set(final_models)
    for config in rl_runs:  # an RL run renders as the SFT run it starts from did
        sft_run = final_models[config.trainer.model_path]
        assert config.trainer.data.chat_template_kwargs == sft_run.data.chat_template_kwargs
    assert {"enable_thinking": False} in [run.data.chat_template_kwargs for run in sft_runs]
    for run in sft_runs:
        assert run.sft.epochs == 6 and run.sft.max_length == 16384
    for config in rl_runs:
        trainer, algorithm = config.trainer, config.trainer.algorithm
        assert config.rollout.model_path == trainer.model_path
        assert config.rollout.engine == "sglang" and trainer.weight_sync.backend == "nccl"
        launch = SglangEngineOptions.model_validate(config.rollout.engine_options).launch
        assert launch is not None and "--tp-size" in launch.extra_args
        assert trainer.rollout.tools == [prepare_rl_data.PYTHON_TOOL]
        assert (algorithm.clip_low, algorithm.clip_high) == (0.2, 0.28)
        assert algorithm.loss_aggregation == "token-mean" and algorithm.dynamic_sampling
        assert algorithm.kl_coef == 0.0
        assert config.rollout.max_model_len == 2048 + config.rollout.max_response_length


def test_configs_read_the_converters_files():
    def files(name: str, key: str) -> list[Path]:
        return [
            REPO_ROOT / path
            for path in getattr(load_project_config(EXAMPLE / name).trainer.data, key)
        ]

    rl_dir = prepare_rl_data.DEFAULT_OUTPUT_DIR
    for name in ("config.yaml", "qwen3.yaml"):
        assert files(name, "train_files") == [rl_dir / prepare_rl_data.TRAIN_FILE]
        assert files(name, "eval_files") == [rl_dir / prepare_rl_data.EVAL_FILE]
    for name, sft_dir in (
        ("sft.yaml", prepare_sft_data.DEFAULT_OUTPUT_DIR),
        ("qwen3_sft.yaml", prepare_sft_data.DEFAULT_THINKING_OUTPUT_DIR),
    ):
        assert files(name, "train_files") == [sft_dir / "train.parquet"]
        assert files(name, "eval_files") == [sft_dir / "held_out.parquet"]


async def test_the_tool_service_serves_the_sft_tools_and_replays_their_cells(
    config, sft_records, rl_records
):
    """The config's tool section serves the tools the trainer offers with the schemas the SFT
    data renders; a session opened with an RL row's tools_kwargs, as the rollout opens one for
    each trajectory, runs the SFT data's cells to their recorded results, the second cell using
    the first one's variable."""
    conversation = sft_records[False][0]
    service = await ToolService.create(config.tool)
    try:
        served = {info.schema["name"]: info.schema for info in service.list_tools()}
        offered = [
            {"type": "function", "function": served[name]} for name in config.trainer.rollout.tools
        ]
        assert offered == conversation.tools
        kwargs = rl_records[0][0].tools_kwargs["python"]["create_kwargs"]
        session_id, _ = await service.create_session("python", kwargs, None)
        messages = conversation.messages
        for call_turn, result in zip(messages[1:-1:2], messages[2::2], strict=True):
            (call,) = call_turn["tool_calls"]
            arguments = json.dumps(call["function"]["arguments"])
            outcome = await service.execute("python", arguments, session_id, None)
            assert outcome.text.strip() == result["content"]
    finally:
        await service.close()
