"""examples/gsm8k_tool: the converter on the real GSM8K fixture, its rows through the trainer's
loader, the reward service's gsm8k scorer and the gsm8k_answer tool, the GPU config checked
without a GPU, and the recipe run for two steps against a stand-in SGLang server."""

import json
from decimal import Decimal
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reward_svc.scorers import SCORERS, gsm8k
from reward_svc.scorers.base import ScoringRequest
from rollout_svc.engines.sglang import SglangEngineOptions
from trainer_svc.data import PromptRecord
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import ProjectConfig, load_project_config

from .recipes import (
    converted_records,
    load_script,
    offered_tool_schemas,
    on_stand_in,
    run_two_steps,
    tool_service,
)

EXAMPLE = REPO_ROOT / "examples" / "gsm8k_tool"
# (split, index in the fixture file, final answer as the fixture's solution writes it)
KNOWN_ANSWERS = [
    ("train", 0, "72"),
    ("train", 345, "1,080"),
    ("test", 0, "18"),
    ("test", 489, "-10"),
]


prepare_data = load_script(EXAMPLE, "prepare_data")


@pytest.fixture(scope="module")
def config() -> ProjectConfig:
    return load_project_config(EXAMPLE / "config.yaml")


@pytest.fixture(scope="module")
def records(
    fixtures: Path, config: ProjectConfig, tmp_path_factory
) -> dict[str, list[PromptRecord]]:
    """The converter's output on the fixture GSM8K, loaded as the trainer loads it: the config's
    data section with its file names, in the converter's output folder."""
    output_dir = tmp_path_factory.mktemp("gsm8k_tool")
    argv = ["--gsm8k-dir", str(fixtures / "gsm8k"), "--output-dir", str(output_dir)]
    assert prepare_data.main(argv) == 0
    return converted_records(config, output_dir)


def test_every_row_loads_with_the_fixture_final_answer(fixtures, records):
    for split, split_records in records.items():
        lines = (fixtures / "gsm8k" / f"{split}.jsonl").read_text().splitlines()
        problems = [json.loads(line) for line in lines]
        assert len(split_records) == len(problems), split
        assert len({r.prompt_id for r in split_records}) == len(problems), "prompt ids repeat"
        for index, (problem, record) in enumerate(zip(problems, split_records, strict=True)):
            _, reference = gsm8k.reference_answer(problem["answer"])
            assert Decimal(record.ground_truth) == reference, (split, index)
            assert [m["role"] for m in record.messages] == ["system", "user"]
            assert record.messages[1]["content"].startswith(problem["question"])
            assert record.extra_info == {"split": split, "index": index}
            assert record.tools_kwargs == {
                "gsm8k_answer": {"create_kwargs": {"ground_truth": record.ground_truth}}
            }
    for split, index, written in KNOWN_ANSWERS:
        record = records[split][index]
        assert record.ground_truth == written.replace(",", ""), (split, index)
        assert record.data_source == "openai/gsm8k"


@pytest.mark.parametrize(("split", "index", "written"), KNOWN_ANSWERS)
def test_ground_truth_scores_one_when_right_and_zero_when_wrong(records, split, index, written):
    record = records[split][index]
    scorer = SCORERS[record.data_source]
    assert scorer.name == "gsm8k"
    score = scorer.ref.load()

    def grade(final: str) -> float:
        request = ScoringRequest(
            data_source=record.data_source,
            response_text=f"Step by step, the total works out.\n#### {final}",
            ground_truth=record.ground_truth,
            extra_info=record.extra_info,
        )
        return score(request).score

    assert grade(written) == 1.0
    assert grade(str(Decimal(record.ground_truth) + 1)) == 0.0


def test_config_is_the_sglang_nccl_recipe(config):
    assert config.rollout.engine == "sglang"
    assert config.trainer.weight_sync.backend == "nccl"
    launch = SglangEngineOptions.model_validate(config.rollout.engine_options).launch
    assert launch is not None, "the recipe starts its own SGLang server"
    # The launched server serves rollout.model_path.
    models = {config.rollout.model_path, config.trainer.model_path}
    assert models == {"Qwen/Qwen2.5-3B-Instruct"}, "trainer and engine must serve one model"


async def test_rows_name_served_tools_and_open_gsm8k_answer_sessions(config, records):
    record = records["train"][0]
    offered = config.trainer.rollout.tools
    for name in offered:
        assert f"`{name}`" in record.messages[0]["content"], f"the system prompt never names {name}"
    async with tool_service(config.tool) as service:
        offered_tool_schemas(service, config)
        assert set(record.tools_kwargs) <= set(offered)
        kwargs = record.tools_kwargs["gsm8k_answer"]["create_kwargs"]
        session_id, _ = await service.create_session("gsm8k_answer", kwargs, None)
        answer = json.dumps({"answer": record.ground_truth})
        result = await service.execute("gsm8k_answer", answer, session_id, None)
        assert result.text == f"Your answer {record.ground_truth} is correct."
        assert (await service.calc_reward(session_id))[0] == 1.0


async def test_longest_prompts_fit_verls_prompt_budget(fixtures, config, records):
    """verl's run allows 1,024 prompt tokens (data.max_prompt_length); here that is what
    max_model_len leaves after max_response_length. Rendered with Qwen2.5-Instruct's template
    and the offered tools, as the rollout service renders a first prompt."""
    budget = config.rollout.max_model_len - config.rollout.max_response_length
    assert budget == 1024
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    template = (fixtures / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    every_record = records["train"] + records["test"]
    longest = sorted(every_record, key=lambda r: len(r.messages[1]["content"]))[-3:]
    async with tool_service(config.tool) as service:
        tools = offered_tool_schemas(service, config)
    for record in longest:
        prompt_ids = ConversationTokens(tokenizer, template, tools).prompt_ids(record.messages)
        assert len(prompt_ids) <= budget, record.prompt_id
        assert '"name": "gsm8k_answer"' in tokenizer.decode(prompt_ids), "tools not rendered"


async def test_the_recipe_runs_two_steps_on_a_stand_in_sglang_server(
    fixtures, tiny_model_dir, tmp_path
):
    """The recipe as written (SGLang launched by the rollout service, the weights broadcast
    to the server), scaled down to the tiny model on CPU: the launched server is the SGLang
    stand-in serving the model, gloo stands for NCCL. The rollouts of step 2 come from the
    weights step 1 pushed into the server, so the trainer's logprobs match them."""
    data_dir = tmp_path / "data"
    argv = ["--gsm8k-dir", str(fixtures / "gsm8k"), "--output-dir", str(data_dir)]
    assert prepare_data.main(argv) == 0
    data = {
        "train_files": [str(data_dir / "train.parquet")],
        "eval_files": [str(data_dir / "test.parquet")],
        "max_eval_prompts": 2,
    }
    config = on_stand_in(EXAMPLE / "config.yaml", tiny_model_dir, tmp_path, data)
    config["trainer"]["rollout"]["samples_per_prompt"] = 2
    await run_two_steps(config, tmp_path, "gsm8k_tool")
