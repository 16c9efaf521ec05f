"""What every scorer receives and returns.

A rule scorer is a pure, picklable top-level function `score(request) -> Score`: the service
runs it in a process pool with a per-item timeout, so CPU-heavy checks (math-verify) never
block the event loop and a scorer that hangs or crashes costs only its own item. A scorer that
waits on I/O (an LLM judge, code run in the tool service's sandbox) is an object with an async
`score(request) -> Score` and runs on the event loop; it raises ScorerUnavailableError when
that service fails. Any other exception is the scorer failing on the item, which the service
blames on the response or on the scorer (reward_svc/service.py).
"""

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    """A verdict: the reward, and JSON-like details (extracted answer, accuracy, sub-scores)."""

    score: float
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScorerRef:
    """Where a scorer function lives: a module path, or a Python file, and the function's name."""

    function: str
    module: str | None = None
    path: str | None = None

    def load(self) -> Callable[[ScoringRequest], Score]:
        """Imports the function. Raises ImportError or AttributeError naming what is missing."""
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
        return function
