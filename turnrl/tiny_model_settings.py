"""What decides the tiny calculator model (`turnrl.tiny_model` builds it): a config section of
its own module, so that loading a config does not load torch."""

from pydantic import Field

from turnrl.calculator_data import ProblemSettings
from turnrl.config import StrictModel


class TinyModelSettings(StrictModel):
    """Everything that decides the built model; its hash names the cache folder."""

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
        default_factory=ProblemSettings, description="The shape of those conversations' problems."
    )
    guess_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of the conversations that answer at once, without the tool, with the "
        "problem's starting count (wrong unless the operations cancel out): a warm start that uses the tool only some of "
        "the time, for RL to teach it to use the tool every time.",
    )
    train_steps: int = Field(default=2000, gt=0, description="Optimizer steps of the SFT.")
    batch_size: int = Field(default=16, gt=0, description="Conversations per optimizer step.")
    learning_rate: float = Field(
        default=1e-2,
        gt=0,
        description="Peak AdamW learning rate, reached after `warmup_steps`, then cosine decay "
        "to a tenth.",
    )
    warmup_steps: int = Field(default=20, ge=0, description="Steps of linear warm-up.")
