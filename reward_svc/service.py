"""RewardService: routes each item to its scorer by `data_source` and isolates failures.

A plain async class (no gRPC). Rule scorers and plugins run in a pool of worker processes
with a per-item timeout; the code scorer and LLM judges wait on I/O and run on the event loop
under the same timeout. Whatever goes wrong with one item (its scorer raises, hangs, kills
its process; the input is too large) yields a result for that item alone, scored
`error_score`, with `extras["error"]` saying why and a `ScoringFailure` saying whose fault it
is, by the rule of turnrl/failures.py: a scorer that fails on a response is graded once more
on the ground truth alone, to tell a response that broke it (the model's) from a broken
scorer (the system's).
"""

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import numbers
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from reward_svc.config import RewardConfig
from reward_svc.metrics import RewardMetrics
from reward_svc.pool import ScorerFailedError, ScorerPool
from reward_svc.scorers import RULE_SCORERS, SCORERS
from reward_svc.scorers.base import Score, ScorerRef, ScorerUnavailableError, ScoringRequest
from reward_svc.scorers.code import CodeScorer
from reward_svc.scorers.compose import weighted_sum
from reward_svc.scorers.judge import LlmJudge
from turnrl.errors import ConfigError, InvalidArgumentError
from turnrl.failures import SYSTEM_SCORING_FAILURES, ScoringFailure

log = logging.getLogger(__name__)


class AsyncScorer(Protocol):
    """A scorer that waits on I/O: the code scorer, an LLM judge."""

    async def score(self, request: ScoringRequest) -> Score: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Route:
    """How one data source is scored: in the worker pool (`ref`) or on the loop (`scorer`)."""

    name: str
    description: str
    ref: ScorerRef | None = None
    scorer: AsyncScorer | None = None
    # A weighted sum of rule scorers: (name, weight, ref) per part.
    parts: tuple[tuple[str, float, ScorerRef], ...] = ()
    generative: bool = False


@dataclass(frozen=True)
class ScoringResult:
    """One item's verdict, or its failure (`failure` set, score = error_score, extras["error"]
    saying why)."""

    score: Score
    scorer: str
    elapsed_seconds: float
    failure: ScoringFailure | None = None

    @property
    def system_failed(self) -> bool:
        """Whether the system, not the model, failed the item: its score is no verdict."""
        return self.failure in SYSTEM_SCORING_FAILURES


class RewardService:
    """Scores items. Build with `await RewardService.create(config)`."""

    def __init__(
        self,
        config: RewardConfig,
        routes: dict[str, Route],
        pool: ScorerPool,
        metrics: RewardMetrics,
    ) -> None:
        self._config = config
        self._routes = routes
        self._pool = pool
        self._in_flight = asyncio.Semaphore(config.max_concurrency)
        self.metrics = metrics

    @classmethod
    async def create(cls, config: RewardConfig) -> "RewardService":
        """Builds the routes (built-ins, then plugins and judges, which may override them) and
        starts the worker pool. Raises ConfigError for a plugin that cannot be loaded."""
        metrics = RewardMetrics()
        routes = {
            source: Route(rule.name, rule.description, ref=rule.ref)
            for source, rule in SCORERS.items()
        }
        code = CodeScorer(config.code)
        for source in config.code.data_sources:
            routes[source] = Route("code", "test cases run in the tool sandbox", scorer=code)
        for index, plugin in enumerate(config.plugins):
            ref = ScorerRef(
                function=plugin.function,
                module=plugin.module,
                path=str(plugin.path) if plugin.path else None,
                signature=plugin.signature,
            )
            try:
                ref.load()  # fail at start-up, not on the first item
            except Exception as e:
                raise ConfigError(f"reward.plugins[{index}]: cannot load {ref}: {e}") from e
            for source in plugin.data_sources:
                description = f"user scorer ({plugin.signature} signature)"
                routes[source] = Route(f"plugin:{plugin.function}", description, ref=ref)
        for index, composite in enumerate(config.composites):
            unknown = [p.scorer for p in composite.parts if p.scorer not in RULE_SCORERS]
            if unknown:
                raise ConfigError(
                    f"reward.composites[{index}]: unknown scorers {unknown}; known: {sorted(RULE_SCORERS)}"
                )
            parts = tuple((p.scorer, p.weight, RULE_SCORERS[p.scorer].ref) for p in composite.parts)
            name = " + ".join(f"{weight:g}*{scorer}" for scorer, weight, _ in parts)
            for source in composite.data_sources:
                routes[source] = Route(name, "weighted sum of rule scorers", parts=parts)
        for judge_options in config.judges:
            name = f"judge:{judge_options.name}"
            judge = LlmJudge(judge_options, metrics.judge_no_verdict.labels(scorer=name).inc)
            for source in judge_options.data_sources:
                routes[source] = Route(name, "LLM judge", scorer=judge, generative=True)
        # Workers import every rule scorer and plugin when they start, not on a first item.
        preload = tuple(
            {rule.ref for rule in RULE_SCORERS.values()}
            | {route.ref for route in routes.values() if route.ref is not None}
        )
        return cls(config, routes, ScorerPool(config.workers, preload), metrics)

    def list_scorers(self) -> list[tuple[Route, list[str]]]:
        """Every scorer with the data sources routed to it, sorted by name."""
        by_name: dict[str, tuple[Route, list[str]]] = {}
        for source, route in sorted(self._routes.items()):
            by_name.setdefault(route.name, (route, []))[1].append(source)
        return [by_name[name] for name in sorted(by_name)]

    def check_data_source(self, data_source: str) -> None:
        """Raises InvalidArgumentError naming the known data sources for an unknown one."""
        if data_source not in self._routes:
            raise InvalidArgumentError(
                f"unknown data_source {data_source!r}; known: {sorted(self._routes)}"
            )

    async def score(self, request: ScoringRequest) -> ScoringResult:
        """Scores one item; never raises for the item's sake (see the module docstring)."""
        result = await self._score(request)
        self.metrics.items.labels(scorer=result.scorer).inc()
        self.metrics.latency.labels(scorer=result.scorer).observe(result.elapsed_seconds)
        if result.failure is not None:
            self.metrics.errors.labels(scorer=result.scorer, kind=result.failure.name).inc()
        return result

    async def _score(self, request: ScoringRequest) -> ScoringResult:
        started = time.monotonic()
        route = self._routes.get(request.data_source)
        if route is None:
            message = f"unknown data_source {request.data_source!r}; known: {sorted(self._routes)}"
            return self._failure("none", ScoringFailure.UNKNOWN_DATA_SOURCE, message, started)
        size = len(request.response_text.encode(errors="replace"))
        if size > self._config.max_response_bytes:
            message = (
                f"response is {size} bytes; at most {self._config.max_response_bytes} are scored"
            )
            return self._failure(route.name, ScoringFailure.RESPONSE_TOO_LARGE, message, started)
        async with self._in_flight:
            try:
                score = _checked(await self._run(route, request))
            except ScorerUnavailableError as e:
                return self._failure(route.name, ScoringFailure.SCORER_UNAVAILABLE, str(e), started)
            except Exception as e:
                error = _described(e)
                log.info(
                    "scorer %s failed on a %s item: %s", route.name, request.data_source, error
                )
                failure, message = await self._blame(route, request, error)
                return self._failure(route.name, failure, message, started)
        return ScoringResult(score, route.name, time.monotonic() - started)

    async def score_stream(
        self, items: AsyncIterator[tuple[str, ScoringRequest]]
    ) -> AsyncIterator[tuple[str, ScoringResult]]:
        """Scores a stream of (item_id, request); yields results as each finishes, any order.

        At most `max_concurrency` items of the stream are in flight; the next item is read
        only when one finishes, so a fast sender is slowed by gRPC flow control.
        """
        results: asyncio.Queue[tuple[str, ScoringResult] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self._config.max_concurrency)

        async def score_one(item_id: str, request: ScoringRequest) -> None:
            try:
                results.put_nowait((item_id, await self.score(request)))
            finally:
                slots.release()

        async def score_all() -> None:
            async with asyncio.TaskGroup() as group:
                async for item_id, request in items:
                    await slots.acquire()
                    group.create_task(score_one(item_id, request))

        producer = asyncio.create_task(score_all())
        producer.add_done_callback(lambda _: results.put_nowait(None))
        try:
            while (result := await results.get()) is not None:
                yield result
            try:
                producer.result()  # a broken input stream raises here
            except ExceptionGroup as group:
                # The TaskGroup wraps what the stream raised (a bad item's InvalidArgumentError,
                # which must reach the caller as itself); scoring tasks raise nothing.
                raise group.exceptions[0] from None
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def close(self) -> None:
        """Stops the workers and closes the judges' and code scorer's connections."""
        scorers = {id(r.scorer): r.scorer for r in self._routes.values() if r.scorer is not None}
        await asyncio.gather(*(scorer.close() for scorer in scorers.values()))
        await self._pool.close()

    async def _run(self, route: Route, request: ScoringRequest) -> Score:
        timeout = self._config.item_timeout_seconds
        if route.ref is not None:
            return await self._pool.score(route.ref, request, timeout)
        if route.parts:
            scores = await asyncio.gather(
                *(self._pool.score(ref, request, timeout) for _, _, ref in route.parts)
            )
            parts = [
                (name, weight, s) for (name, weight, _), s in zip(route.parts, scores, strict=True)
            ]
            return weighted_sum(parts)
        assert route.scorer is not None
        timeout = self._config.io_item_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                return await route.scorer.score(request)
        except TimeoutError:
            raise ScorerFailedError(
                f"scorer ran past its {timeout:g}s limit and was stopped"
            ) from None

    async def _blame(
        self, route: Route, request: ScoringRequest, error: str
    ) -> tuple[ScoringFailure, str]:
        """Whose fault the scorer's `error` on `request` is: it grades the ground truth alone
        in the response's place; a scorer that cannot is broken (turnrl/failures.py)."""
        try:
            _checked(await self._run(route, _ground_truth_alone(request)))
        except Exception as e:
            message = f"{error}; it failed on the ground truth alone too: {_described(e)}"
            log.warning(
                "scorer %s is broken on a %s item: %s", route.name, request.data_source, message
            )
            return ScoringFailure.SCORER_BROKEN, message
        return ScoringFailure.SCORER_FAILED_ON_RESPONSE, error

    def _failure(
        self, name: str, failure: ScoringFailure, message: str, started: float
    ) -> ScoringResult:
        score = Score(self._config.error_score, {"error": message})
        return ScoringResult(score, name, time.monotonic() - started, failure)


def _checked(score: Score) -> Score:
    """`score`, once its turn rewards are {turn index: finite number}. Raises ValueError
    naming the bad entry: the scorer failing on the item, as when it raises."""
    for turn, value in score.turn_rewards.items():
        if not isinstance(turn, numbers.Integral) or not 0 <= turn < 2**31:
            raise ValueError(f"turn_rewards key {turn!r} is not a turn index (an int >= 0)")
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"turn_rewards[{turn}] is {value!r}; expected a finite number")
    return score


def _described(error: Exception) -> str:
    """A scorer's failure in words: the pool's own message, or the exception's type and text."""
    if isinstance(error, ScorerFailedError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _ground_truth_alone(request: ScoringRequest) -> ScoringRequest:
    """`request` with the model's part taken out: the ground truth (as text) as the response,
    and the conversation up to the first model turn."""
    truth = request.ground_truth
    text = truth if isinstance(truth, str) else "" if truth is None else json.dumps(truth)
    prompt = itertools.takewhile(lambda m: m.get("role") != "assistant", request.messages)
    return dataclasses.replace(request, response_text=text, messages=list(prompt))
