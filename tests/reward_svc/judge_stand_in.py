"""A loopback stand-in for an OpenAI-compatible chat-completions server, and the judge settings
and scoring request the LLM-judge tests share (test_judge.py, test_judge_parsers.py; the
interaction and route tests use the stand-in too)."""

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reward_svc.scorers.base import ScoringRequest
from reward_svc.scorers.judge import JudgeOptions, LlmJudge
from tests.tool_svc.http_stand_in import serve_app

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
# How long a test waits for the stand-in to hold the requests it expects.
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


class NoVerdictCount:
    """An LlmJudge's `on_no_verdict`: counts the items it found no verdict for."""

    def __init__(self) -> None:
        self.items = 0

    def __call__(self) -> None:
        self.items += 1


@contextlib.asynccontextmanager
async def judging(
    stand_in: ChatCompletionsStandIn,
    no_verdict: NoVerdictCount | None = None,
    **options: Any,
) -> AsyncIterator[LlmJudge]:
    """An LlmJudge calling `stand_in`, served on loopback for the duration, counting
    verdict-less items in `no_verdict` (a fresh count when None)."""
    async with serve_app(stand_in.app) as url:
        judge = LlmJudge(
            judge_options(base_url=f"{url}/v1", **options), no_verdict or NoVerdictCount()
        )
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
