"""What decides a tiny model (`turnrl_demo.tiny_model` builds it): the config's `tiny_model:`
section, a module of its own so that loading a config does not load torch.

Its fine-tuning is an SFT run of the trainer's (`trainer_svc.sft`), so the batches and the
optimizer are the trainer's own settings: `sft` is a `trainer.sft` section and `optim` a
`trainer.optim` section, with defaults of their own here.
"""

from typing import Any, Literal, Self

from pydantic import Field, ValidationError, field_validator, model_validator

from trainer_svc.config import SftConfig, TrainSettings
from turnrl.calculator_data import ProblemSettings
from turnrl.config import StrictModel

# The tiny model's optimizer: a high peak rate for a model trained from scratch, warm-up, then
# cosine decay to a tenth over `train_steps`; AdamW's beta2 of 0.95 steadies those large steps.
TINY_MODEL_OPTIM = {
    "learning_rate": 1e-2,
    "betas": (0.9, 0.95),
    "warmup_steps": 20,
    "lr_schedule": "cosine",
    "min_lr_ratio": 0.1,
    # A whole batch of 16 calculator conversations in one forward pass.
    "micro_batch_tokens": 16384,
}


class TinyModelSettings(StrictModel):
    """Everything that decides the built model; its hash names the cache folder."""

    task: Literal["calculator", "search", "code", "zoom"] = Field(
        default="calculator",
        description="What the model learns to do with a tool: calculator (arithmetic word "
        "problems, turnrl.calculator_data), search (questions about a generated world, answered "
        "with the search tool over its corpus, turnrl.search_world), code (large-number word "
        "problems, computed with the python tool, turnrl.code_problems) or zoom (digits too "
        "small to read until the image_zoom tool enlarges them, turnrl.zoom_digits: the model "
        "is a vision-language model, a Qwen2.5-VL, turnrl_demo.tiny_vlm).",
    )
    vocab_size: int = Field(
        default=1024,
        gt=0,
        description="Upper bound of the BPE vocabulary, chat tokens included; the default "
        "corpus runs out of merges at about 670.",
    )
    hidden_size: int = Field(default=128, gt=0, description="Width of the model.")
    num_hidden_layers: int = Field(default=2, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(default=4, gt=0, description="Query heads per layer.")
    num_key_value_heads: int = Field(default=2, gt=0, description="Key/value heads per layer.")
    intermediate_size: int = Field(default=256, gt=0, description="Width of the MLPs.")
    max_position_embeddings: int = Field(
        default=2048, gt=0, description="Longest sequence the model is configured for, in tokens."
    )
    train_problems: int = Field(
        default=4000,
        gt=0,
        description="Conversations fine-tuned on (they also train the tokenizer).",
    )
    problems: ProblemSettings = Field(
        default_factory=ProblemSettings,
        description="The shape of the calculator task's problems (the other tasks have one "
        "shape each).",
    )
    guess_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of the conversations that answer at once, without the tool, with a "
        "guess (calculator: the starting count, right by chance only; search: the town's "
        "name; code: the problem's first number; both always wrong; zoom: a digit drawn at "
        "random): a warm start that uses the tool only some of the time, for RL to teach it to "
        "use the tool every time.",
    )
    calls_shown: int = Field(
        default=0,
        ge=0,
        description="calculator only: 0, each solved conversation makes every call its problem "
        "takes; n, calls_shown_share of them stop after their n-th call and answer with that "
        "call's result (wrong when the problem takes more calls): with "
        "problems.one_call_per_operation, a warm start that starts every chain right and "
        "rarely shows its rest, for RL to find.",
    )
    calls_shown_share: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="with calls_shown: the share of the solved conversations cut short after "
        "that many calls; the others make every call.",
    )
    judge_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="calculator only: share of the training problems that also give a judge's "
        "conversation (the model's second role when trainer.judge_training co-trains a judge): "
        "trainer.judge_training's default rubric filled with the problem and a transcript "
        "(the solved conversation, the guess, or one with a miscopied number: "
        "turnrl_demo.tiny_model.JUDGED_TRANSCRIPTS), answered 'Verdict: yes' or 'Verdict: no' "
        "by the task's answer.",
    )
    judge_noise: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of those verdicts flipped: a judge that starts out unsure, for RL "
        "to sharpen.",
    )
    train_steps: int = Field(
        default=2000,
        gt=0,
        description="Optimizer steps of the SFT (trainer.steps of an SFT run; `sft.epochs`, when "
        "set, decides in its place).",
    )
    sft: SftConfig = Field(
        default_factory=SftConfig,
        description="The SFT's batches, as in trainer.sft: `conversations_per_step` (16), "
        "`epochs`, `max_length` (a longer conversation fails the build).",
    )
    optim: TrainSettings = Field(
        default_factory=lambda: TrainSettings.model_validate(TINY_MODEL_OPTIM),
        description="The SFT's optimizer and LR schedule, as in trainer.optim: by default peak "
        "learning rate 1e-2 after 20 warm-up steps, cosine decay to a tenth over the run, AdamW "
        "betas (0.9, 0.95), micro-batches of 16384 tokens. Keys given here replace those "
        "defaults one by one.",
    )

    @field_validator("optim", mode="before")
    @classmethod
    def _over_the_tiny_models_optim(cls, value: Any) -> Any:
        """A partial `optim:` changes only the keys it names, not every other one back to
        trainer.optim's defaults."""
        return {**TINY_MODEL_OPTIM, **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _calculator_settings_only_for_the_calculator(self) -> Self:
        for name in ("judge_share", "calls_shown"):
            if getattr(self, name) and self.task != "calculator":
                raise ValueError(f"{name} is for the calculator task only, not {self.task!r}")
        return self

    @model_validator(mode="after")
    def _schedule_fits_the_run(self) -> Self:
        """The trainer's check of `optim` for the run's length (warm-up within a cosine
        schedule's steps), when the config loads rather than minutes into a build."""
        steps = self.sft.run_steps(self.train_steps, self.train_problems)
        try:
            self.optim.for_run(steps)
        except ValidationError as e:
            message = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"optim over the SFT's {steps} steps: {message}") from None
        return self
