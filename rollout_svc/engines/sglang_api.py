"""The shapes of SGLang's native HTTP API that the SGLang engine uses: sampling parameters and
dtypes as SGLang takes them, and the replies it sends back, parsed (pydantic models) into what
the engine returns.

A reply of the wrong shape means an incompatible server: `EngineHttp.parse` raises RuntimeError.
Paths in comments are those of the SGLang 0.5.23 wheel, under `sglang/srt/`.
"""

from typing import Literal

import torch
from pydantic import BaseModel

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.weight_versions import (
    WeightVersionSpan,
    span_versions,
    version_number,
)
from turnrl.errors import InvalidArgumentError


class FinishReasonReply(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None


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
    # The prompt as the server expanded it (`return_prompt_token_ids`: sent with images).
    prompt_token_ids: list[int] | None = None


class ModelInfo(BaseModel):
    model_path: str
    is_generation: bool = True
    weight_version: str | None = None


class ServerInfo(BaseModel):
    """The parts of `/get_server_info` (the server's arguments and its scheduler's limits,
    `utils/common.py` build_server_info) the engine reads."""

    tp_size: int = 1
    dp_size: int = 1
    # The longest prompt the scheduler admits is one token shorter (`managers/utils.py`
    # validate_input_length); None from servers that do not report it.
    max_req_input_len: int | None = None


class WeightSyncReply(BaseModel):
    success: bool
    message: str = ""


# The context SGLang's scheduler keeps back from `--context-length`: it admits prompts shorter
# than context - 6 tokens (`managers/tp_worker.py`: max_req_len = context - 1, max_req_input_len
# = max_req_len - 5; `managers/utils.py` validate_input_length) and ends a generation at
# max_req_len - 1 tokens in all (`managers/scheduler.py` init_req_max_new_tokens).
SCHEDULER_RESERVED_TOKENS = 6


def sglang_rid(request_id: str) -> str:
    """The `rid` under which turnrl's request `request_id` runs on the server. SGLang aborts
    every request whose rid starts with the rid it is given (`managers/scheduler.py`
    abort_request: `req.rid.startswith(recv_req.rid)`), so aborting "r1" would end "r10" too;
    with its length in front, no rid of ours starts with another's."""
    return f"{len(request_id)}:{request_id}"


def sampling_params(sampling: SamplingParams, max_new_tokens: int) -> dict:
    """`sampling` as the `sampling_params` of a /generate request, with `max_new_tokens` (at
    most sampling's: SGLang refuses a request whose prompt and max_new_tokens together pass its
    context, `managers/tokenizer_manager.py` _validate_one_request)."""
    params = {
        "max_new_tokens": max_new_tokens,
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
    if sampling.stop_strings:
        # The request ends after the id that completes one (`managers/schedule_batch.py`
        # Req._check_str_based_finish) and, with no_stop_trim, every id comes back.
        params["stop"] = list(sampling.stop_strings)
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
        versions = span_versions(meta.weight_versions)
        if len(versions) == count:
            return versions
    if meta.weight_version is not None:
        return [version_number(meta.weight_version)] * count
    return [loaded_version] * count
