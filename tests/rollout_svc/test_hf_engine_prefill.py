"""The hf engine's prefill and KV reuse, on the tiny random Qwen3 of hf_engine_fixtures:
requests prefilled together, a shared prompt prefix computed once, a session's next turn
computing only its new tokens, the prefill token budget, and evicted sessions recomputed, each
sampling exactly what it would alone and with logprobs equal to a teacher-forced pass."""

import asyncio
from collections.abc import Coroutine
from pathlib import Path

import pytest
from transformers import Qwen3ForCausalLM

from rollout_svc.engines.base import GenerateOutput, SamplingParams
from rollout_svc.engines.hf import HfEngine
from tests.rollout_svc.hf_engine_fixtures import (
    LOGPROB_TOLERANCE,
    VOCAB_SIZE,
    assert_logprobs_match,
    generate_reference,
    greedy,
    random_ids,
    start_engine,
    submitted,
    tiny_config,
)
from tests.rollout_svc.hf_engine_fixtures import engine as engine
from tests.rollout_svc.hf_engine_fixtures import model_dir as model_dir
from tests.rollout_svc.hf_engine_fixtures import one_torch_thread as one_torch_thread
from tests.rollout_svc.hf_engine_fixtures import reference as reference


async def prefilled_together(
    engine: HfEngine, calls: list[Coroutine[None, None, GenerateOutput]]
) -> tuple[list[GenerateOutput], int]:
    """Queues the calls while the engine is paused, so that they are admitted in one iteration;
    returns their outputs and the prefill forwards that took."""
    await engine.pause()
    tasks = [await submitted(engine, call) for call in calls]
    forwards = engine.stats()["prefill_forwards"]
    await engine.resume()
    outputs = await asyncio.gather(*tasks)
    return outputs, engine.stats()["prefill_forwards"] - forwards


@pytest.mark.parametrize(
    "sampling",
    [greedy(20), SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=5)],
    ids=["greedy", "seeded"],
)
async def test_batched_prefill_matches_prefill_alone(
    engine: HfEngine, reference: Qwen3ForCausalLM, sampling: SamplingParams
) -> None:
    prompts = [random_ids(n, seed=50 + n) for n in (1, 3, 17, 40, 90)]
    alone = [await engine.generate(p, sampling, f"alone{i}") for i, p in enumerate(prompts)]
    # Padded to the 90-token prompt, in one forward (the 1-token prompt needs none).
    together, forwards = await prefilled_together(
        engine, [engine.generate(p, sampling, f"together{i}") for i, p in enumerate(prompts)]
    )
    assert forwards == 1
    for prompt, one, batched in zip(prompts, alone, together, strict=True):
        assert batched.output_ids == one.output_ids
        assert batched.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
        assert batched.metrics["computed_prompt_tokens"] == len(prompt)
        assert_logprobs_match(reference, prompt, batched)


async def test_prompts_admitted_together_compute_their_shared_prefix_once(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    system = random_ids(40, seed=55)
    prompts = [[*system, *random_ids(n, seed=56 + n)] for n in (1, 6, 30)]
    sampling = SamplingParams(max_new_tokens=15, temperature=1.0, seed=9)
    alone = [await engine.generate(p, sampling, f"alone{i}") for i, p in enumerate(prompts)]
    prefill_tokens = engine.stats()["prefill_tokens"]
    # The 40 shared tokens in one forward, the rest in another.
    together, forwards = await prefilled_together(
        engine, [engine.generate(p, sampling, f"together{i}") for i, p in enumerate(prompts)]
    )
    assert forwards == 2
    computed = engine.stats()["prefill_tokens"] - prefill_tokens
    assert computed == len(system) + sum(len(p) - len(system) for p in prompts)
    for prompt, one, batched in zip(prompts, alone, together, strict=True):
        assert one.metrics["cached_prompt_tokens"] == 0
        assert batched.metrics["cached_prompt_tokens"] == len(system)
        assert batched.metrics["computed_prompt_tokens"] == len(prompt) - len(system)
        assert batched.output_ids == one.output_ids
        assert batched.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
        assert_logprobs_match(reference, prompt, batched)


async def test_samples_of_one_prompt_compute_it_once(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    # Two GRPO groups of three samples after a shared system prompt, and a prompt of its own.
    system = random_ids(40, seed=57)
    questions = [random_ids(n, seed=58 + n) for n in (6, 11)]
    prompts = [[*system, *q] for q in questions for _ in range(3)]
    prompts.append([*system, *random_ids(9, seed=70)])
    sampling = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=i) for i in range(7)]
    requests = list(enumerate(zip(prompts, sampling, strict=True)))
    alone = [await engine.generate(p, s, f"alone{i}") for i, (p, s) in requests]
    prefill_tokens = engine.stats()["prefill_tokens"]
    together, forwards = await prefilled_together(
        engine,
        [engine.generate(p, s, f"together{i}") for i, (p, s) in requests],
    )
    # The system prompt; each group's question but its last token, once; then the six samples'
    # last tokens and the lone prompt's question.
    assert forwards == 3
    computed = engine.stats()["prefill_tokens"] - prefill_tokens
    assert computed == len(system) + sum(len(q) - 1 for q in questions) + 6 + 9
    for index, (prompt, one, batched) in enumerate(zip(prompts, alone, together, strict=True)):
        grouped = index < 6
        cached = len(prompt) - 1 if grouped else len(system)
        assert batched.metrics["cached_prompt_tokens"] == cached
        assert batched.metrics["computed_prompt_tokens"] == len(prompt) - cached
        assert batched.output_ids == one.output_ids
        assert batched.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
        assert_logprobs_match(reference, prompt, batched)


async def test_resumed_sessions_prefill_together_with_fresh_requests(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    first_prompts = {"a": random_ids(7, seed=60), "b": random_ids(33, seed=61)}
    histories = {}
    for session, prompt in first_prompts.items():
        out = await engine.generate(prompt, greedy(5), f"{session}1", session_id=session)
        histories[session] = [*prompt, *out.output_ids]
    # New suffixes of 3 and 12 tokens after cached prefixes of 11 and 37, next to a fresh prompt.
    prompts = {
        "a": [*histories["a"], *random_ids(3, seed=62)],
        "b": [*histories["b"], *random_ids(12, seed=63)],
        "fresh": random_ids(50, seed=64),
    }
    outputs, forwards = await prefilled_together(
        engine,
        [
            engine.generate(prompt, greedy(15), f"{name}2", session_id=name)
            for name, prompt in prompts.items()
        ],
    )
    assert forwards == 1
    cached = [len(histories["a"]) - 1, len(histories["b"]) - 1, 0]
    for (name, prompt), out, reused in zip(prompts.items(), outputs, cached, strict=True):
        assert out.metrics["cached_prompt_tokens"] == reused, name
        assert out.metrics["computed_prompt_tokens"] == len(prompt) - reused, name
        assert out.output_ids == generate_reference(reference, prompt, 15), name
        assert_logprobs_match(reference, prompt, out)


async def test_prefill_token_budget_splits_admission(
    model_dir: Path, reference: Qwen3ForCausalLM
) -> None:
    # Two 30-token prompts fit 64 tokens (2 x 29 to compute), a third does not; the 100-token
    # one is over the budget alone and still runs, alone.
    engine = await start_engine(model_dir, max_prefill_tokens=64)
    try:
        prompts = [random_ids(n, seed=70 + i) for i, n in enumerate((30, 30, 30, 100))]
        outputs, forwards = await prefilled_together(
            engine, [engine.generate(p, greedy(10), f"b{i}") for i, p in enumerate(prompts)]
        )
    finally:
        await engine.close()
    assert forwards == 3
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.output_ids == generate_reference(reference, prompt, 10)
        assert_logprobs_match(reference, prompt, out)


async def test_session_turns_reuse_the_cached_prefix(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    first_prompt = random_ids(25, seed=10)
    first = await engine.generate(first_prompt, greedy(15), "t1", session_id="s")
    assert engine.stats()["cached_sessions"] == 1
    history = first_prompt + first.output_ids
    second_prompt = [*history, *random_ids(6, seed=11)]
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    second = await engine.generate(second_prompt, sampling, "t2", session_id="s")
    # Everything but the last sampled token (never fed) came from the cache.
    assert second.metrics["cached_prompt_tokens"] == len(history) - 1
    assert second.metrics["computed_prompt_tokens"] == len(second_prompt) - len(history) + 1
    stats = engine.stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_hit_tokens"]) == (1, len(history) - 1)
    fresh = await engine.generate(second_prompt, sampling, "fresh")
    assert fresh.metrics["computed_prompt_tokens"] == len(second_prompt)
    assert second.output_ids == fresh.output_ids
    assert second.logprobs == pytest.approx(fresh.logprobs, abs=LOGPROB_TOLERANCE)
    assert_logprobs_match(reference, second_prompt, second)

    # A prompt that rewrites the history reuses only the common prefix.
    rewritten = [*first_prompt, (first.output_ids[0] + 1) % VOCAB_SIZE, 5, 6]
    third = await engine.generate(rewritten, greedy(10), "t3", session_id="s")
    assert third.metrics["cached_prompt_tokens"] == len(first_prompt)
    assert third.output_ids == generate_reference(reference, rewritten, 10)

    await engine.end_session("s")
    assert engine.stats()["cached_sessions"] == engine.stats()["session_kv_bytes"] == 0
    again = await engine.generate(rewritten, greedy(10), "t4", session_id="s")
    assert again.metrics["cached_prompt_tokens"] == 0
    assert again.output_ids == third.output_ids


async def test_evicted_sessions_recompute_with_identical_results(
    model_dir: Path, reference: Qwen3ForCausalLM
) -> None:
    config = tiny_config()
    bytes_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    )
    prompt_len, new_tokens = 20, 10
    session_tokens = prompt_len + new_tokens - 1
    # Room for one finished session, not two: the least recently used one goes.
    engine = await start_engine(
        model_dir, kv_cache_budget_bytes=int(1.5 * session_tokens * bytes_per_token)
    )
    try:
        prompts = {s: random_ids(prompt_len, seed=20 + i) for i, s in enumerate("ab")}
        histories = {}
        for session, prompt in prompts.items():
            out = await engine.generate(
                prompt, greedy(new_tokens), f"{session}1", session_id=session
            )
            histories[session] = [*prompt, *out.output_ids, 7, 8]
        stats = engine.stats()
        assert (stats["cached_sessions"], stats["session_evictions"]) == (1, 1)
        assert stats["session_kv_bytes"] == session_tokens * bytes_per_token
        # b first: a's turn would store a and evict b.
        seconds = {
            s: await engine.generate(histories[s], greedy(12), f"{s}2", session_id=s) for s in "ba"
        }
    finally:
        await engine.close()
    assert seconds["a"].metrics["cached_prompt_tokens"] == 0  # evicted: recomputed
    assert seconds["b"].metrics["cached_prompt_tokens"] == session_tokens
    for session, out in seconds.items():
        assert out.output_ids == generate_reference(reference, histories[session], 12)
        assert_logprobs_match(reference, histories[session], out)
