"""The CPU search task's generated world: questions, their answers, the committed corpus, and
what the real search tool and the real exact-match scorer make of them."""

import json

from transformers import AutoTokenizer

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from tool_svc.tools.search import SearchTool, format_passages
from turnrl import search_world
from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import load_project_config
from turnrl_demo.tiny_model import build_tiny_model

CORPUS = REPO_ROOT / "examples" / "search" / "corpus.jsonl"


def test_the_committed_corpus_is_the_generated_world():
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    assert rows == search_world.corpus_rows()
    assert len(rows) == search_world.WORLD_TOWNS
    assert len({town.name for town in search_world.towns()}) == search_world.WORLD_TOWNS


def test_questions_are_the_same_every_time_and_splits_share_no_town():
    train = search_world.generate_questions(500, seed=0, split="train")
    assert search_world.generate_questions(500, seed=0, split="train") == train
    assert search_world.generate_questions(500, seed=1, split="train") != train
    test = search_world.generate_questions(300, seed=0, split="test")
    assert not {q.town for q in train} & {q.town for q in test}
    assert {q.fact for q in test} == {"country", "river", "founded"}
    assert len({q.question for q in train}) == 500


def test_each_answer_is_the_fact_its_towns_passage_states():
    towns = {town.name: town for town in search_world.towns()}
    for question in search_world.generate_questions(200, seed=0, split="test"):
        assert question.town in question.question
        passage = towns[question.town].passage
        assert passage.startswith(f'"{question.town}"\n')
        assert question.answer == getattr(towns[question.town], question.fact)
        assert f" {question.answer}" in passage


async def test_the_search_tool_over_the_corpus_puts_the_asked_towns_passage_first(tmp_path):
    options = {"corpus_path": str(CORPUS), "index_cache_dir": str(tmp_path)}
    [tool] = await SearchTool.from_config("search", options, None)
    try:
        for question in search_world.generate_questions(50, seed=0, split="test"):
            text = (await tool.execute(None, {"query": question.town})).text
            docs = text.splitlines()
            # Only the town's own passage has its name.
            assert len(docs) == 1, text
            assert docs[0].startswith(f"Doc 1(Title: {question.town}) ")
            assert question.answer in docs[0]
            solved = question.messages(lambda query, answer=text: answer)
            assert solved[-2]["content"] == text
    finally:
        await tool.close()


def test_reading_the_answer_is_copying_tokens_the_model_has_seen():
    """The question's town is the same tokens as the query that searches for it, and the answer
    the same tokens as in the passage, behind the question's own word for the fact (for the
    search model's tokenizer, a Qwen2-style byte-level BPE)."""
    settings = load_project_config(REPO_ROOT / "examples" / "search" / "config.yaml").tiny_model
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(settings=settings))

    def tokens(text: str) -> list[str]:
        return tokenizer.tokenize(text)

    def holds(text: str, part: str) -> bool:
        whole, piece = tokens(text), tokens(part)
        return any(whole[i : i + len(piece)] == piece for i in range(len(whole)))

    towns = {town.name: town for town in search_world.towns()}
    for question in search_world.generate_questions(60, seed=0, split="test"):
        passage = format_passages([towns[question.town].passage])
        call, _, answer = question.messages(lambda query, passage=passage: passage)[2:]
        query = json.dumps(call["tool_calls"][0]["function"]["arguments"])
        assert holds(question.question, question.town) and holds(query, question.town)
        assert holds(question.question, f" {question.fact}")
        assert holds(passage, f" {question.fact} {question.answer}") or holds(
            passage, f" {question.fact} in {question.answer}"
        )
        assert holds(answer["content"], f" {question.answer}")


def test_exact_match_credits_the_answer_and_never_the_guess():
    score = SCORERS[search_world.DATA_SOURCE].ref.load()

    def graded(question: search_world.SearchQuestion, messages: list[dict]) -> float:
        request = ScoringRequest(
            data_source=search_world.DATA_SOURCE,
            response_text=messages[-1]["content"],
            ground_truth=question.answer,
            extra_info={},
        )
        return score(request).score

    for question in search_world.generate_questions(100, seed=0, split="test"):
        assert graded(question, question.messages(lambda query: "")) == 1.0
        assert graded(question, question.guess_messages) == 0.0
        assert question.town in question.guess_messages[-1]["content"]
