"""`LlmJudge` against a loopback stand-in speaking the OpenAI chat-completions wire format
(`n`, errors, held requests): the request it sends, sampling and aggregation, retries and
failures, its concurrency cap, pairwise grading. Its parsers and options are in
test_judge_parsers.py."""

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reward_svc.scorers.base import ScorerUnavailableError
from reward_svc.scorers.judge import LlmJudge
from tests.tool_svc.http_stand_in import serve_app

from .judge_stand_in import (
    GOOD_RESPONSE,
    PAIRWISE_RUBRIC,
    QUESTION,
    RUBRIC,
    WEAK_RESPONSE,
    ChatCompletionsStandIn,
    NoVerdictCount,
    gsm8k_request,
    judge_options,
    judging,
)

CONCURRENCY_CAP = 3
CONCURRENT_SCORES = 20


async def test_request_carries_rendered_rubric_and_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test-123")
    answer = "Correct sum.\nScore: 3/10 for style... no: Score: 9/10"
    stand_in = ChatCompletionsStandIn([answer])
    async with judging(
        stand_in,
        api_key_env="TEST_JUDGE_KEY",
        system_prompt="You are a strict grader.",
        max_tokens=256,
    ) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == pytest.approx(0.9)
    assert score.extras == {"samples": 1, "parsed": 1, "raw": [answer], "scores": [0.9]}
    [sent] = stand_in.requests
    assert sent.headers["authorization"] == "Bearer sk-test-123"
    assert sent.body == {
        "model": "judge-model",
        "messages": [
            {"role": "system", "content": "You are a strict grader."},
            {
                "role": "user",
                "content": RUBRIC.format(question=QUESTION, reference="72", response=GOOD_RESPONSE),
            },
        ],
        "temperature": 0.0,
        "max_tokens": 256,
        "n": 1,
    }


async def test_no_key_no_authorization_and_structured_reference_as_json():
    stand_in = ChatCompletionsStandIn(["Verdict: correct"])
    async with judging(stand_in, parse="yes_no") as judge:
        score = await judge.score(gsm8k_request(ground_truth=["72", "seventy-two"]))
    assert score.score == 1.0
    [sent] = stand_in.requests
    assert "authorization" not in sent.headers
    assert 'Reference: ["72", "seventy-two"]\n' in sent.prompt


async def test_question_from_content_parts():
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    stand_in = ChatCompletionsStandIn(["Score: 10/10"])
    async with judging(stand_in) as judge:
        score = await judge.score(gsm8k_request(messages=messages))
    assert score.score == 1.0
    assert f"Question: {QUESTION}\n" in stand_in.requests[0].prompt


async def test_mean_over_samples_drops_unparsed():
    answers = ["Score: 8/10", "Score: 6/10", "The response is fine.", "Score: 10/10"]
    stand_in = ChatCompletionsStandIn(answers)
    async with judging(stand_in, samples=4, temperature=1.0) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == pytest.approx(0.8)
    assert score.extras["samples"] == 4
    assert score.extras["parsed"] == 3
    assert score.extras["scores"] == pytest.approx([0.8, 0.6, 1.0])
    assert score.extras["raw"] == answers
    [sent] = stand_in.requests
    assert sent.body["n"] == 4
    assert sent.body["temperature"] == 1.0


@pytest.mark.parametrize(
    ("parse", "answers", "expected"),
    [
        ("score_out_of", ["Score: 7/10", "Rating: 3/10", "Score: 7/10"], 0.7),
        # 7/10 and 3/10 once each: the tie gives the mean of the two.
        ("score_out_of", ["Score: 7/10", "Score: 3/10", "no score"], 0.5),
        ("boxed", ["\\boxed{4}", "\\boxed{4}", "\\boxed{10}"], 0.4),
        ("yes_no", ["Verdict: YES", "Verdict: NO", "**Correct**"], 1.0),
    ],
)
async def test_majority_over_samples(parse: str, answers: list[str], expected: float):
    stand_in = ChatCompletionsStandIn(answers)
    async with judging(
        stand_in, parse=parse, samples=3, temperature=0.7, aggregate="majority"
    ) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == pytest.approx(expected)
    assert "error" not in score.extras


async def test_unparseable_answers_give_default_score_with_error():
    rambling = "The response adds the two months. " * 60
    stand_in = ChatCompletionsStandIn([rambling, "Looks right to me."])
    no_verdict = NoVerdictCount()
    async with judging(
        stand_in, no_verdict, samples=2, temperature=1.0, default_score=-1.0
    ) as judge:
        score = await judge.score(gsm8k_request())
    assert no_verdict.items == 1
    assert score.score == -1.0
    assert score.extras["error"] == "none of the judge's 2 answers held a verdict"
    assert score.extras["samples"] == 2
    assert score.extras["parsed"] == 0
    assert score.extras["scores"] == []
    assert score.extras["raw"] == [rambling[:500], "Looks right to me."]


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_overloaded_server_is_retried(status: int):
    stand_in = ChatCompletionsStandIn(["Score: 6/10"], fail_first=2, fail_status=status)
    async with judging(stand_in, max_retries=2) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == pytest.approx(0.6)
    assert len(stand_in.requests) == 3


async def test_retries_end_after_max_retries():
    stand_in = ChatCompletionsStandIn(fail_first=10)
    async with judging(stand_in, max_retries=1) as judge:
        with pytest.raises(ScorerUnavailableError) as failed:
            await judge.score(gsm8k_request())
    assert "answered HTTP 500: " in str(failed.value)
    assert "server overloaded" in str(failed.value)
    assert len(stand_in.requests) == 2


async def test_client_error_is_not_retried():
    stand_in = ChatCompletionsStandIn(fail_first=1, fail_status=400)
    async with judging(stand_in, max_retries=2) as judge:
        with pytest.raises(ScorerUnavailableError, match="answered HTTP 400"):
            await judge.score(gsm8k_request())
    assert len(stand_in.requests) == 1


async def test_unreachable_server_is_unavailable_naming_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on `port` now: every connection is refused.
    judge = LlmJudge(
        judge_options(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1), NoVerdictCount()
    )
    try:
        with pytest.raises(ScorerUnavailableError) as failed:
            await judge.score(gsm8k_request())
    finally:
        await judge.close()
    error = str(failed.value)
    assert f"'http://127.0.0.1:{port}/v1/chat/completions' is unreachable (ConnectError" in error


async def test_malformed_answer_is_unavailable():
    async def not_chat_completions(request: Request) -> JSONResponse:
        return JSONResponse({"result": "Score: 9/10"})

    app = Starlette(routes=[Route("/v1/chat/completions", not_chat_completions, methods=["POST"])])
    async with serve_app(app) as url:
        judge = LlmJudge(judge_options(base_url=f"{url}/v1"), NoVerdictCount())
        try:
            with pytest.raises(ScorerUnavailableError) as failed:
                await judge.score(gsm8k_request())
        finally:
            await judge.close()
    assert "sent a malformed answer (Field required): " in str(failed.value)
    assert '\'{"result":"Score: 9/10"}\'' in str(failed.value)


async def test_a_judge_that_never_answers_times_out():
    stand_in = ChatCompletionsStandIn(hold=True)
    async with judging(stand_in, request_timeout_seconds=0.2, max_retries=2) as judge:
        with pytest.raises(ScorerUnavailableError, match=r"did not answer within 0\.2 s$"):
            await judge.score(gsm8k_request())
    # A timeout is not retried: a slow judge would only be asked again to be slow again.
    assert len(stand_in.requests) == 1


async def test_retries_stop_at_the_timeout():
    stand_in = ChatCompletionsStandIn(fail_first=10**6)
    async with judging(stand_in, request_timeout_seconds=0.5, max_retries=10**6) as judge:
        with pytest.raises(ScorerUnavailableError, match=r"did not answer within 0\.5 s$"):
            await judge.score(gsm8k_request())
    assert 1 < len(stand_in.requests) < 10**6


async def test_concurrent_scores_never_exceed_max_concurrency():
    stand_in = ChatCompletionsStandIn(answer=lambda body: "Score: 7/10", hold=True)
    async with (
        judging(stand_in, max_concurrency=CONCURRENCY_CAP) as judge,
        asyncio.TaskGroup() as group,
    ):
        scores = [group.create_task(judge.score(gsm8k_request())) for _ in range(CONCURRENT_SCORES)]
        # Let requests through one at a time, each once the cap's worth of them is held.
        for released in range(CONCURRENT_SCORES):
            expected = min(CONCURRENCY_CAP, CONCURRENT_SCORES - released)
            await stand_in.wait_until(lambda expected=expected: len(stand_in.held) >= expected)
            stand_in.held.popleft().set()
    assert [score.result().score for score in scores] == [0.7] * CONCURRENT_SCORES
    assert len(stand_in.requests) == CONCURRENT_SCORES
    assert stand_in.max_in_flight == CONCURRENCY_CAP


def content_judge(body: dict[str, Any]) -> str:
    """Prefers the response that says 72, wherever it stands."""
    prompt = body["messages"][-1]["content"]
    a_part = prompt.split("[Assistant B]")[0]
    return "A gets 72. [[A]]" if "72" in a_part else "B gets 72. [[B]]"


@pytest.mark.parametrize(
    ("answer", "swap_positions", "expected"),
    [
        (content_judge, False, 1.0),
        (content_judge, True, 1.0),
        # A judge that always favours the first position: swapping cancels its bias.
        (lambda body: "[[A]]", False, 1.0),
        (lambda body: "[[A]]", True, 0.5),
        (lambda body: "[[B]]", True, 0.5),
        (lambda body: "Equally good. [[C]]", True, 0.5),
    ],
)
async def test_pairwise(answer: Callable, swap_positions: bool, expected: float):
    stand_in = ChatCompletionsStandIn(answer=answer)
    async with judging(
        stand_in, pairwise=True, swap_positions=swap_positions, rubric=PAIRWISE_RUBRIC
    ) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == pytest.approx(expected)
    prompts = {sent.prompt for sent in stand_in.requests}
    in_order = PAIRWISE_RUBRIC.format(
        question=QUESTION, response_a=GOOD_RESPONSE, response_b=WEAK_RESPONSE
    )
    swapped = PAIRWISE_RUBRIC.format(
        question=QUESTION, response_a=WEAK_RESPONSE, response_b=GOOD_RESPONSE
    )
    assert prompts == ({in_order, swapped} if swap_positions else {in_order})
    assert score.extras["samples"] == len(prompts)


async def test_pairwise_weak_response_loses():
    stand_in = ChatCompletionsStandIn(answer=content_judge)
    async with judging(
        stand_in, pairwise=True, swap_positions=True, rubric=PAIRWISE_RUBRIC
    ) as judge:
        extra_info = {"reference_response": GOOD_RESPONSE}
        score = await judge.score(gsm8k_request(response_text=WEAK_RESPONSE, extra_info=extra_info))
    assert score.score == 0.0
    assert score.extras["scores"] == [0.0, 0.0]


async def test_pairwise_needs_a_reference_response():
    stand_in = ChatCompletionsStandIn()
    async with judging(stand_in, pairwise=True, rubric=PAIRWISE_RUBRIC) as judge:
        with pytest.raises(ValueError, match=r"extra_info\['reference_response'\].*got None"):
            await judge.score(gsm8k_request(extra_info={}))
    assert stand_in.requests == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"messages": [{"role": "system", "content": "Solve."}]}, r"roles \['system'\]"),
        ({"messages": [{"role": "user", "content": None}]}, "content is None"),
        ({"ground_truth": None}, r"\{reference\} needs a ground_truth, got None"),
    ],
)
async def test_request_the_rubric_cannot_be_filled_from_is_rejected(
    changes: dict[str, Any], message: str
):
    stand_in = ChatCompletionsStandIn()
    async with judging(stand_in) as judge:
        with pytest.raises(ValueError, match=message):
            await judge.score(gsm8k_request(**changes))
    assert stand_in.requests == []
