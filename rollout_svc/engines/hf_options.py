"""What the `hf` engine may be asked: its settings (the rollout config's `engine_options`)
and the checks a generate() request passes before it is queued."""

import math
from typing import Literal

from pydantic import Field

from rollout_svc.engines.base import SamplingParams, check_prompt
from turnrl.config import StrictModel
from turnrl.errors import InvalidArgumentError


class HfEngineOptions(StrictModel):
    """Settings of the `hf` engine (the rollout config's `engine_options`). The model and its
    context length are the rollout config's `model_path` and `max_model_len`."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Weight and activation dtype; float32 on CPU, bfloat16 on a GPU. Logprobs "
        "are always computed in float32.",
    )
    device: str = Field(default="cpu", description="Torch device of the model: cpu, cuda, cuda:1.")
    max_batch_size: int = Field(
        default=128,
        ge=1,
        description="Requests decoded together; more wait in a queue. One decode step costs "
        "little more for 128 rows than for 8 on a small model, so a GRPO step's requests "
        "(16 prompts x 8 samples) all decode together (benchmarks/vs_trl.py). The running "
        "batch's KV buffer has this many rows, each as wide as the widest running request "
        "(at most max_model_len): lower it for a large model with a long context.",
    )
    max_prefill_tokens: int = Field(
        default=8192,
        ge=1,
        description="Most tokens one prefill forward runs, padding included: the requests "
        "admitted together times the longest prompt suffix among them. Bounds the prefill's "
        "activations and how long decoding waits for it; a longer prompt is prefilled alone.",
    )
    kv_cache_budget_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description="Bytes of KV cache kept for finished requests' sessions, so a session's next "
        "turn computes only its new tokens; least recently used sessions are evicted beyond it. "
        "Running requests' KV is not counted (it is bounded by max_batch_size * max_model_len).",
    )
    seed: int = Field(
        default=0, description="Seeds the per-request generators of requests that set no seed."
    )


def validate_request(
    input_ids: list[int], sampling: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raises InvalidArgumentError for a prompt `check_prompt` refuses, an id outside the
    vocabulary, or a sampling value out of its range, naming it."""
    check_prompt(input_ids, max_model_len)
    bad = [token for token in input_ids if not 0 <= token < vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"token ids {bad[:5]!r} are outside the vocabulary [0, {vocab_size})"
        )
    checks = {
        "max_new_tokens": sampling.max_new_tokens >= 1,
        "temperature": 0 <= sampling.temperature < math.inf,
        "top_p": 0 < sampling.top_p <= 1,
        "top_k": sampling.top_k >= 0,
        "min_p": 0 <= sampling.min_p <= 1,
        "repetition_penalty": 0 < sampling.repetition_penalty < math.inf,
        "stop_strings": all(sampling.stop_strings),  # "" would end every turn at once
    }
    for name, ok in checks.items():
        if not ok:
            raise InvalidArgumentError(f"bad sampling {name}={getattr(sampling, name)!r}")
