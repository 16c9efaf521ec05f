"""The `reward:` section of a turnrl config: workers, per-item limits, plugins and judges."""

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from reward_svc.scorers.code import CodeScorerOptions
from reward_svc.scorers.judge import JudgeOptions
from turnrl.config import DEFAULT_PORTS, HttpJsonServerConfig, StrictModel


class PluginEntry(StrictModel):
    """A user scorer (verl's `custom_reward_function`) in a Python file or an importable module,
    serving the listed data sources: a function `score(request) -> Score`, or a verl reward
    function run unchanged."""

    data_sources: list[str] = Field(min_length=1, description="data_source values it scores.")
    path: Path | None = Field(default=None, description="A Python file holding the function.")
    module: str | None = Field(default=None, description="An importable module holding it.")
    function: str = Field(default="compute_score", description="The function's name.")
    # Said, not guessed from parameter names: a `(*args, **kwargs)` wrapper or a renamed
    # parameter would be guessed wrong, and a stated kind lets start-up check the function
    # against it and say which kind the function looks like instead.
    signature: Literal["turnrl", "verl"] = Field(
        default="turnrl",
        description="How the function is called: 'turnrl', `score(request: ScoringRequest) "
        "-> Score`; 'verl', verl's `compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None)` returning a number or a dict with a 'score' key (its other keys "
        "become the extras).",
    )

    @model_validator(mode="after")
    def _one_location(self) -> Self:
        if (self.path is None) == (self.module is None):
            raise ValueError("set exactly one of path and module")
        return self


class CompositePart(StrictModel):
    """One built-in rule scorer inside a weighted sum."""

    scorer: str = Field(description="Rule scorer name: gsm8k, math, search_em, search_f1, format.")
    weight: float = Field(description="Its weight in the sum.")


class CompositeEntry(StrictModel):
    """A reward that is a weighted sum of rule scorers, e.g. 0.9 * gsm8k + 0.1 * format."""

    data_sources: list[str] = Field(min_length=1, description="data_source values it scores.")
    parts: list[CompositePart] = Field(min_length=1, description="The scorers and weights.")


class RewardConfig(StrictModel):
    """Settings of the reward service."""

    server: HttpJsonServerConfig = Field(
        default_factory=lambda: HttpJsonServerConfig(port=DEFAULT_PORTS["reward"]),
        description="Where and how the reward service listens.",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="Copies of this service `turnrl up`/`run` start (as local processes or Ray "
        "actors); its callers spread their calls over them (the rollout service, by calls in flight).",
    )
    workers: int = Field(
        default=2, ge=1, description="Scorer worker processes (rule scorers and plugins run there)."
    )
    item_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Time one item may spend in a rule scorer or plugin, in seconds.",
    )
    io_item_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Outer bound on one item in the code scorer or a judge, in seconds; they "
        "apply their own tighter limits (the sandbox's, the judge's request timeout).",
    )
    max_concurrency: int = Field(
        default=256, ge=1, description="Items scored at once across all calls; more wait."
    )
    error_score: float = Field(
        default=0.0,
        description="Score of an item that could not be graded (extras.error says why): what "
        "the model earns when the failure is its own (a scorer failing on its response, a "
        "response too large), so the lowest score the scorers give; a placeholder, with "
        "reward.error set, when the failure is the system's (turnrl/failures.py).",
    )
    max_response_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="Largest response_text scored, in UTF-8 bytes; a longer one earns "
        "error_score, as the model's failure.",
    )
    plugins: list[PluginEntry] = Field(default_factory=list, description="User scorers.")
    composites: list[CompositeEntry] = Field(
        default_factory=list, description="Weighted sums of rule scorers."
    )
    code: CodeScorerOptions = Field(
        default_factory=CodeScorerOptions,
        description="The code scorer: test cases run in the tool service's python sandbox.",
    )
    judges: list[JudgeOptions] = Field(
        default_factory=list, description="LLM judges (generative reward models)."
    )
