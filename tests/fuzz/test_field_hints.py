"""The fuzz hints reach the values that matter: every temperature the engine takes
(rollout_svc/engines/hf.py `_validate`: 0 <= temperature < inf), and those it refuses."""

import math

import pytest
from hypothesis import find, settings
from hypothesis import strategies as st

from .field_hints import ENGINE_TEMPERATURES, field_hints
from .fuzzed_services import Served

SERVED = Served(addresses={}, session_ids=["session"], data_sources=["openai/gsm8k"])
SEARCH = settings(max_examples=5_000, database=None, derandomize=True)
# Temperatures by kind: the engine samples at the first five, refuses the rest.
KINDS = {
    "greedy": lambda t: t == 0,
    "subnormal": lambda t: 0 < t < 2**-126,
    "near zero": lambda t: 2**-126 <= t < 2**-6,
    "usual": lambda t: 0.5 <= t <= 1.5,
    "huge": lambda t: 1e30 < t < math.inf,
    "negative": lambda t: t < 0,
    "not a number": math.isnan,
    "infinite": math.isinf,
}
TAKEN = ["greedy", "subnormal", "near zero", "usual", "huge"]


def temperatures_sent() -> st.SearchStrategy[float]:
    hint = field_hints(SERVED, {"model.norm.weight": [8]})["turnrl.v1.SamplingParams.temperature"]
    return hint.filter(lambda t: t is not None)


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_requests_carry_every_kind_of_temperature(kind):
    find(temperatures_sent(), KINDS[kind], settings=SEARCH)


@pytest.mark.parametrize("kind", TAKEN)
def test_valid_generates_carry_every_temperature_the_engine_takes(kind):
    find(ENGINE_TEMPERATURES, KINDS[kind], settings=SEARCH)  # generate_requests' temperatures
