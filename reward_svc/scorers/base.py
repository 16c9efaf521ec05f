"""What every scorer receives and returns.

A rule scorer is a pure, picklable top-level function `score(request) -> Score`: the service
runs it in a process pool with a per-item timeout, so CPU-heavy checks (math-verify) never
block the event loop and a scorer that hangs or crashes costs only its own item. A scorer that
waits on I/O (an LLM judge, code run in the tool service's sandbox) is an object with an async
`score(request) -> Score` and runs on the event loop; it raises ScorerUnavailableError when
that service fails. Any other exception is the scorer failing on the item, which the service
blames on the response or on the scorer (reward_svc/service.py). A user plugin may also be a
verl reward function, called as verl calls it (`score_with_verl_function`).
"""

import functools
import importlib
import importlib.util
import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# How a plugin of each `signature` is called.
PLUGIN_SIGNATURES = {
    "turnrl": "score(request: ScoringRequest) -> Score",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None) "
    "-> number | dict with a 'score' (and 'turn_rewards', {turn: reward}, if any)",
}


class ScorerUnavailableError(RuntimeError):
    """A service the scorer waits on (an LLM judge, the tool service) failed or could not be
    reached: the system's failure, whatever the response (turnrl/failures.py)."""


@dataclass(frozen=True)
class ScoringRequest:
    """One response to grade, as verl passes it to `compute_score`."""

    data_source: str
    # The final assistant text.
    response_text: str
    # The whole conversation, OpenAI-style dicts: {"role", "content", "tool_calls"?, ...}.
    messages: list[dict[str, Any]] = field(default_factory=list)
    # The reference: a string, a number, a list of acceptable answers, or an object (test cases).
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Score:
    """A verdict: the reward (the outcome), JSON-like details (extracted answer, accuracy,
    sub-scores) and rewards for single model turns by turn index, 0-based (the k-th assistant
    message the policy wrote; `turnrl.trajectory.Trajectory.model_turn_spans`)."""

    score: float
    extras: dict[str, Any] = field(default_factory=dict)
    turn_rewards: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ScorerRef:
    """Where a scorer function lives (a module path, or a Python file, and the function's name)
    and how it is called: "turnrl" as `score(request) -> Score`, "verl" as verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`."""

    function: str
    module: str | None = None
    path: str | None = None
    signature: Literal["turnrl", "verl"] = "turnrl"

    def load(self) -> Callable[[ScoringRequest], Score]:
        """Imports the function and returns it as `score(request) -> Score`.

        Raises ImportError or AttributeError naming what is missing, TypeError when the
        function cannot be called with `signature`'s arguments.
        """
        if self.module is not None:
            module = importlib.import_module(self.module)
        else:
            assert self.path is not None
            spec = importlib.util.spec_from_file_location(
                f"turnrl_plugin_{abs(hash(self.path))}", self.path
            )
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load scorer file {self.path!r}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        function = getattr(module, self.function)
        if not callable(function):
            raise AttributeError(
                f"{self.function!r} in {self.module or self.path!r} is not callable"
            )
        self._check_parameters(function)
        if self.signature == "verl":
            return functools.partial(score_with_verl_function, function)
        return function

    def _check_parameters(self, function: Callable[..., Any]) -> None:
        """Raises TypeError when `function` cannot take the arguments `signature` passes, so a
        plugin configured with the wrong kind fails at start-up, not on every item."""
        try:
            parameters = inspect.signature(function)
        except ValueError:  # some built-ins publish no signature; they are judged when called
            return
        try:
            if self.signature == "verl":
                parameters.bind(data_source="", solution_str="", ground_truth=None, extra_info={})
            else:
                parameters.bind(None)
        except TypeError as e:
            (other,) = set(PLUGIN_SIGNATURES) - {self.signature}
            raise TypeError(
                f"{self.function}{parameters} in {self.module or self.path!r} cannot be called "
                f"as {PLUGIN_SIGNATURES[self.signature]} ({e}); is it signature: {other}?"
            ) from None


def score_with_verl_function(compute_score: Callable[..., Any], request: ScoringRequest) -> Score:
    """Calls a verl reward function as verl's reward manager does, by keyword, and reads its
    result: a number, or a dict with a "score" and whatever else the function reports (verl
    logs those keys; here they become the extras), which may include "turn_rewards", the
    rewards of single model turns ({turn index: reward}, as `Score.turn_rewards`).

    `solution_str` is the response graded. verl decodes the whole response, which in a
    multi-turn rollout also holds the earlier turns and tool results; turnrl sends the final
    answer, which is what verl's own scorers read (they search the end of the text).
    `ground_truth` is the raw value (a string stays a string), `extra_info` the item's dict
    (empty when it has none, as verl's newer reward managers pass it).

    Raises TypeError when the result is neither a number nor a dict with a numeric "score":
    the service treats that as the function failing on the item.
    """
    result = compute_score(
        data_source=request.data_source,
        solution_str=request.response_text,
        ground_truth=request.ground_truth,
        extra_info=request.extra_info,
    )
    if isinstance(result, dict):
        if not _is_number(result.get("score")):
            raise TypeError(
                f"verl compute_score returned a dict whose 'score' is {result.get('score')!r}; "
                "expected a number"
            )
        extras = {k: v for k, v in result.items() if k not in ("score", "turn_rewards")}
        return Score(float(result["score"]), extras, dict(result.get("turn_rewards", {})))
    if not _is_number(result):
        raise TypeError(
            f"verl compute_score returned {type(result).__name__} {result!r}; "
            "expected a number or a dict with a 'score' key"
        )
    return Score(float(result))


def _is_number(value: object) -> bool:
    # numbers.Real takes bool, int, float and numpy's scalars, all of which verl accepts.
    return isinstance(value, numbers.Real)
