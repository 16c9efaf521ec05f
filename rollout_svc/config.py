"""The `rollout:` section of a turnrl config: the engine, the model, the length limits, and
where the tool and reward services are."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from turnrl.config import DEFAULT_PORTS, ClientConfig, ServerConfig, StrictModel


class InteractionEntry(StrictModel):
    """A simulated user that answers when the model replies without a tool call."""

    name: str = Field(description="The name prompts refer to (RolloutPrompt.interaction_name).")
    class_name: str = Field(
        description="A built-in (a key of rollout_svc.interactions.INTERACTIONS: gsm8k, "
        "llm_user) or an import path 'package.module:ClassName'."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="Options of the interaction, validated by it."
    )


class RolloutConfig(StrictModel):
    """Settings of the rollout service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["rollout"]),
        description="Where and how the rollout service listens.",
    )
    engine: Literal["hf", "sglang"] = Field(
        default="hf", description="Inference engine: hf (transformers, CPU) or sglang (GPU)."
    )
    model_path: str | None = Field(
        default=None,
        description="The policy model: a Hugging Face folder (weights, config, tokenizer). None: "
        "the tiny calculator model of the config's `tiny_model` section, which `turnrl serve`, "
        "`up` and `run` build on first use (minutes on two cores) and cache.",
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the engine, passed through and validated by it (HfEngineOptions, "
        "SglangEngineOptions); the hf engine's model_path defaults to `model_path`.",
    )
    tokenizer_path: str | None = Field(
        default=None, description="Tokenizer folder; None: the model's own folder."
    )
    chat_template_path: Path | None = Field(
        default=None, description="A Jinja chat template replacing the tokenizer's own."
    )
    tool_parser: str = Field(
        default="hermes",
        description="How tool calls are read from model text (hermes, llama3_json).",
    )
    max_model_len: int = Field(
        default=2048, gt=0, description="Prompt plus response, in tokens: the engine's context."
    )
    max_response_length: int = Field(
        default=1024, gt=0, description="All tokens after the prompt, across turns, in tokens."
    )
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens of one model turn.")
    max_turns: int = Field(default=8, gt=0, description="Model turns per trajectory.")
    max_concurrent_trajectories: int = Field(
        default=256, gt=0, description="Trajectories in flight at once; more wait their turn."
    )
    tool_service: ClientConfig = Field(
        default_factory=lambda: ClientConfig(address=f"127.0.0.1:{DEFAULT_PORTS['tool']}"),
        description="The tool service the agent loop calls.",
    )
    reward_service: ClientConfig = Field(
        default_factory=lambda: ClientConfig(address=f"127.0.0.1:{DEFAULT_PORTS['reward']}"),
        description="The reward service that scores finished trajectories.",
    )
    tool_call_timeout_seconds: float = Field(
        default=60.0, gt=0, description="Deadline of one tool call, in seconds."
    )
    interactions: list[InteractionEntry] = Field(
        default_factory=list, description="Simulated users, by name."
    )
