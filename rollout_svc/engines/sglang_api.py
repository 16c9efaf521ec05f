"""The shapes of SGLang's native HTTP API that the SGLang engine uses: sampling parameters and
dtypes as SGLang takes them, and the replies it sends back, parsed (pydantic models) into what
the engine returns.

A reply of the wrong shape means an incompatible server: `EngineHttp.parse` raises RuntimeError.
"""

from typing import Literal

import torch
from pydantic import BaseModel

from rollout_svc.engines.base import SamplingParams
from turnrl.errors import InvalidArgumentError


class FinishReasonReply(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None


class WeightVersionSpan(BaseModel):
    version: str
    start: int
    end: int


class MetaInfo(BaseModel):
    finish_reason: FinishReasonReply
    output_token_logprobs: list[tuple[float, int, str | None]]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    e2e_latency: float | None = None
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateReply(BaseModel):
    meta_info: MetaInfo


class ModelInfo(BaseModel):
    model_path: str
    is_generation: bool = True
    weight_version: str | None = None


class ServerInfo(BaseModel):
    """The parts of `/get_server_info` (the server's arguments) the engine reads."""

    tp_size: int = 1
    dp_size: int = 1


class WeightSyncReply(BaseModel):
    success: bool
    message: str = ""


def sampling_params(sampling: SamplingParams) -> dict:
    """`sampling` as the `sampling_params` of a /generate request."""
    params = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 is off, 0 invalid
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "stop_token_ids": list(sampling.stop_token_ids),
        # Token in, token out: nothing dropped or trimmed from what comes back.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.seed is not None:  # servers before sampling_seed reject the key
        params["sampling_seed"] = sampling.seed
    return params


def dtype_name(dtype: str | torch.dtype) -> str:
    """The dtype as SGLang looks it up (`getattr(torch, name)`): "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise InvalidArgumentError(f"dtype {dtype!r} is not a torch dtype, e.g. 'bfloat16'")
    return name


def request_metrics(meta: MetaInfo) -> dict[str, float]:
    """The metrics of one generate() call that the server reports."""
    metrics = {
        "prompt_tokens": meta.prompt_tokens,
        "cached_prompt_tokens": meta.cached_tokens,
        "latency_seconds": meta.e2e_latency,
    }
    return {name: float(value) for name, value in metrics.items() if value is not None}


def token_versions(meta: MetaInfo, loaded_version: int) -> list[int]:
    """The policy version of each output token, from the server's version spans when it
    reports them, else the version it reports at the end (or `loaded_version`) for all."""
    count = len(meta.output_token_logprobs)
    if meta.weight_versions:
        versions = [
            version_number(span.version)
            for span in meta.weight_versions
            for _ in range(span.end - span.start)
        ]
        if len(versions) == count:
            return versions
    if meta.weight_version is not None:
        return [version_number(meta.weight_version)] * count
    return [loaded_version] * count


def version_number(label: str | None) -> int:
    """Our policy version from SGLang's weight_version label. Pushes label versions with their
    number; any other label ("default") means the weights the server started with: 0."""
    try:
        return int(label or "0")
    except ValueError:
        return 0
