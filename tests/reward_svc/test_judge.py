"""The LLM judge: its parsers on realistic judge answers, and `LlmJudge` against a loopback
stand-in speaking the OpenAI chat-completions wire format (`n`, errors, held requests)."""

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reward_svc.scorers.base import ScoringRequest
from reward_svc.scorers.judge import (
    JudgeOptions,
    LlmJudge,
    parse_boxed,
    parse_pairwise_verdict,
    parse_score_out_of,
    parse_yes_no,
)
from tests.tool_svc.http_stand_in import serve_app
from turnrl.errors import ConfigError

RUBRIC = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference: {reference}\nResponse: {response}\n"
    "End with 'Score: X/10'."
)
PAIRWISE_RUBRIC = (
    "Which assistant answered better?\nQuestion: {question}\n"
    "[Assistant A]\n{response_a}\n[Assistant B]\n{response_b}\n"
    'Answer "[[A]]", "[[B]]" or "[[C]]" for a tie.'
)
QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in total?"
GOOD_RESPONSE = "April 48, May 24, so 48 + 24 = 72. The answer is 72."
WEAK_RESPONSE = "She sold 48 + 48 = 96 clips."
CONCURRENCY_CAP = 3
CONCURRENT_SCORES = 20
WAIT_SECONDS = 10.0


def gsm8k_request(**changes: Any) -> ScoringRequest:
    fields = {
        "data_source": "gsm8k_judge",
        "response_text": GOOD_RESPONSE,
        "messages": [
            {"role": "system", "content": "You are a careful solver."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": GOOD_RESPONSE},
        ],
        "ground_truth": "72",
        "extra_info": {"reference_response": WEAK_RESPONSE},
    }
    return ScoringRequest(**(fields | changes))


@dataclass(frozen=True)
class RecordedRequest:
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def prompt(self) -> str:
        return self.body["messages"][-1]["content"]


class ChatCompletionsStandIn:
    """`POST /v1/chat/completions` as an OpenAI-compatible server answers it.

    Each of a request's `n` choices is `answer(body)`, by default the next of `answers`. The
    first `fail_first` requests get HTTP `fail_status`. With `hold`, answered requests wait
    in `held` until the test sets their event. Every request is recorded.
    """

    def __init__(
        self,
        answers: Iterable[str] = (),
        *,
        answer: Callable[[dict[str, Any]], str] | None = None,
        fail_first: int = 0,
        fail_status: int = 500,
        hold: bool = False,
    ):
        queued = deque(answers)
        self._answer = answer or (lambda body: queued.popleft())
        self._fail_first = fail_first
        self._fail_status = fail_status
        self._hold = hold
        self.requests: list[RecordedRequest] = []
        self.held: deque[asyncio.Event] = deque()
        self.in_flight = 0
        self.max_in_flight = 0
        self._changed = asyncio.Condition()
        self.app = Starlette(
            routes=[Route("/v1/chat/completions", self._chat_completions, methods=["POST"])]
        )

    async def _chat_completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(RecordedRequest(dict(request.headers), body))
        if len(self.requests) <= self._fail_first:
            error = {"message": "server overloaded", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=self._fail_status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self._hold:
                release = asyncio.Event()
                self.held.append(release)
                await self._notify()
                await release.wait()
            texts = [self._answer(body) for _ in range(body.get("n", 1))]
        finally:
            self.in_flight -= 1
        choices = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            for i, text in enumerate(texts)
        ]
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Returns once `condition()` holds after a request was held."""
        async with asyncio.timeout(WAIT_SECONDS), self._changed:
            await self._changed.wait_for(condition)

    def release_all(self) -> None:
        while self.held:
            self.held.popleft().set()


@contextlib.asynccontextmanager
async def judging(stand_in: ChatCompletionsStandIn, **options: Any) -> AsyncIterator[LlmJudge]:
    """An LlmJudge calling `stand_in`, served on loopback for the duration."""
    async with serve_app(stand_in.app) as url:
        judge = LlmJudge(judge_options(base_url=f"{url}/v1", **options))
        try:
            yield judge
        finally:
            stand_in.release_all()
            await judge.close()


def judge_options(**changes: Any) -> JudgeOptions:
    fields = {
        "name": "gsm8k-judge",
        "data_sources": ["gsm8k_judge"],
        "base_url": "http://127.0.0.1:9/v1",
        "model": "judge-model",
        "rubric": RUBRIC,
    }
    return JudgeOptions(**(fields | changes))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The response is correct but terse.\n\nScore: 7/10", 0.7),
        ("Correctness is fine, clarity could improve.\nRating: 7 / 10", 0.7),
        ("Accuracy 4/5, clarity 3/5.\nOverall: 8/10", 0.8),
        ("At first I would give 3/10, but the final number is right.\nScore: 9/10.", 0.9),
        ("**Score:** 6 out of 10", 0.6),
        ("Score: 8.5/10", 0.85),
        ("The answer is right.\nScore: 7", 0.7),
        ("Well explained. Rating: [[5]]", 0.5),
        ("Released 2023/10/05; the final answer is wrong. Score: 2", 0.2),
        ("Score: 4/5 for accuracy", 0.8),
        ("The response is helpful and correct.", None),
        ("Score: 12/10", None),
        ("Score: 3/0", None),
    ],
)
def test_parse_score_out_of(text: str, expected: float | None):
    assert parse_score_out_of(text, max_score=10.0) == pytest.approx(expected)


def test_parse_score_out_of_divides_a_bare_score_by_max_score():
    assert parse_score_out_of("Score: 4", max_score=5.0) == pytest.approx(0.8)
    assert parse_score_out_of("Score: 6", max_score=5.0) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48 + 24 = 72 matches the reference, so the grade is \\boxed{8}.", 0.8),
        ("Step scores \\boxed{3} and \\boxed{5}; overall \\boxed{9}", 0.9),
        ("Final grade: \\boxed{ 7.5 }", 0.75),
        ("Final grade: \\boxed{7/10}", 0.7),
        ("The better answer is \\boxed{A}", None),
        ("\\boxed{11}", None),
        ("Grade: 8", None),
    ],
)
def test_parse_boxed(text: str, expected: float | None):
    assert parse_boxed(text, max_score=10.0) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The response computes 72, as the reference does.\nVerdict: YES", 1.0),
        ("The response says 96; the reference says 72.\nverdict: no", 0.0),
        ("There is no error in any step.\n\nVerdict: Yes", 1.0),
        ("Verdict: NO\nOn reflection, 24 is half of 48.\nVerdict: YES", 1.0),
        ("The final number matches.\n\n**Correct**", 1.0),
        ("Answer: Incorrect", 0.0),
        ("The answer is correct.", 1.0),
        ("The answer is not correct.", None),
        ("I see no issue with the reasoning.", None),
        ("Maybe.", None),
    ],
)
def test_parse_yes_no(text: str, expected: float | None):
    assert parse_yes_no(text, max_score=10.0) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Assistant A is right and concise. [[A]]", "A"),
        ("A is shorter, but B is right.\nFinal verdict: [[B]]", "B"),
        ("Both are equally good. [[C]]", "tie"),
        ("I lean to [[A]] at first, yet after checking the sums: [[B]]", "B"),
        ("Assistant A is better.", None),
    ],
)
def test_parse_pairwise_verdict(text: str, expected: str | None):
    assert parse_pairwise_verdict(text) == expected


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
    async with judging(stand_in, samples=2, temperature=1.0, default_score=-1.0) as judge:
        score = await judge.score(gsm8k_request())
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
    async with judging(stand_in, max_retries=1, default_score=-1.0) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == -1.0
    assert "answered HTTP 500: " in score.extras["error"]
    assert "server overloaded" in score.extras["error"]
    assert len(stand_in.requests) == 2


async def test_client_error_is_not_retried():
    stand_in = ChatCompletionsStandIn(fail_first=1, fail_status=400)
    async with judging(stand_in, max_retries=2) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == 0.0
    assert "answered HTTP 400" in score.extras["error"]
    assert len(stand_in.requests) == 1


async def test_unreachable_server_gives_default_score_naming_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on `port` now: every connection is refused.
    judge = LlmJudge(
        judge_options(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, default_score=-1.0)
    )
    try:
        score = await judge.score(gsm8k_request())
    finally:
        await judge.close()
    assert score.score == -1.0
    error = score.extras["error"]
    assert f"'http://127.0.0.1:{port}/v1/chat/completions' is unreachable (ConnectError" in error
    assert score.extras["samples"] == 0


async def test_malformed_answer_gives_default_score():
    async def not_chat_completions(request: Request) -> JSONResponse:
        return JSONResponse({"result": "Score: 9/10"})

    app = Starlette(routes=[Route("/v1/chat/completions", not_chat_completions, methods=["POST"])])
    async with serve_app(app) as url:
        judge = LlmJudge(judge_options(base_url=f"{url}/v1"))
        try:
            score = await judge.score(gsm8k_request())
        finally:
            await judge.close()
    assert score.score == 0.0
    assert "sent a malformed answer (Field required): " in score.extras["error"]
    assert '\'{"result":"Score: 9/10"}\'' in score.extras["error"]


async def test_a_judge_that_never_answers_times_out():
    stand_in = ChatCompletionsStandIn(hold=True)
    async with judging(stand_in, request_timeout_seconds=0.2, max_retries=2) as judge:
        score = await judge.score(gsm8k_request())
    assert score.score == 0.0
    assert score.extras["error"].endswith("did not answer within 0.2 s")
    # A timeout is not retried: a slow judge would only be asked again to be slow again.
    assert len(stand_in.requests) == 1


async def test_retries_stop_at_the_timeout():
    stand_in = ChatCompletionsStandIn(fail_first=10**6)
    async with judging(stand_in, request_timeout_seconds=0.5, max_retries=10**6) as judge:
        score = await judge.score(gsm8k_request())
    assert score.extras["error"].endswith("did not answer within 0.5 s")
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


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rubric": "Q: {question}\nA: {answer}"}, r"unknown placeholders \['answer'\]"),
        ({"rubric": "{response} {0}"}, r"unknown placeholders \['0'\]"),
        ({"rubric": "{response.upper}"}, r"unknown placeholders \['response.upper'\]"),
        ({"rubric": 'Reply {"score": {response}}'}, r"unknown placeholders \['\"score\"'\]"),
        ({"rubric": "Rate {response} from 1 to 10 {"}, "not a valid template"),
        ({"rubric": "Rate the answer to {question}"}, r"must contain \['response'\]"),
        ({"rubric": RUBRIC, "pairwise": True}, r"unknown placeholders \['reference', 'response'\]"),
        ({"rubric": PAIRWISE_RUBRIC}, r"unknown placeholders \['response_a', 'response_b'\]"),
        ({"rubric": PAIRWISE_RUBRIC, "pairwise": True, "parse": "boxed"}, "pointwise grading"),
        ({"swap_positions": True}, "swap_positions needs pairwise"),
        ({"samples": 4}, "samples=4 at temperature 0"),
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url"),
        ({"rubrik": RUBRIC}, "rubrik"),
    ],
)
def test_bad_options_are_rejected_at_construction(changes: dict[str, Any], message: str):
    with pytest.raises(pydantic.ValidationError, match=message):
        judge_options(**changes)


def test_unset_api_key_env_is_rejected_at_construction(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError, match="'TEST_JUDGE_KEY' is unset"):
        LlmJudge(judge_options(api_key_env="TEST_JUDGE_KEY"))
