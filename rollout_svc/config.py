"""The `rollout:` section of a turnrl config: the engine, the model, the length limits, and
where the tool and reward services are."""

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from rollout_svc.agent_runner import AgentConfig
from turnrl.config import DEFAULT_PORTS, ClientConfig, ServerConfig, StrictModel
from turnrl.images import ImageSettings


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


class GatewayConfig(StrictModel):
    """The OpenAI-compatible gateway (rollout_svc.gateway): an HTTP port of the rollout
    service's own on which agents written elsewhere call the service's engine. It serves with
    the security of the service's gRPC server (`rollout.server`): HTTPS with `server.tls`, a
    bearer token (the `openai` client's api_key) with `server.auth_token_env`."""

    enabled: bool = Field(default=False, description="Serve the gateway beside the gRPC service.")
    host: str = Field(
        default="127.0.0.1",
        description="Interface to bind, apart from the gRPC server's. 127.0.0.1 keeps the "
        "gateway private to this machine; any other address needs server.tls or "
        "server.auth_token_env (or server.allow_insecure), as the gRPC server's host does.",
    )
    port: int = Field(
        default=0, ge=0, le=65535, description="TCP port; 0 picks a free one (printed at start)."
    )
    served_model_name: str | None = Field(
        default=None,
        description="The model name requests must give and /v1/models lists; None: the last "
        "part of rollout.model_path.",
    )
    max_request_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Largest request body, in bytes; a larger one is refused with HTTP 413.",
    )
    max_sessions: int = Field(
        default=4096,
        gt=0,
        description="Sessions open at once (started, not ended), each holding its trajectory; "
        "a request that would open one more is refused with HTTP 429.",
    )
    history_rewrites: Literal["new_part", "refuse"] = Field(
        default="new_part",
        description="A request whose messages do not continue its session's history (an agent "
        "that summarised, truncated or edited it): new_part renders them as a new prompt, the "
        "session's trajectory going on in a new part that the trainer trains as a sequence of "
        "its own; refuse answers 400 naming the first message that differs.",
    )


class RolloutConfig(StrictModel):
    """Settings of the rollout service."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["rollout"]),
        description="Where and how the rollout service listens.",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="Copies of this service `turnrl up`/`run` start (as local processes or Ray "
        "actors); its callers spread their calls over them (the trainer's rollout router, by load).",
    )
    engine: Literal["hf", "sglang", "vllm"] = Field(
        default="hf",
        description="Inference engine: hf (transformers, CPU), sglang (GPU) or vllm (GPU, or "
        "CPU with vLLM's CPU build); sglang and vllm run from their own environments "
        "(`make engine-env`).",
    )
    model_path: str | None = Field(
        default=None,
        description="The policy model: a Hugging Face folder (weights, config, tokenizer); the "
        "service refuses to start without one. Null in a config file: `turnrl serve`, `up` and "
        "`run` set it to the tiny calculator model of the config's `tiny_model` section "
        "(turnrl_demo; built on first use, minutes on two cores, and cached).",
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the engine, passed through and validated by it (HfEngineOptions, "
        "SglangEngineOptions, VllmEngineOptions). The model and its context are `model_path` "
        "and `max_model_len`, which the service hands to the engine; they are not engine "
        "options.",
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
        default=2048,
        gt=0,
        description="Prompt plus response, in tokens: the engine's context. The engine refuses "
        "a prompt this long and ends a generation that reaches it.",
    )
    max_response_length: int = Field(
        default=1024, gt=0, description="All tokens after the prompt, across turns, in tokens."
    )
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens of one model turn.")
    max_turns: int = Field(default=8, gt=0, description="Model turns per trajectory.")
    max_concurrent_trajectories: int = Field(
        default=256, gt=0, description="Trajectories in flight at once; more wait their turn."
    )
    max_trajectories_per_call: int = Field(
        default=65_536,
        gt=0,
        description="Most trajectories (prompts times n) one Generate call may ask for; a "
        "larger call is refused before any starts, as each waiting one holds memory.",
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
    reward_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Deadline of scoring one trajectory, in seconds, tries again while the "
        "reward service is down included; long enough for an LLM judge.",
    )
    images: ImageSettings = Field(
        default_factory=ImageSettings,
        description="Limits on the images of prompts and tool results (a vision-language "
        "model's), and the folders file: image URLs may name.",
    )
    interactions: list[InteractionEntry] = Field(
        default_factory=list, description="Simulated users, by name."
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig,
        description="The OpenAI-compatible gateway for agents written elsewhere; off by default.",
    )
    agent: AgentConfig | None = Field(
        default=None,
        description="A user's agent that plays each sample of a Generate call through the "
        "gateway (rollout_svc/agent_episodes.py), instead of the built-in agent loop; needs "
        "gateway.enabled. None: the agent loop.",
    )

    @model_validator(mode="after")
    def _agent_needs_the_gateway(self) -> Self:
        if self.agent is not None and not self.gateway.enabled:
            raise ValueError(
                "rollout.agent is set but rollout.gateway.enabled is false: the agent reaches "
                "the policy through the gateway; set rollout.gateway.enabled=true"
            )
        return self

    @field_validator("engine_options")
    @classmethod
    def _no_rollout_settings(cls, options: dict[str, Any]) -> dict[str, Any]:
        # Each setting in one place: the service hands model_path and max_model_len to the
        # engine, so an engine option of that name would be a second copy.
        repeated = sorted(options.keys() & cls.model_fields.keys())
        if repeated:
            raise ValueError(
                f"engine_options sets {repeated!r}, which are rollout settings: set "
                f"{', '.join(f'rollout.{name}' for name in repeated)} instead"
            )
        return options
