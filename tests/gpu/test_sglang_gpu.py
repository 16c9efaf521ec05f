"""The SGLang engine against a real SGLang server on a GPU: ids and logprobs against the same
model's forward pass, stop tokens, abort, a weight push into the server through turnrl's own
weight-sync group while a request is in flight, and shutdown. The figures each test measures
go to BENCHMARKS.md when it runs on a lent device."""

import asyncio
import datetime

import httpx
import pytest
import torch

from rollout_svc.engines.base import FinishReason, SamplingParams
from tests.gpu.conftest import encode, reference_logprobs
from turnrl.weight_group import broadcast, form_group, host_store, leave_group
from turnrl.weights import TensorMeta

pytestmark = pytest.mark.gpu

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23? Show your steps.",
)
LONG_PROMPT = "Tell a very long, detailed story about a lighthouse keeper, chapter by chapter."
# bf16 engine against a bf16 forward pass of another kernel: per-token logprobs agree to these.
MEAN_ABS_TOLERANCE = 0.05
MAX_ABS_TOLERANCE = 0.5


def mismatch(engine: list[float], reference: torch.Tensor) -> tuple[float, float]:
    diff = (torch.tensor(engine) - reference).abs()
    return diff.mean().item(), diff.max().item()


async def test_logprobs_are_the_models(sglang, tokenizer, reference):
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    outputs = await asyncio.gather(
        *(sglang.generate(p, sampling, f"lp-{i}") for i, p in enumerate(prompts))
    )
    engine = [lp for out in outputs for lp in out.logprobs]
    expected = torch.cat(
        [
            reference_logprobs(reference, p, o.output_ids)
            for p, o in zip(prompts, outputs, strict=True)
        ]
    )
    mean, largest = mismatch(engine, expected)
    print(f"SGLang vs forward pass: mean |diff| {mean:.4f}, max {largest:.4f}")
    assert mean <= MEAN_ABS_TOLERANCE and largest <= MAX_ABS_TOLERANCE


async def test_a_stop_token_ends_the_turn_and_stays_last(sglang, tokenizer):
    prompt = encode(tokenizer, PROMPTS[0])
    free = await sglang.generate(prompt, SamplingParams(16, temperature=0.0), "stop-free")
    assert len(free.output_ids) >= 2, free.output_ids
    stop_id = free.output_ids[min(3, len(free.output_ids) - 1)]
    expected = free.output_ids[: free.output_ids.index(stop_id) + 1]
    sampling = SamplingParams(16, temperature=0.0, stop_token_ids=(stop_id,))
    stopped = await sglang.generate(prompt, sampling, "stop")
    assert (stopped.output_ids, stopped.finish_reason) == (expected, FinishReason.STOP)


async def test_abort_returns_the_tokens_so_far(sglang, tokenizer):
    sampling = SamplingParams(max_new_tokens=4096, temperature=1.0)
    task = asyncio.create_task(sglang.generate(encode(tokenizer, LONG_PROMPT), sampling, "abort"))
    while not sglang.stats()["running_requests"]:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # some tokens decoded
    await sglang.abort("abort")
    output = await task
    assert output.finish_reason is FinishReason.ABORT
    assert 0 < len(output.output_ids) == len(output.logprobs) < 4096


async def test_a_push_reaches_the_server_with_a_request_in_flight(
    sglang, tokenizer, reference, weight_sync_backend
):
    """turnrl's rank 0 forms the group (turnrl.weight_group) and the server joins it; every
    parameter goes tensor by tensor, the final norm scaled by 0.7. The request in flight
    finishes across the push, and new samples follow the changed model."""
    timeout = datetime.timedelta(seconds=120)
    store = host_store("127.0.0.1", 0, 2, timeout)
    _, group = await asyncio.gather(
        sglang.join_weight_sync("127.0.0.1", store.port, 2, 1, weight_sync_backend, "gpu", 120),
        asyncio.to_thread(form_group, store, 0, 2, weight_sync_backend, "gpu", timeout),
    )
    norm_name, norm = [(n, p) for n, p in reference.named_parameters() if p.dim() == 1][-1]
    with torch.no_grad():
        norm.mul_(0.7)
    try:
        long_prompt = encode(tokenizer, LONG_PROMPT)
        in_flight = asyncio.create_task(
            sglang.generate(long_prompt, SamplingParams(max_new_tokens=256), "in-flight")
        )
        await asyncio.sleep(1.0)  # decoding under version 0
        await sglang.pause()
        tensors = [(n, p.detach()) for n, p in reference.named_parameters()]
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        device = "cuda:0" if weight_sync_backend == "nccl" else "cpu"

        def send() -> None:
            for _, tensor in tensors:
                broadcast(group, tensor.contiguous().to(device))

        await asyncio.gather(
            sglang.receive_weights("gpu", metas, 256 << 20, 1), asyncio.to_thread(send)
        )
        await sglang.resume()
        spanning = await in_flight
        prompt = encode(tokenizer, PROMPTS[3])
        after = await sglang.generate(prompt, SamplingParams(48, temperature=1.0), "after")
        changed = reference_logprobs(reference, prompt, after.output_ids)
        with torch.no_grad():
            norm.div_(0.7)
        original = reference_logprobs(reference, prompt, after.output_ids)
    finally:
        leave_group(group)
    assert spanning.finish_reason is not FinishReason.ABORT
    assert set(after.policy_versions) == {1} and sglang.policy_version == 1
    to_changed, _ = mismatch(after.logprobs, changed)
    to_original, _ = mismatch(after.logprobs, original)
    print(f"{norm_name} x0.7: to the pushed model {to_changed:.4f}, to the old {to_original:.4f}")
    assert to_changed <= MEAN_ABS_TOLERANCE and to_original > 2 * to_changed


async def test_close_stops_the_server(sglang):
    await sglang.close()
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        with pytest.raises(httpx.TransportError):
            await client.get(f"{sglang.url}/health_generate")
