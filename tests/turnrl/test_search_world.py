"""The CPU search task's generated world: questions, their answers, the committed corpus, and
what the real search tool and the real exact-match scorer make of them."""

import json
import random

from reward_svc.scorers import SCORERS
from reward_svc.scorers.base import ScoringRequest
from tool_svc.tools.search import SearchTool
from turnrl import search_world
from turnrl.config import REPO_ROOT

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
            # The twin's passage names the town too: always more than one to choose from.
            assert 2 <= len(docs) <= 3, text
            assert docs[0].startswith(f"Doc 1(Title: {question.town}) ")
            assert question.answer in docs[0]
            solved = question.messages(lambda query, answer=text: answer)
            assert solved[-2]["content"] == text
    finally:
        await tool.close()


def test_exact_match_credits_the_answer_and_not_a_guess():
    score = SCORERS[search_world.DATA_SOURCE].ref.load()
    question = search_world.generate_questions(1, seed=0, split="test")[0]

    def graded(messages: list[dict]) -> float:
        request = ScoringRequest(
            data_source=search_world.DATA_SOURCE,
            response_text=messages[-1]["content"],
            ground_truth=question.answer,
            extra_info={},
        )
        return score(request).score

    assert graded(question.messages(lambda query: "")) == 1.0
    guesses = [graded(question.guess_messages(random.Random(i))) for i in range(40)]
    assert sum(guesses) < 10  # right by chance only
