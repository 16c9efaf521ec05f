"""The rollout service on the vLLM engine (the session's real vLLM server), with the real tool
and reward services on loopback, Generate over gRPC: multi-turn calculator trajectories whose
logprobs are the trainer's (a transformers forward pass of the same model over the same ids),
and Abort."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout_svc.test_rollout_service import (
    generate,
    prompts,
    rollout_stack,
    teacher_forced_logprobs,
)
from turnrl.v1 import common_pb2, rollout_pb2

pytestmark = pytest.mark.engines

Source = common_pb2.SegmentSource
Finish = common_pb2.FinishReason

# The mismatch (the trainer's `mismatch/mean_abs_diff`: the mean over the sampled tokens of
# |engine logprob - the trainer's forward pass over the same ids|) must stay under 1e-5, as the
# issue asks; a single token may differ more: float32 rounding in vLLM's CPU kernels, which
# depends on how requests are batched, gave a largest difference of 1.5e-5 and 4.5e-5 in two
# runs (mean 2.3e-7).
MAX_MEAN_MISMATCH = 1e-5
MAX_TOKEN_MISMATCH = 5e-4


def vllm_settings(vllm_server, **settings) -> dict:
    """The rollout config's settings for the vLLM engine on the session's server."""
    return {
        "engine": "vllm",
        "engine_options": {"url": vllm_server.url},
        "max_model_len": vllm_server.max_model_len,
        "max_response_length": 400,
        **settings,
    }


async def test_multi_turn_trajectories_are_token_exact(vllm_server):
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_path, dtype=torch.float32)
    model.eval()
    async with rollout_stack(vllm_server.model_path, **vllm_settings(vllm_server)) as stub:
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(4), n=2, enable_scoring=True,
                sampling=common_pb2.SamplingParams(temperature=1.0, seed=7),
                limits=common_pb2.LengthLimits(max_new_tokens=64),
            )  # fmt: skip
        trajectories = await generate(stub, request)
    assert sorted(t.trajectory_id for t in trajectories) == sorted(
        f"p{i}/{j}" for i in range(4) for j in range(2)
    )
    with_tools = [t for t in trajectories if t.metrics["tool_calls"] >= 1]
    assert with_tools, [t.metrics for t in trajectories]
    differences = []
    for trajectory in trajectories:
        assert trajectory.finish_reason != Finish.FINISH_REASON_ERROR, trajectory.error_message
        token_ids = [t for s in trajectory.segments for t in s.token_ids]
        assert list(trajectory.loss_mask) == [
            s.source == Source.SEGMENT_SOURCE_MODEL
            for s in trajectory.segments
            for _ in s.token_ids
        ]
        expected = teacher_forced_logprobs(model, token_ids)
        engine = torch.tensor([lp for s in trajectory.segments for lp in s.logprobs])
        positions = [i - 1 for i, m in enumerate(trajectory.loss_mask) if m]
        differences.append(torch.abs(engine - expected[positions]))
        model_segments = [s for s in trajectory.segments if s.source == Source.SEGMENT_SOURCE_MODEL]
        assert all(s.policy_version == 0 for s in model_segments)
        assert trajectory.HasField("reward") and not trajectory.reward.error
    differences = torch.cat(differences)
    mean, worst = differences.mean().item(), differences.max().item()
    print(
        f"vLLM vs the trainer's forward pass: |logprob difference| mean {mean:.3g}, max {worst:.3g}"
    )
    assert mean < MAX_MEAN_MISMATCH, f"mean |logprob - trainer's| = {mean:.3g}"
    assert worst < MAX_TOKEN_MISMATCH, f"max |logprob - trainer's| = {worst:.3g}"
    for trajectory in with_tools:
        sources = [s.source for s in trajectory.segments]
        assert sources[:4] == [
            Source.SEGMENT_SOURCE_PROMPT,
            Source.SEGMENT_SOURCE_MODEL,
            Source.SEGMENT_SOURCE_TOOL,
            Source.SEGMENT_SOURCE_TEMPLATE,
        ]


async def test_abort_returns_the_partial_trajectories(vllm_server):
    settings = vllm_settings(vllm_server, max_new_tokens=1800, max_response_length=1800)
    async with rollout_stack(vllm_server.model_path, **settings) as stub:
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(2), n=2, request_id="to-abort",
                sampling=common_pb2.SamplingParams(temperature=1.5, seed=1),
                limits=common_pb2.LengthLimits(max_new_tokens=1800, max_response_length=1800),
            )  # fmt: skip
        call = stub.Generate(request, timeout=300)
        stats = rollout_pb2.GetStatsRequest()
        async with asyncio.timeout(60):  # until all four are generating
            while (await stub.GetStats(stats, timeout=10)).running_trajectories < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        aborted = await stub.Abort(rollout_pb2.AbortRequest(request_id="to-abort"), timeout=10)
        trajectories = [reply.trajectory async for reply in call]
    assert aborted.aborted_trajectories >= 1
    assert len(trajectories) == 4
    assert any(t.finish_reason == Finish.FINISH_REASON_ABORTED for t in trajectories)
    assert all(t.finish_reason != Finish.FINISH_REASON_ERROR for t in trajectories), [
        t.error_message for t in trajectories
    ]
