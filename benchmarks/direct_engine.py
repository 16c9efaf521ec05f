"""Engines driven directly, without turnrl's rollout service, for `rollout_async_vs_batch.py`:
the hf engine against `model.generate` on one batch (`decode_speed`), and the engine of a
rollout on the token work the rollout did (`replay`), which the benchmark sets against the
service to give the service's cost.

`replay`: each trajectory's model turns are sent to the engine again, in order, each with the
tokens before it in the trajectory (the prompt, earlier turns, tool replies) and, greedy, as
many new tokens as the turn holds, under a session per trajectory (an engine may keep its KV
between turns, as it does for the service); the trajectories go at once, as the service sends
them. What is left out is what the service adds: the agent loop, chat template and parsing,
the tool calls (answered at once in the run compared), trajectory records."""

import asyncio
import math
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_svc.engines.base import Engine, SamplingParams
from rollout_svc.engines.hf import HfEngine, HfEngineOptions
from turnrl.trajectory import SegmentSource, Trajectory


async def replay(engine: Engine, trajectories: list[Trajectory]) -> tuple[float, bool]:
    """Replays every trajectory's model turns on `engine`: (wall seconds, whether every turn
    came back with the trajectory's own tokens)."""

    async def one(trajectory: Trajectory) -> bool:
        session_id = f"direct/{trajectory.trajectory_id}"
        context: list[int] = []
        same = True
        try:
            for turn, segment in enumerate(trajectory.segments):
                if segment.source is SegmentSource.MODEL and segment.token_ids:
                    tokens = len(segment.token_ids)
                    sampling = SamplingParams(max_new_tokens=tokens, temperature=0.0)
                    request_id = f"{session_id}/{turn}"
                    output = await engine.generate(context, sampling, request_id, session_id)
                    same = same and output.output_ids == segment.token_ids
                context = context + segment.token_ids
        finally:
            await engine.end_session(session_id)
        return same

    started = time.perf_counter()
    agreeing = await asyncio.gather(*(one(trajectory) for trajectory in trajectories))
    return time.perf_counter() - started, all(agreeing)


async def decode_speed(
    model_path: str,
    max_model_len: int,
    prompt_ids: list[list[int]],
    pad_token_id: int,
    new_tokens: int,
    repeats: int,
) -> dict[str, float]:
    """Tokens/s of the hf engine and of `model.generate` on one batch, greedy, every row
    decoding `new_tokens` tokens, best of `repeats`; and the share of rows that agree."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # No row may stop early in either, so both decode the same number of tokens.
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    options = HfEngineOptions(max_batch_size=len(prompt_ids))
    engine = HfEngine(model, tokenizer, options, max_model_len)
    engine_seconds = math.inf
    try:
        await engine.generate(prompt_ids[0], sampling, "warm-up")
        for repeat in range(repeats):
            started = time.perf_counter()
            outputs = await asyncio.gather(
                *(
                    engine.generate(ids, sampling, f"{repeat}/{i}")
                    for i, ids in enumerate(prompt_ids)
                )
            )
            engine_seconds = min(engine_seconds, time.perf_counter() - started)
    finally:
        await engine.close()
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])

    def generate(max_new_tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id,
            )[:, width:]

    await asyncio.to_thread(generate, 2)  # warm-up
    generate_seconds = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        generated = await asyncio.to_thread(generate, new_tokens)
        generate_seconds = min(generate_seconds, time.perf_counter() - started)
    assert all(len(output.output_ids) == new_tokens for output in outputs)
    assert generated.shape == (len(prompt_ids), new_tokens)
    tokens = len(prompt_ids) * new_tokens
    agree = sum(o.output_ids == row.tolist() for o, row in zip(outputs, generated, strict=True))
    return {
        "hf_engine_tokens_per_s": tokens / engine_seconds,
        "model_generate_tokens_per_s": tokens / generate_seconds,
        "decode_rows_agreeing": agree / len(prompt_ids),
    }
