"""A request in the hf engine, and how its next token is sampled."""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout_svc.engines.base import EngineImage, FinishReason, GenerateOutput, SamplingParams
from rollout_svc.engines.hf_cache import Kv
from rollout_svc.engines.hf_vision import RequestVision
from turnrl.errors import FailedPreconditionError


@dataclass(eq=False)
class Request:
    """One generate() call: its inputs, its future, and its state in the worker."""

    request_id: str
    session_id: str
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    generator: torch.Generator | None  # None: greedy
    future: asyncio.Future[GenerateOutput]
    loop: asyncio.AbstractEventLoop
    on_tokens: Callable[[list[int]], None] | None = None  # called on `loop` per sampled id
    submitted_at: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading token_ids whose KV the worker holds for this request
    reused_kv: Kv | None = None  # KV of token_ids[:kv_len] found at admission, not yet batched
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0  # prefill tokens run through the model, recomputes included
    images: list[EngineImage] = field(default_factory=list)  # in token_ids, in order
    vision: RequestVision | None = None  # the images' features and positions, once prefilled

    @property
    def rope_delta(self) -> int:
        """What a position past its images is less than its index (M-RoPE; 0 without)."""
        return self.vision.rope_delta if self.vision is not None else 0

    @property
    def image_keys(self) -> tuple[tuple[int, str], ...]:
        """What tells apart two requests whose image tokens are alike: each image's first
        token and its bytes' SHA-256."""
        return tuple((image.token_offset, image.image.sha256) for image in self.images)

    def output(self, finish_reason: FinishReason) -> GenerateOutput:
        """What generate() returns for this request, ended for `finish_reason`."""
        return GenerateOutput(
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            policy_versions=self.policy_versions,
            finish_reason=finish_reason,
            metrics={
                "prompt_tokens": self.prompt_len,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "computed_prompt_tokens": self.computed_prompt_tokens,
                "latency_seconds": time.monotonic() - self.submitted_at,
            },
        )


def next_tokens(
    logits: torch.Tensor, requests: list[Request]
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """The next token of each request (row of float32 logits) under its sampling params, all
    rows at once: repetition penalty, then greedy argmax or temperature, top-k, top-p and
    min-p sampling, each request drawing from its own generator (one uniform number a token,
    so its samples do not depend on its batch mates). Returns the tokens, and by row the
    FailedPreconditionError of each request that leaves nothing to sample (NaN weights)."""
    failed: dict[int, Exception] = {}
    for row in logits.isnan().any(1).nonzero()[:, 0].tolist():
        failed[row] = FailedPreconditionError(
            f"request {requests[row].request_id!r}: the model's logits are NaN (were NaN "
            "weights loaded?)"
        )
    penalized = [row for row, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
    if penalized:
        logits = logits.clone()
        for row in penalized:
            logits[row] = _penalize_repetition(logits[row], requests[row])
    tokens = logits.argmax(-1)
    sampled = [row for row, r in enumerate(requests) if r.generator is not None]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs = _filtered_probs(logits[index], [requests[row].sampling for row in sampled])
        cdf = probs.cumsum(-1)
        generators = [requests[row].generator for row in sampled]
        uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators])
        drawn = torch.searchsorted(cdf, (uniform.to(cdf) * cdf[:, -1])[:, None], right=True)
        # A draw rounded up to the total mass lands past the end: the likeliest token then.
        drawn = torch.where(drawn[:, 0] < probs.shape[1], drawn[:, 0], probs.argmax(-1))
        tokens[index] = drawn
        totals = cdf[:, -1]
        for position in (~(totals.isfinite() & (totals > 0))).nonzero()[:, 0].tolist():
            row = sampled[position]
            if row not in failed:
                failed[row] = FailedPreconditionError(
                    f"request {requests[row].request_id!r}: no token left to sample (every "
                    "logit is -inf?)"
                )
    return tokens, failed


def _penalize_repetition(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """One row's logits with the repetition penalty on the tokens seen so far (HF's rule:
    positive scores divided by it, negative ones multiplied)."""
    penalty = request.sampling.repetition_penalty
    seen = torch.tensor(request.token_ids, device=logits.device)
    scores = logits.gather(0, seen)
    penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
    # A penalty near 0 (or above 1e38) overflows a score to infinity; clamped, it stays the most
    # (least) likely token instead of turning the softmax into NaN.
    finite = torch.finfo(logits.dtype)
    return logits.scatter(0, seen, penalized.clamp(finite.min, finite.max))


def _filtered_probs(logits: torch.Tensor, sampling: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution, unnormalised: softmax at its temperature, then its
    top-k, top-p and min-p filters (each off at its neutral value), zeros where filtered."""

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    temperature = column([s.temperature for s in sampling])
    # Shifted so the best logit is 0 before dividing: a temperature near 0 then sends the others
    # to -inf (greedy in the limit) instead of every logit to +-inf and NaN.
    probs = torch.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, dim=-1)
    vocab = probs.shape[1]
    top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in sampling]
    top_p = [s.top_p for s in sampling]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        kth = sorted_probs.gather(1, torch.tensor(top_k, device=probs.device)[:, None] - 1)
        sorted_probs = torch.where(sorted_probs >= kth, sorted_probs, 0.0)
        # Keep the smallest head whose mass reaches top_p: drop a token once the mass before it
        # does.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        nucleus = column(top_p)
        dropped = (mass_before >= nucleus * sorted_probs.sum(-1, keepdim=True)) & (nucleus < 1.0)
        sorted_probs = torch.where(dropped, 0.0, sorted_probs)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    min_p = column([s.min_p for s in sampling])
    return torch.where(probs >= min_p * probs.max(-1, keepdim=True).values, probs, 0.0)
