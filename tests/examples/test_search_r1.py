"""examples/search_r1: the converter on the real NQ and HotpotQA fixtures, its rows through the
trainer's loader and the reward service's exact-match scorer, the search tool over a wiki-18
sample, the GPU config checked without a GPU, and the recipe run for two steps against a
stand-in SGLang server."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from rollout_svc.engines.sglang import SglangEngineOptions
from tool_svc.config import ToolConfig
from tool_svc.tools.search import SearchOptions
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

EXAMPLE = REPO_ROOT / "examples" / "search_r1"
NQ_FILE = "NQ-open.dev.jsonl"
HOTPOTQA_FILE = "hotpot_dev_v1_simplified.json"
CORPUS_FILE = "wiki18_dpr_sample_1000.jsonl"


prepare_data = load_script(EXAMPLE, "prepare_data")


def convert_fixtures(fixtures: Path, output_dir: Path) -> None:
    """The converter on the fixtures, which hold only the test sets (NQ-open dev, HotpotQA dev):
    they stand in for the training files too."""
    nq, hotpotqa = fixtures / "search" / NQ_FILE, fixtures / "search" / HOTPOTQA_FILE
    argv = ["--nq-train", str(nq), "--nq-test", str(nq)]
    argv += ["--hotpotqa-train", str(hotpotqa), "--hotpotqa-dev", str(hotpotqa)]
    assert prepare_data.main([*argv, "--output-dir", str(output_dir)]) == 0


def fixture_questions(fixtures: Path) -> list[tuple[str, str, list[str]]]:
    """(data_source, question, golds) of the fixture test sets, NQ first, as the converter
    orders them."""
    lines = (fixtures / "search" / NQ_FILE).read_text().splitlines()
    nq = [("nq", row["question"], row["answer"]) for row in map(json.loads, lines)]
    hotpot_rows = json.loads((fixtures / "search" / HOTPOTQA_FILE).read_text())
    hotpotqa = [("hotpotqa", row["question"], [row["answer"]]) for row in hotpot_rows]
    return nq + hotpotqa


@pytest.fixture(scope="module")
def config() -> ProjectConfig:
    return load_project_config(EXAMPLE / "config.yaml")


@pytest.fixture(scope="module")
def records(
    fixtures: Path, config: ProjectConfig, tmp_path_factory
) -> dict[str, list[PromptRecord]]:
    """The converter's output on the fixtures, loaded as the trainer loads it: the config's
    data section with its file names, in the converter's output folder."""
    output_dir = tmp_path_factory.mktemp("search_r1")
    convert_fixtures(fixtures, output_dir)
    return converted_records(config, output_dir)


def tool_section(config: ProjectConfig, corpus: Path, cache_dir: Path) -> dict:
    """The config's tool section with its search tool over `corpus`, indexed into
    `cache_dir`: the same tool and settings on a corpus small enough to index in a test."""
    section = config.tool.model_dump(mode="json")
    for entry in section["tools"]:
        if entry["class_name"] == "search":
            entry["config"].update(corpus_path=str(corpus), index_cache_dir=str(cache_dir))
    return section


@pytest.fixture(scope="module")
def tool_config(fixtures: Path, config: ProjectConfig, tmp_path_factory) -> ToolConfig:
    """The recipe's tool section over a corpus written from the fixture's wiki-18 sample."""
    folder = tmp_path_factory.mktemp("wiki18")
    lines = (fixtures / "search" / CORPUS_FILE).read_text().splitlines()
    passages = [{"id": p["id"], "contents": p["contents"]} for p in map(json.loads, lines)]
    corpus = folder / "wiki-18-sample.jsonl"
    corpus.write_text("".join(json.dumps(passage) + "\n" for passage in passages))
    return ToolConfig.model_validate(tool_section(config, corpus, folder / "bm25"))


def test_every_row_loads_with_its_question_and_gold_answers(fixtures, records):
    questions = fixture_questions(fixtures)
    for split, split_records in records.items():
        assert len(split_records) == len(questions) == 3610 + 7405, split
        assert len({r.prompt_id for r in split_records}) == len(questions), "prompt ids repeat"
        pairs = zip(questions, split_records, strict=True)
        for index, ((data_source, question, golds), record) in enumerate(pairs):
            asked = question.strip() if question.strip().endswith("?") else f"{question.strip()}?"
            assert record.data_source == data_source, (split, index)
            assert record.ground_truth == {"target": golds}, (split, index)
            assert [m["role"] for m in record.messages] == ["user"]
            assert record.messages[0]["content"] == prepare_data.INSTRUCTION + asked
            assert record.extra_info == {"split": split, "index": index, "question": asked}
            assert record.tools_kwargs == {}


def test_every_ground_truth_scores_one_when_right_and_zero_when_wrong(records):
    score = SCORERS["nq"].ref.load()
    assert SCORERS["nq"] is SCORERS["hotpotqa"]
    assert SCORERS["nq"].name == "search_em"

    def grade(record: PromptRecord, response: str) -> float:
        request = ScoringRequest(
            data_source=record.data_source,
            response_text=response,
            ground_truth=record.ground_truth,
            extra_info=record.extra_info,
        )
        return score(request).score

    for record in records["test"]:
        assert SCORERS[record.data_source] is SCORERS["nq"], record.data_source
        golds = record.ground_truth["target"]
        thought = "<think> The passages name it. </think>\n"
        for gold in (golds[0], golds[-1]):
            assert grade(record, f"{thought}<answer> {gold} </answer>") == 1.0, record.prompt_id
        assert grade(record, f"{thought}<answer> not {golds[0]} </answer>") == 0.0
        # An answer outside the tags the prompt asks for earns nothing.
        assert grade(record, f"{thought}The answer is {golds[0]}.") == 0.0


def test_config_is_the_sglang_nccl_ppo_recipe(config):
    assert config.rollout.engine == "sglang"
    assert config.trainer.weight_sync.backend == "nccl"
    launch = SglangEngineOptions.model_validate(config.rollout.engine_options).launch
    assert launch is not None, "the recipe starts its own SGLang server"
    models = {config.rollout.model_path, config.trainer.model_path}
    assert models == {"Qwen/Qwen2.5-3B"}, "trainer and engine must serve one model"
    assert config.trainer.algorithm.advantage_estimator == "gae"
    assert config.trainer.rollout.tools == ["search"]
    (search,) = [entry for entry in config.tool.tools if entry.class_name == "search"]
    options = SearchOptions.model_validate(search.config)
    assert options.corpus_path == Path("data/search_r1/wiki-18.jsonl")
    assert options.topk == options.max_topk == 3


async def test_the_offered_search_tool_returns_wiki18_passages(config, tool_config):
    async with tool_service(tool_config) as service:
        (schema,) = offered_tool_schemas(service, config)
        assert schema["function"]["parameters"]["properties"]["topk"]["maximum"] == 3
        query = json.dumps({"query": "Evan Morris lobbyist Genentech Roche"})
        result = await service.execute("search", query, "", None)
    assert result.error_kind is None, result.text
    lines = result.text.splitlines()
    assert len(lines) == 3, result.text
    assert lines[0].startswith("Doc 1(Title: Evan Morris) Evan Morris Evan L. Morris"), lines[0]
    assert [line[:6] for line in lines] == ["Doc 1(", "Doc 2(", "Doc 3("]


async def test_longest_prompts_fit_the_prompt_budget(fixtures, config, records, tool_config):
    """Rendered with Qwen2.5's template and the offered search tool, as the rollout service
    renders a first prompt, the longest questions of each source fit in what max_model_len
    leaves after max_response_length."""
    budget = config.rollout.max_model_len - config.rollout.max_response_length
    assert budget == 512
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    template = (fixtures / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    async with tool_service(tool_config) as service:
        tools = offered_tool_schemas(service, config)
    for data_source in ("nq", "hotpotqa"):
        of_source = [r for r in records["test"] if r.data_source == data_source]
        longest = sorted(of_source, key=lambda r: len(r.messages[0]["content"]))[-3:]
        for record in longest:
            prompt_ids = ConversationTokens(tokenizer, template, tools).prompt_ids(record.messages)
            assert len(prompt_ids) <= budget, record.prompt_id
            assert '"name": "search"' in tokenizer.decode(prompt_ids), "tool not rendered"


async def test_the_recipe_runs_two_steps_on_a_stand_in_sglang_server(
    fixtures, tool_config, tiny_model_dir, tmp_path
):
    """The recipe as written (PPO with its critic, SGLang launched by the rollout service, the
    weights broadcast to the server, BM25 search), scaled down to the tiny model on CPU: the
    launched server is the SGLang stand-in serving the model, gloo stands for NCCL, the corpus
    is the wiki-18 sample. The rollouts of step 2 come from the weights step 1 pushed into the
    server, so the trainer's logprobs match them."""
    data_dir = tmp_path / "data"
    convert_fixtures(fixtures, data_dir)
    # One held-out question of each dataset: the evaluation reports each one's accuracy.
    held_out = pq.read_table(data_dir / "test.parquet").to_pylist()
    firsts = {row["data_source"]: row for row in reversed(held_out)}
    (data_dir / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in firsts.values()))
    data = {
        "train_files": [str(data_dir / "train.parquet")],
        "eval_files": [str(data_dir / "held_out.jsonl")],
    }
    config = on_stand_in(EXAMPLE / "config.yaml", tiny_model_dir, tmp_path, data)
    config["tool"]["tools"] = tool_config.model_dump(mode="json")["tools"]
    trainer = config["trainer"]
    trainer.update(ranks=1, eval_every=2, critic={"optim": trainer["optim"]})
    records = await run_two_steps(config, tmp_path, "search_r1")
    steps = [record for record in records if "train/loss" in record]
    assert all("critic/value_mean" in record for record in steps), sorted(steps[0])
    evals = [record for record in records if "eval/accuracy" in record]
    assert [record["eval/step"] for record in evals] == [0.0, 2.0]
    for record in evals:
        assert {"eval/accuracy/nq", "eval/accuracy/hotpotqa"} <= set(record), sorted(record)
