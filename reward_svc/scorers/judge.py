"""`LlmJudge`: a generative reward model, an LLM that grades a response through a rubric.

The judge is any OpenAI-compatible server (`base_url`, over HTTP) or a turnrl rollout service
(`rollout`, over gRPC: the judge model runs on turnrl's own engines); the transports are in
reward_svc/scorers/judge_transport.py, and both bring the same thing, the judge's k answers to
one prompt. The rubric is a prompt template; the judge's texts are parsed into scores in [0, 1]:
- `score_out_of`: the last `Score: 7/10`, `Rating: 7 / 10`, `7 out of 10` or bare `7/10`,
  divided by its denominator; a labelled score without one (`Score: 7`, MT-Bench's
  `Rating: [[7]]`) is divided by `max_score`.
- `boxed`: the last `\\boxed{x}`, x a number (divided by `max_score`) or a fraction `a/b`.
- `yes_no`: the last verdict, labelled (`Verdict: YES`, `Answer: incorrect`) or alone on its
  line (`**No**`): yes/correct is 1.0, no/incorrect 0.0.
A score outside its range (`12/10`) counts as unparsed.

Pairwise mode compares the response with `extra_info["reference_response"]` and reads
MT-Bench's verdicts `[[A]]`, `[[B]]`, `[[C]]` (tie): a win is 1.0, a tie 0.5, a loss 0.0. With
`swap_positions` it also asks with the two swapped; both orders' samples are pooled, which
cancels a judge's preference for one position.

`samples` k > 1 is one request with `n=k` (Generate's `n` on the rollout service): served from
one prompt prefill, and one semaphore slot instead of k. Parse failures are dropped from the
aggregate and counted in the extras. Samples none of which parse yield `default_score` with
extras["error"], and are counted (`on_no_verdict`, the reward service's
turnrl_reward_judge_no_verdict): the judge read the response and found no verdict in it. A
failed call (unreachable, timeout, an error status, a malformed answer, a judge trajectory that
ended in ERROR or ABORTED) raises ScorerUnavailableError: the judge, not the response, failed,
so the item is the system's failure (turnrl/failures.py), never a score. A request the rubric cannot be filled from (no user message, no reference) raises
ValueError.
"""

import asyncio
import json
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from reward_svc.scorers.base import Score, ScorerUnavailableError, ScoringRequest
from reward_svc.scorers.judge_transport import (
    ChatCompletionsTransport,
    JudgeTransport,
    RolloutServiceTransport,
)
from turnrl.config import ClientConfig, StrictModel, rubric_placeholders
from turnrl.v1 import common_pb2

POINTWISE_PLACEHOLDERS = frozenset({"question", "response", "reference"})
PAIRWISE_PLACEHOLDERS = frozenset({"question", "response_a", "response_b"})
MAX_RAW_CHARS = 500

_NUMBER = r"\d+(?:\.\d+)?"
# `7/10`, `7 / 10`, `7 out of 10`, not part of a date or path (`2023/10/05`); or a labelled
# score with no denominator (`Score: 7`, `Rating: [[7]]`), which `max_score` divides.
_SCORE_OUT_OF = re.compile(
    rf"(?<![\w./])(?P<value>{_NUMBER})\s*(?:/|out of)\s*(?P<out_of>{_NUMBER})(?![\d/]|\.\d)"
    rf"|\b(?:score|rating)\b(?:\s+is)?[\s*:=\[]*(?P<bare>{_NUMBER})(?!\d|\.\d|\s*(?:/|out of))",
    re.IGNORECASE,
)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_BOXED_CONTENT = re.compile(rf"(?P<value>{_NUMBER})(?:\s*/\s*(?P<out_of>{_NUMBER}))?")
# A verdict after a label, or alone on its line with markdown or punctuation around it.
_YES_NO = re.compile(
    r"\b(?:verdict|judgement|judgment|decision|grade|answer)\b(?:\s+is)?[\s*:=\[]*"
    r"(?P<labelled>yes|no|correct|incorrect)\b"
    r"|^[\s*_\[\]#>.:-]*(?P<alone>yes|no|correct|incorrect)[\s*_\[\].!:]*$",
    re.IGNORECASE | re.MULTILINE,
)
_VERDICT_SCORES = {"yes": 1.0, "correct": 1.0, "no": 0.0, "incorrect": 0.0}
_PAIRWISE_VERDICT = re.compile(r"\[\[(A|B|C|tie)\]\]", re.IGNORECASE)


class JudgeOptions(StrictModel):
    """Which items an LLM judge grades, the server it calls, the rubric and how answers parse."""

    name: str = Field(min_length=1, description="Name of this judge in logs and config.")
    data_sources: list[str] = Field(
        min_length=1, description="The `data_source` values of the items this judge grades."
    )
    base_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="Base URL of an OpenAI-compatible server, e.g. 'http://127.0.0.1:8000/v1'; "
        "calls POST {base_url}/chat/completions. Exactly one of base_url and rollout.",
    )
    rollout: ClientConfig | None = Field(
        default=None,
        description="A turnrl rollout service serving the judge model (address, or several "
        "replicas' comma-separated; TLS and auth token as for any client), called with "
        "RolloutService.Generate. Exactly one of base_url and rollout.",
    )
    model: str | None = Field(
        default=None,
        description="base_url only, and required there: the model name sent in each request. "
        "(A rollout service serves one model.)",
    )
    api_key_env: str | None = Field(
        default=None,
        description="base_url only: name of an environment variable holding the API key, sent "
        "as 'Authorization: Bearer <key>'. None: no key. (A rollout service's token is "
        "rollout.auth_token_env.)",
    )
    request_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Limit of one judge call, retries included, in seconds; waiting for a "
        "concurrency slot is not counted.",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="base_url only: retries of a call after a connection error or an HTTP 429 "
        "or 5xx answer, with exponential back-off, within request_timeout_seconds. (A rollout "
        "service's call is tried up to rollout.max_attempts times on UNAVAILABLE.)",
    )
    max_concurrency: int = Field(
        default=8, ge=1, description="Calls to the server in flight at once, over all items."
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Sampling temperature.")
    max_tokens: int = Field(default=512, ge=1, description="Longest judge answer, in tokens.")
    rubric: str = Field(
        description="Prompt template, sent as the user message. Pointwise: placeholders "
        "{question} (first user message), {response} (required) and {reference} (the ground "
        "truth as text); pairwise: {question}, {response_a} and {response_b} (both required). "
        "Literal braces are doubled: {{ }}."
    )
    system_prompt: str | None = Field(
        default=None, description="System message sent before the rubric; None: none."
    )
    parse: Literal["score_out_of", "boxed", "yes_no"] = Field(
        default="score_out_of",
        description="How a pointwise answer becomes a score in [0, 1]: the last 'Score: 7/10' "
        "('score_out_of'), the last \\boxed{x} ('boxed') or the last yes/no verdict ('yes_no').",
    )
    max_score: float = Field(
        default=10.0,
        gt=0,
        description="Top of the judge's scale when its score has no denominator ('Score: 7', "
        "\\boxed{7}); a score is divided by it.",
    )
    samples: int = Field(
        default=1, ge=1, description="Judge answers per prompt (k), requested as n=k."
    )
    aggregate: Literal["mean", "majority"] = Field(
        default="mean",
        description="How parsed samples become one score: their mean, or their most common "
        "value ('majority'; a tie gives the mean of the tied values).",
    )
    default_score: float = Field(
        default=0.0,
        description="Score when no sample holds a verdict; extras['error'] says why. (A call "
        "that fails is the system's failure, not a score.)",
    )
    pairwise: bool = Field(
        default=False,
        description="Compare the response with extra_info['reference_response'] instead of "
        "grading it alone; verdicts [[A]], [[B]], [[C]] (tie) score 1.0, 0.0, 0.5.",
    )
    swap_positions: bool = Field(
        default=False,
        description="Pairwise only: ask a second time with the responses swapped and pool both "
        "orders' samples, to cancel position bias. Doubles the calls.",
    )

    @model_validator(mode="after")
    def _one_server(self) -> Self:
        if (self.base_url is None) == (self.rollout is None):
            given = "both" if self.base_url is not None else "neither"
            raise ValueError(
                f"judge {self.name!r} sets {given} of base_url and rollout; set exactly one: "
                "base_url for an OpenAI-compatible server, rollout: {address: host:port} for "
                "a turnrl rollout service"
            )
        if self.base_url is not None and self.model is None:
            raise ValueError(f"judge {self.name!r}: base_url needs model, the name to request")
        http_only = [key for key in ("api_key_env", "model") if getattr(self, key) is not None]
        http_only += ["max_retries"] if "max_retries" in self.model_fields_set else []
        if self.rollout is not None and http_only:
            raise ValueError(
                f"judge {self.name!r}: {http_only} apply to base_url, not to a rollout service "
                "(it serves one model; its token is rollout.auth_token_env, its tries "
                "rollout.max_attempts)"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        allowed, required = (
            (PAIRWISE_PLACEHOLDERS, {"response_a", "response_b"})
            if self.pairwise
            else (POINTWISE_PLACEHOLDERS, {"response"})
        )
        mode = "pairwise" if self.pairwise else "pointwise"
        placeholders = rubric_placeholders(self.rubric)
        if unknown := placeholders - allowed:
            raise ValueError(
                f"rubric has unknown placeholders {sorted(unknown)!r}; a {mode} rubric may use "
                f"{sorted(allowed)!r} (double literal braces: {{{{ }}}})"
            )
        if missing := required - placeholders:
            raise ValueError(f"a {mode} rubric must contain {sorted(missing)!r}")
        if self.pairwise and {"parse", "max_score"} & self.model_fields_set:
            raise ValueError(
                "parse and max_score apply to pointwise grading; pairwise verdicts are "
                "[[A]], [[B]], [[C]]"
            )
        if self.swap_positions and not self.pairwise:
            raise ValueError("swap_positions needs pairwise: true")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"samples={self.samples} at temperature 0 asks for {self.samples} copies of one "
                "greedy answer; set temperature > 0, or samples to 1"
            )
        return self


def parse_score_out_of(text: str, max_score: float) -> float | None:
    """The last `7/10`-style score in `text`, in [0, 1]; None when none is there or in range."""
    matches = list(_SCORE_OUT_OF.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    if last["bare"] is not None:
        return _normalised(float(last["bare"]), max_score)
    return _normalised(float(last["value"]), float(last["out_of"]))


def parse_boxed(text: str, max_score: float) -> float | None:
    """The last `\\boxed{x}` in `text` over `max_score` (or its own `a/b`), in [0, 1]."""
    boxes = _BOXED.findall(text)
    if not boxes or not (content := _BOXED_CONTENT.fullmatch(boxes[-1].strip())):
        return None
    if content["out_of"] is not None:
        return _normalised(float(content["value"]), float(content["out_of"]))
    return _normalised(float(content["value"]), max_score)


def parse_yes_no(text: str, max_score: float) -> float | None:
    """1.0 or 0.0 from the last yes/no (correct/incorrect) verdict in `text`; `max_score` unused."""
    matches = list(_YES_NO.finditer(text))
    if not matches:
        return None
    verdict = matches[-1]["labelled"] or matches[-1]["alone"]
    return _VERDICT_SCORES[verdict.lower()]


def parse_pairwise_verdict(text: str) -> Literal["A", "B", "tie"] | None:
    """The last MT-Bench verdict in `text`: [[A]], [[B]], or [[C]] (or [[tie]]) for a tie."""
    matches = _PAIRWISE_VERDICT.findall(text)
    if not matches:
        return None
    verdict = matches[-1].upper()
    return "tie" if verdict in ("C", "TIE") else verdict


def _normalised(value: float, out_of: float) -> float | None:
    return value / out_of if out_of > 0 and value <= out_of else None


def _pairwise_score(text: str, *, response_is_a: bool) -> float | None:
    verdict = parse_pairwise_verdict(text)
    if verdict is None:
        return None
    if verdict == "tie":
        return 0.5
    return 1.0 if (verdict == "A") == response_is_a else 0.0


def _majority(scores: Sequence[float]) -> float:
    counts = Counter(scores)
    top = max(counts.values())
    return statistics.fmean(value for value, count in counts.items() if count == top)


PARSERS: dict[str, Callable[[str, float], float | None]] = {
    "score_out_of": parse_score_out_of,
    "boxed": parse_boxed,
    "yes_no": parse_yes_no,
}
AGGREGATES: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": statistics.fmean,
    "majority": _majority,
}


class LlmJudge:
    """Grades responses with an LLM through a rubric; `score` may be called concurrently.

    Build it inside the event loop that calls `score` (a rollout judge opens gRPC channels).
    `on_no_verdict` is called for each item none of whose answers held a verdict.
    """

    def __init__(self, options: JudgeOptions, on_no_verdict: Callable[[], None]):
        self.options = options
        self._placeholders = rubric_placeholders(options.rubric)
        # Shared by every call of this judge, so concurrent items queue here, not at the server.
        self._slots = asyncio.Semaphore(options.max_concurrency)
        self._on_no_verdict = on_no_verdict
        self._transport = open_transport(options)

    async def score(self, request: ScoringRequest) -> Score:
        """The judge's score of `request.response_text`, with its samples in the extras.

        Raises ValueError when the rubric needs something `request` lacks,
        ScorerUnavailableError when a call fails; unparseable answers give `default_score` and
        extras["error"].
        """
        prompts = self._prompts(request)
        try:
            async with asyncio.TaskGroup() as group:
                calls = [group.create_task(self._complete(prompt)) for prompt, _ in prompts]
        except* ScorerUnavailableError as failures:
            raise failures.exceptions[0] from None
        texts, scores = [], []
        for call, (_, parse) in zip(calls, prompts, strict=True):
            for text in call.result():
                texts.append(text)
                if (sample_score := parse(text)) is not None:
                    scores.append(sample_score)
        if not scores:
            return self._no_verdict(
                f"none of the judge's {len(texts)} answers held a verdict", texts
            )
        return Score(AGGREGATES[self.options.aggregate](scores), _extras(texts, scores))

    def _prompts(self, request: ScoringRequest) -> list[tuple[str, Callable[[str], float | None]]]:
        """Each prompt to send, with the parser turning one of its answers into a score."""
        values = {}
        if "question" in self._placeholders:
            values["question"] = _first_user_text(request.messages)
        if not self.options.pairwise:
            if "reference" in self._placeholders:
                values["reference"] = _reference_text(request.ground_truth)
            prompt = self.options.rubric.format(response=request.response_text, **values)
            parse = partial(PARSERS[self.options.parse], max_score=self.options.max_score)
            return [(prompt, parse)]
        other = request.extra_info.get("reference_response")
        if not isinstance(other, str):
            raise ValueError(
                f"pairwise judging needs extra_info['reference_response'] as a string, got {other!r}"
            )
        orders = [(request.response_text, other, True)]
        if self.options.swap_positions:
            orders.append((other, request.response_text, False))
        return [
            (
                self.options.rubric.format(response_a=a, response_b=b, **values),
                partial(_pairwise_score, response_is_a=response_is_a),
            )
            for a, b, response_is_a in orders
        ]

    async def _complete(self, prompt: str) -> list[str]:
        """The judge's `samples` answers to `prompt`; ScorerUnavailableError when the call
        fails."""
        messages = [{"role": "user", "content": prompt}]
        if self.options.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.options.system_prompt})
        async with self._slots:
            return await self._transport.complete(messages)

    def _no_verdict(self, error: str, texts: list[str]) -> Score:
        self._on_no_verdict()
        return Score(self.options.default_score, {"error": error, **_extras(texts, [])})

    async def close(self) -> None:
        """Closes the connections to the judge's server."""
        await self._transport.close()


def open_transport(options: JudgeOptions) -> JudgeTransport:
    """The transport to the server `options` names: its rollout service, else its base_url."""
    if options.rollout is not None:
        return RolloutServiceTransport(
            options.name,
            options.rollout,
            samples=options.samples,
            sampling=common_pb2.SamplingParams(temperature=options.temperature),
            max_new_tokens=options.max_tokens,
            timeout_seconds=options.request_timeout_seconds,
        )
    assert options.base_url is not None and options.model is not None  # JudgeOptions checks
    body = {
        "model": options.model,
        "temperature": options.temperature,
        "max_tokens": options.max_tokens,
        "n": options.samples,
    }
    return ChatCompletionsTransport(
        options.name,
        options.base_url,
        body,
        api_key_env=options.api_key_env,
        timeout_seconds=options.request_timeout_seconds,
        max_retries=options.max_retries,
        max_connections=options.max_concurrency,
    )


def _extras(texts: list[str], scores: list[float]) -> dict[str, Any]:
    return {
        "samples": len(texts),
        "parsed": len(scores),
        "raw": [text[:MAX_RAW_CHARS] for text in texts],
        "scores": scores,
    }


def _first_user_text(messages: list[dict[str, Any]]) -> str:
    """The text of the first user message: a string, or the text parts of a content list."""
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(part, dict) for part in content):
            return "".join(part["text"] for part in content if part.get("type") == "text")
        raise ValueError(
            f"the first user message's content is {content!r}; expected a string or a list "
            "of {'type': 'text', 'text': ...} parts"
        )
    roles = [message.get("role") for message in messages]
    raise ValueError(
        f"the rubric's {{question}} needs a user message; messages have roles {roles!r}"
    )


def _reference_text(ground_truth: Any) -> str:
    """The ground truth as the judge reads it: a string as it is, anything else as JSON."""
    if ground_truth is None:
        raise ValueError("the rubric's {reference} needs a ground_truth, got None")
    if isinstance(ground_truth, str):
        return ground_truth
    try:
        return json.dumps(ground_truth, ensure_ascii=False)
    except TypeError:
        raise ValueError(
            f"ground_truth {ground_truth!r} cannot be rendered as text; expected a string, "
            "number, list or object of JSON values"
        ) from None
