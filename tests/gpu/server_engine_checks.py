"""What the GPU tests check of an engine that runs in a server of its own (SGLang, vLLM) on a
real server on a GPU: ids and logprobs against the same model's forward pass, stop tokens,
abort, a weight push into the server through turnrl's own weight-sync group while a request is
in flight, and shutdown. test_sglang_gpu and test_vllm_gpu run each on their engine. The
figures they print go to BENCHMARKS.md when they run on a lent device."""

import asyncio
import datetime
import time

import httpx
import pytest
import torch

from rollout_svc.engines.base import FinishReason, SamplingParams
from tests.gpu.conftest import encode, reference_logprobs
from turnrl.weight_group import broadcast, form_group, host_store, leave_group
from turnrl.weights import BucketedWeights

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23? Show your steps.",
)
# The tiny model rambles on greedily after it, never sampling EOS; a real model writes long.
LONG_PROMPT = "Tell a very long, detailed story about a lighthouse keeper, chapter by chapter."
# bf16 engine against a bf16 forward pass of another kernel: per-token logprobs agree to these.
MEAN_ABS_TOLERANCE = 0.05
MAX_ABS_TOLERANCE = 0.5
# Tokens of the request an abort ends: long enough to be mid-way when it comes.
ABORTED_TOKENS = 1024
BUCKET_SIZE_BYTES = 256 << 20
GROUP_NAME = "gpu"
GROUP_TIMEOUT_SECONDS = 120
# How long a request decodes before a push pauses it. Engines report no progress of a request
# that does not stream; the checks hold whether or not it decoded before the pause.
DECODE_SECONDS = 1.0


def mismatch(engine: list[float], reference: torch.Tensor) -> tuple[float, float]:
    diff = (torch.tensor(engine) - reference).abs()
    return diff.mean().item(), diff.max().item()


async def check_logprobs_are_the_models(engine, tokenizer, reference) -> None:
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS]
    outputs = await asyncio.gather(
        *(engine.generate(p, sampling, f"lp-{i}") for i, p in enumerate(prompts))
    )
    sampled = [lp for out in outputs for lp in out.logprobs]
    expected = torch.cat(
        [
            reference_logprobs(reference, p, o.output_ids)
            for p, o in zip(prompts, outputs, strict=True)
        ]
    )
    mean, largest = mismatch(sampled, expected)
    print(f"{type(engine).__name__} vs forward pass: mean |diff| {mean:.4f}, max {largest:.4f}")
    assert mean <= MEAN_ABS_TOLERANCE and largest <= MAX_ABS_TOLERANCE


async def check_a_stop_token_ends_the_turn_and_stays_last(engine, tokenizer) -> None:
    prompt = encode(tokenizer, PROMPTS[0])
    free = await engine.generate(prompt, SamplingParams(16, temperature=0.0), "stop-free")
    assert len(free.output_ids) >= 2, free.output_ids
    stop_id = free.output_ids[min(3, len(free.output_ids) - 1)]
    expected = free.output_ids[: free.output_ids.index(stop_id) + 1]
    sampling = SamplingParams(16, temperature=0.0, stop_token_ids=(stop_id,))
    stopped = await engine.generate(prompt, sampling, "stop")
    assert (stopped.output_ids, stopped.finish_reason) == (expected, FinishReason.STOP)


async def check_abort_returns_the_tokens_so_far(engine, tokenizer, max_model_len: int) -> None:
    """A greedy request of the prompt runs to its length once, timed; the same request is
    aborted half that time after it starts, and returns the tokens it had."""
    prompt = encode(tokenizer, LONG_PROMPT)
    # Within the context, which servers check prompt and max_new_tokens against.
    sampling = SamplingParams(min(ABORTED_TOKENS, max_model_len - len(prompt)), temperature=0.0)
    started = time.perf_counter()
    whole = await engine.generate(prompt, sampling, "abort-whole")
    whole_seconds = time.perf_counter() - started
    assert whole.finish_reason is FinishReason.LENGTH, (
        f"the model stopped after {len(whole.output_ids)} tokens; an abort needs a prompt it "
        "does not stop on"
    )
    task = asyncio.create_task(engine.generate(prompt, sampling, "abort"))
    await asyncio.sleep(whole_seconds / 2)  # mid-way: a timing, not a synchronization
    await engine.abort("abort")
    aborted = await asyncio.wait_for(task, timeout=60)
    print(f"aborted after {len(aborted.output_ids)} of {sampling.max_new_tokens} tokens")
    assert aborted.finish_reason is FinishReason.ABORT
    assert 0 < len(aborted.output_ids) == len(aborted.logprobs) < sampling.max_new_tokens


async def push(engine, group, model: torch.nn.Module, policy_version: int, backend: str) -> None:
    """Sends `model`'s parameters as turnrl's rank 0 does (from cuda:0 over NCCL, from CPU
    over gloo), in the layout the engine receives best, while the engine receives them."""
    weights = BucketedWeights.pack(model.named_parameters(), BUCKET_SIZE_BYTES)
    device = "cuda:0" if backend == "nccl" else "cpu"
    layout = engine.weight_layout

    def send() -> None:
        for index in range(len(weights.buckets)):
            for piece in weights.broadcast_pieces(index, layout):
                broadcast(group, piece.to(device))

    await engine.pause()
    receiving = engine.receive_weights(
        GROUP_NAME, weights.metas, BUCKET_SIZE_BYTES, layout, policy_version
    )
    await asyncio.gather(receiving, asyncio.to_thread(send))
    await engine.resume()


async def check_a_push_reaches_the_server_with_a_request_in_flight(
    engine, tokenizer, reference, backend: str
) -> None:
    """turnrl's rank 0 forms the group (turnrl.weight_group) and the server joins it; the
    final norm goes out halved (on the tiny model that moves logprobs by 0.1 to 0.2 on
    average, bf16 noise by about 0.01). The request in flight finishes across the push, new
    samples follow the changed model, and a second push puts the shipped weights back."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_SECONDS)
    world_size = 1 + engine.weight_sync_ranks
    store = host_store("127.0.0.1", 0, world_size, timeout)
    _, group = await asyncio.gather(
        engine.join_weight_sync(
            "127.0.0.1", store.port, world_size, 1, backend, GROUP_NAME, GROUP_TIMEOUT_SECONDS
        ),
        asyncio.to_thread(form_group, store, 0, world_size, backend, GROUP_NAME, timeout),
    )
    norm_name, norm = [(n, p) for n, p in reference.named_parameters() if p.dim() == 1][-1]
    shipped = norm.detach().clone()
    prompt = encode(tokenizer, LONG_PROMPT)
    try:
        in_flight = asyncio.create_task(
            engine.generate(prompt, SamplingParams(max_new_tokens=256), "in-flight")
        )
        await asyncio.sleep(DECODE_SECONDS)
        with torch.no_grad():
            norm.mul_(0.5)
        await push(engine, group, reference, 1, backend)
        spanning = await asyncio.wait_for(in_flight, timeout=120)
        after = await engine.generate(prompt, SamplingParams(48, temperature=1.0), "after")
        changed = reference_logprobs(reference, prompt, after.output_ids)
        with torch.no_grad():
            norm.copy_(shipped)
        original = reference_logprobs(reference, prompt, after.output_ids)
        await push(engine, group, reference, 2, backend)
    finally:
        with torch.no_grad():
            norm.copy_(shipped)
        leave_group(group)
    assert spanning.finish_reason is not FinishReason.ABORT
    assert set(after.policy_versions) == {1}
    assert engine.policy_version == 2
    to_changed, _ = mismatch(after.logprobs, changed)
    to_original, _ = mismatch(after.logprobs, original)
    print(f"{norm_name} x0.5: to the pushed model {to_changed:.4f}, to the old {to_original:.4f}")
    assert to_changed <= MEAN_ABS_TOLERANCE and to_original > 2 * to_changed


async def check_close_stops_the_server(engine) -> None:
    await engine.close()
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        with pytest.raises(httpx.TransportError):
            await client.get(f"{engine.url}/health")
