"""The settings every engine that runs in a server of its own (SGLang, vLLM) has: which server
(one it connects to or one it launches), the deadlines of its calls, retries and connections.
Each engine's options model adds its own fields to these."""

from typing import Self

from pydantic import Field, model_validator

from rollout_svc.engines.server_process import LaunchOptions
from turnrl.config import StrictModel


class ServerLoraOptions(StrictModel):
    """`engine_options.lora`: the server loads LoRA adapters at run time, so the trainer can
    push adapters alone (`trainer.lora.push: adapter`). A launched server is started with LoRA
    enabled (`lora_server_flags`); a server given by `url` must have been started so."""

    max_rank: int = Field(
        default=64,
        gt=0,
        description="Largest adapter rank the server takes (--max-lora-rank; vLLM's is "
        "rounded up to a rank it offers).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Every module an adapter may target, by the last part of its name "
        "(SGLang's --lora-target-modules; vLLM takes any).",
    )


class ServerEngineOptions(StrictModel):
    """Settings of an engine served by a server of its own (the rollout config's
    `engine_options`). The model is the rollout config's `model_path`, the context
    `max_model_len`."""

    url: str | None = Field(
        default=None, description="Base URL of a running server, e.g. http://127.0.0.1:30000."
    )
    launch: LaunchOptions | None = Field(
        default=None,
        description="Start a server of the rollout config's `model_path` instead of "
        "connecting to `url`.",
    )
    startup_timeout_seconds: float = Field(
        default=900.0,
        gt=0,
        description="Seconds to wait for the server to answer its health check at start.",
    )
    request_timeout_seconds: float = Field(
        default=900.0, gt=0, description="Deadline of one generate request, in seconds."
    )
    control_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of abort, pause, resume, health and model-info calls, in seconds.",
    )
    weight_sync_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Deadline of joining the weight group and of receiving one bucket.",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of an idempotent call that failed to connect or got HTTP 5xx/429.",
    )
    lora: ServerLoraOptions | None = Field(
        default=None,
        description="Load LoRA adapters pushed by the trainer; null: the server takes whole "
        "weights only.",
    )
    max_concurrent_requests: int = Field(
        default=1024, gt=0, description="HTTP connections to the server, so requests at once."
    )

    @model_validator(mode="after")
    def _one_server(self) -> Self:
        if (self.url is None) == (self.launch is None):
            raise ValueError("set exactly one of url (a running server) and launch")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self
