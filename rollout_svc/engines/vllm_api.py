"""The shapes of vLLM's HTTP API that the vLLM engine uses (vLLM 0.32): the token-in, token-out
`/inference/v1/generate` request and its reply, the model list that gives the server's context,
and the weight label; parsed (pydantic models) into what the engine returns.

A reply of the wrong shape means an incompatible server: `EngineHttp.parse` raises RuntimeError.
"""

from typing import Literal

from pydantic import BaseModel

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.weight_versions import WeightVersionSpan, span_versions

# vLLM names a /inference/v1/generate request "generate-tokens-" + the request_id it was sent
# (entrypoints/scale_out/token_in_token_out/serving.py:194), and /abort_requests matches that
# name (v1/engine/output_processor.py:580), so an abort must carry the prefix.
GENERATE_ID_PREFIX = "generate-tokens-"


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float


class Logprobs(BaseModel):
    content: list[TokenLogprob]


class GenerateChoice(BaseModel):
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: Logprobs
    weight_versions: list[WeightVersionSpan] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class GenerateReply(BaseModel):
    choices: list[GenerateChoice]
    usage: Usage | None = None
    # The prompt after the server expanded its images (`return_token_ids`: sent with images).
    prompt_token_ids: list[int] | None = None


class ServedModel(BaseModel):
    id: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models: the model the server serves, with its context length."""

    data: list[ServedModel]


class DeviceConfig(BaseModel):
    device: str


class VllmConfig(BaseModel):
    device_config: DeviceConfig


class ServerInfo(BaseModel):
    """The part of GET /server_info?config_format=json the engine reads."""

    vllm_config: VllmConfig


class WorldSize(BaseModel):
    world_size: int


class WeightInfo(BaseModel):
    weight_version: str


def generate_body(
    input_ids: list[int], sampling: SamplingParams, server_request_id: str, with_seed: bool
) -> dict:
    """The body of a /inference/v1/generate request: `input_ids` in, the sampled ids with the
    logprob of each out (`logprobs: 0`: the sampled token's alone, under the raw logits, vLLM's
    default `raw_logprobs` mode, as the hf engine reports them). The sampling seed is sent
    only `with_seed` (see `VllmEngine.create`). Stop strings end the generation without
    cutting its token ids (vLLM trims only the text, v1/engine/detokenizer.py), and vLLM makes
    the text it finds them in only when asked to detokenize."""
    params = {
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # vLLM, like SamplingParams: 0 is off
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "stop_token_ids": list(sampling.stop_token_ids),
        "stop": list(sampling.stop_strings),
        "seed": sampling.seed if with_seed else None,
        "logprobs": 0,
        # Token in, token out: no text is made but for stop strings, nothing dropped from what
        # comes back.
        "detokenize": bool(sampling.stop_strings),
        "skip_special_tokens": False,
    }
    return {
        "request_id": server_request_id,
        "token_ids": input_ids,
        "sampling_params": params,
        "output_mode": "tokens",
        "stream": False,
    }


def token_versions(choice: GenerateChoice, loaded_version: int) -> list[int]:
    """The policy version of each output token from the server's version spans (labels set by
    the weight path: str(policy_version); vLLM's initial "default" is 0); `loaded_version` for
    all when the server reports no spans that cover the output."""
    count = len(choice.logprobs.content)
    versions = span_versions(choice.weight_versions or [])
    return versions if len(versions) == count else [loaded_version] * count


def request_metrics(reply: GenerateReply) -> dict[str, float]:
    """The metrics of one generate() call that the server reports: its prompt tokens and the
    ones its prefix cache served (with --enable-prompt-tokens-details)."""
    if reply.usage is None:
        return {}
    details = reply.usage.prompt_tokens_details
    metrics = {
        "prompt_tokens": reply.usage.prompt_tokens,
        "cached_prompt_tokens": details.cached_tokens if details else None,
    }
    return {name: float(value) for name, value in metrics.items() if value is not None}
