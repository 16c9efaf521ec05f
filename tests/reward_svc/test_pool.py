"""The scorer pool: worker processes, per-item timeouts, and a hung or dying scorer costing
only its own item."""

import asyncio
import re
from pathlib import Path

import pytest

from reward_svc.pool import ScorerFailedError, ScorerPool
from reward_svc.scorers.base import ScorerRef, ScoringRequest

PLUGINS = str(Path(__file__).parent / "plugins" / "probe_scorers.py")


def ref(function: str) -> ScorerRef:
    return ScorerRef(function=function, path=PLUGINS)


def request(text: str = "42", truth: str = "42") -> ScoringRequest:
    return ScoringRequest(data_source="probe", response_text=text, ground_truth=truth)


@pytest.fixture
async def pool():
    pool = ScorerPool(workers=2, preload=(ref("compute_score"),))
    yield pool
    await pool.close()


async def test_scores_in_a_worker(pool):
    score = await pool.score(ref("compute_score"), request(), timeout_seconds=30)
    assert score.score == 1.0 and score.extras == {"length": 2}
    score = await pool.score(ref("compute_score"), request("41"), timeout_seconds=30)
    assert score.score == 0.0


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("raises", "ValueError: cannot grade '42'"),
        ("kills_its_process", "scorer process died (exit code 3)"),
        ("returns_a_float", "returned float, not Score"),
        ("no_such_function", "AttributeError"),
    ],
)
async def test_failures_name_their_cause(pool, function, message):
    with pytest.raises(ScorerFailedError, match=re.escape(message)):
        await pool.score(ref(function), request(), timeout_seconds=30)
    # The pool still works afterwards.
    assert (await pool.score(ref("compute_score"), request(), timeout_seconds=30)).score == 1.0


async def test_a_hung_scorer_costs_only_its_own_item(pool):
    hung = asyncio.ensure_future(pool.score(ref("sleeps_forever"), request(), timeout_seconds=0.5))
    others = [
        pool.score(ref("compute_score"), request(str(i)), timeout_seconds=30) for i in range(20)
    ]
    scores = await asyncio.gather(*others)
    assert [s.extras["length"] for s in scores] == [len(str(i)) for i in range(20)]
    with pytest.raises(ScorerFailedError, match=re.escape("past its 0.5s limit")):
        await hung
    # The hung worker was replaced: both workers serve again.
    again = await asyncio.gather(
        *(pool.score(ref("compute_score"), request(), timeout_seconds=30) for _ in range(4))
    )
    assert all(s.score == 1.0 for s in again)


async def test_large_requests_pass_through_the_pipe(pool):
    big = "x" * (10 * 1024 * 1024)
    score = await pool.score(ref("compute_score"), request(big, big), timeout_seconds=30)
    assert score.score == 1.0 and score.extras["length"] == len(big)
