"""The hf engine on a tiny random Qwen3 saved to disk: continuous batching must not change what a
request samples, logprobs must equal a teacher-forced forward pass, requests end where their
limits say, and requests joining, leaving, aborted, cancelled or closed on keep both true. Prefill
and session KV: test_hf_engine_prefill.py; weight updates: test_hf_engine_weights.py."""

import asyncio
import math
import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer, Qwen3ForCausalLM

from rollout_svc.config import RolloutConfig
from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_compute import RunningBatch
from rollout_svc.engines.hf_request import Request, next_tokens
from tests.rollout_svc.hf_engine_fixtures import (
    LONG_TOKENS,
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    assert_logprobs_match,
    generate_reference,
    greedy,
    random_ids,
    start_engine,
    start_long,
    submitted,
)
from tests.rollout_svc.hf_engine_fixtures import engine as engine
from tests.rollout_svc.hf_engine_fixtures import model_dir as model_dir
from tests.rollout_svc.hf_engine_fixtures import one_torch_thread as one_torch_thread
from tests.rollout_svc.hf_engine_fixtures import reference as reference
from turnrl.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)


@pytest.mark.parametrize("max_batch_size", [2, 8])
async def test_concurrent_greedy_matches_generate_and_teacher_forcing(
    model_dir: Path, reference: Qwen3ForCausalLM, max_batch_size: int
) -> None:
    engine = await start_engine(model_dir, max_batch_size=max_batch_size)
    try:
        prompts = [random_ids(n, seed=n) for n in (1, 5, 23, 60, 130)]
        lengths = [40, 12, 25, 7, 33]
        outputs = await asyncio.gather(
            *(
                engine.generate(prompt, greedy(n), request_id=f"r{i}")
                for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))
            )
        )
    finally:
        await engine.close()
    for prompt, n, out in zip(prompts, lengths, outputs, strict=True):
        assert out.output_ids == generate_reference(reference, prompt, n)
        assert out.finish_reason == FinishReason.LENGTH
        assert out.policy_versions == [0] * n
        assert_logprobs_match(reference, prompt, out)


async def test_sampled_logprobs_are_the_raw_distribution(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    prompt = random_ids(20, seed=1)
    settings = [
        SamplingParams(max_new_tokens=30, temperature=1.0, seed=1),
        SamplingParams(
            max_new_tokens=30,
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            min_p=0.05,
            repetition_penalty=1.3,
            seed=2,
        ),
    ]
    outputs = await asyncio.gather(
        *(engine.generate(prompt, s, request_id=f"s{i}") for i, s in enumerate(settings))
    )
    for out in outputs:
        assert len(out.output_ids) == 30
        assert_logprobs_match(reference, prompt, out)


async def test_filters_that_leave_one_token_are_greedy(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    prompt = random_ids(15, seed=2)
    expected = generate_reference(reference, prompt, 20)
    narrow = [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}]
    outputs = await asyncio.gather(
        *(
            engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=i, **f), f"n{i}")
            for i, f in enumerate(narrow)
        )
    )
    assert [out.output_ids for out in outputs] == [expected] * len(narrow)


async def test_repetition_penalty_matches_generate(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    prompt = random_ids(10, seed=3)
    out = await engine.generate(prompt, greedy(40, repetition_penalty=1.5), "rp")
    assert out.output_ids == generate_reference(reference, prompt, 40, repetition_penalty=1.5)
    assert out.output_ids != generate_reference(reference, prompt, 40)


async def test_seeded_sampling_is_reproducible_with_batch_mates(engine: HfEngine) -> None:
    prompt = random_ids(12, seed=4)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7)
    alone = await engine.generate(prompt, sampling, "alone")
    mates = [
        engine.generate(random_ids(5 + i, seed=i), SamplingParams(max_new_tokens=25), f"m{i}")
        for i in range(3)
    ]
    together, *_ = await asyncio.gather(engine.generate(prompt, sampling, "together"), *mates)
    assert together.output_ids == alone.output_ids
    other_seed = SamplingParams(max_new_tokens=40, temperature=1.0, seed=8)
    assert (await engine.generate(prompt, other_seed, "other")).output_ids != alone.output_ids


async def test_on_tokens_hands_each_id_over_on_the_loop_as_it_is_sampled(
    engine: HfEngine,
) -> None:
    """Each request's runs join into its output ids, in order, one id a step, all before
    generate returns; batch mates and a request aborted midway included."""
    loop_thread = threading.get_ident()
    runs: dict[str, list[list[int]]] = {"a": [], "b": [], "cut": []}

    def on_tokens(name: str):
        def add(ids: list[int]) -> None:
            assert threading.get_ident() == loop_thread
            runs[name].append(ids)

        return add

    def generate(name: str, prompt_seed: int, sampling: SamplingParams):
        prompt = random_ids(6, seed=prompt_seed)
        return engine.generate(prompt, sampling, name, on_tokens=on_tokens(name))

    cut = asyncio.create_task(generate("cut", 3, greedy(LONG_TOKENS)))
    a, b = await asyncio.gather(
        generate("a", 1, greedy(20)),
        generate("b", 2, SamplingParams(max_new_tokens=30, temperature=1.0, seed=5)),
    )
    await engine.abort("cut")
    outputs = {"a": a, "b": b, "cut": await cut}
    assert outputs["cut"].finish_reason == FinishReason.ABORT
    for name, output in outputs.items():
        assert [i for run in runs[name] for i in run] == output.output_ids
        assert all(len(run) == 1 for run in runs[name])


async def test_stop_token_ends_the_turn(engine: HfEngine, reference: Qwen3ForCausalLM) -> None:
    prompt = random_ids(8, seed=5)
    full = generate_reference(reference, prompt, 30)
    # The first token that did not occur before it, past the first few.
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i])
    out = await engine.generate(prompt, greedy(30, stop_token_ids=(full[stop_at],)), "stop")
    assert out.output_ids == full[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP


async def test_stop_string_ends_the_turn_after_the_id_that_completes_it(
    engine: HfEngine, reference: Qwen3ForCausalLM, model_dir: Path
) -> None:
    """A stop string spelled by three ids ends the turn right after the last of them, and the
    output keeps every sampled id."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = random_ids(8, seed=5)
    full = generate_reference(reference, prompt, 40)
    stop = tokenizer.decode(full[10:13])
    # The first id whose text, with the ids before it, spells the stop string.
    stop_at = next(i for i in range(40) if stop in tokenizer.decode(full[: i + 1]))
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1 and stop_at <= 12
    out = await engine.generate(prompt, greedy(40, stop_strings=("never spelled", stop)), "s")
    assert out.output_ids == full[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP
    assert_logprobs_match(reference, prompt, out)
    with pytest.raises(InvalidArgumentError, match="stop_strings"):
        await engine.generate(prompt, greedy(4, stop_strings=("",)), "empty-stop")


async def test_model_eos_ids_end_the_turn(
    model_dir: Path, reference: Qwen3ForCausalLM, tmp_path: Path
) -> None:
    prompt = random_ids(8, seed=5)
    full = generate_reference(reference, prompt, 30)
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i])
    reference.generation_config.eos_token_id = [VOCAB_SIZE - 1, full[stop_at]]
    try:
        reference.save_pretrained(tmp_path)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path)
    finally:
        reference.generation_config.eos_token_id = None
    engine = await start_engine(tmp_path)
    try:
        out = await engine.generate(prompt, greedy(30), "eos")
    finally:
        await engine.close()
    assert out.output_ids == full[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP


async def test_length_limits(engine: HfEngine) -> None:
    out = await engine.generate(random_ids(4, seed=6), greedy(5), "short")
    assert (len(out.output_ids), out.finish_reason) == (5, FinishReason.LENGTH)
    near_limit = random_ids(MAX_MODEL_LEN - 3, seed=6)
    out = await engine.generate(near_limit, greedy(100), "long-prompt")
    assert (len(out.output_ids), out.finish_reason) == (3, FinishReason.LENGTH)


async def test_bad_requests_are_refused(engine: HfEngine) -> None:
    with pytest.raises(InvalidArgumentError, match=f"max_model_len={MAX_MODEL_LEN}"):
        await engine.generate(random_ids(MAX_MODEL_LEN, seed=0), greedy(1), "too-long")
    with pytest.raises(InvalidArgumentError, match=str(VOCAB_SIZE + 3)):
        await engine.generate([1, VOCAB_SIZE + 3], greedy(1), "bad-id")
    with pytest.raises(InvalidArgumentError, match="empty"):
        await engine.generate([], greedy(1), "empty")
    with pytest.raises(InvalidArgumentError, match=r"top_p=1\.5"):
        await engine.generate([1], SamplingParams(max_new_tokens=1, top_p=1.5), "bad-top-p")
    await engine.pause()
    pending = await submitted(engine, engine.generate([1, 2], greedy(3), "dup"))
    with pytest.raises(AlreadyExistsError, match="'dup'"):
        await engine.generate([3], greedy(3), "dup")
    await engine.resume()
    assert len((await pending).output_ids) == 3


async def test_requests_join_and_leave_while_others_run(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    long_prompt = random_ids(30, seed=7)
    long_task = await start_long(engine, reference, long_prompt, "long")
    short_prompts = [random_ids(n, seed=n) for n in (2, 9, 16)]
    shorts = await asyncio.gather(
        *(engine.generate(p, greedy(6), f"short{i}") for i, p in enumerate(short_prompts))
    )
    assert not long_task.done()  # the short ones neither waited for it nor for each other
    for prompt, out in zip(short_prompts, shorts, strict=True):
        assert out.output_ids == generate_reference(reference, prompt, 6)
    assert (await long_task).output_ids == generate_reference(reference, long_prompt, LONG_TOKENS)


async def test_abort_returns_the_partial_output(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    prompt = random_ids(10, seed=8)
    task = await start_long(engine, reference, prompt, "victim")
    await engine.abort("victim")
    out = await task
    assert out.finish_reason == FinishReason.ABORT
    assert 2 <= len(out.output_ids) < LONG_TOKENS
    expected = generate_reference(reference, prompt, len(out.output_ids))
    assert out.output_ids == expected
    assert_logprobs_match(reference, prompt, out)
    # A request still waiting ends with no tokens.
    await engine.pause()
    waiting = await submitted(engine, engine.generate(prompt, greedy(5), "queued"))
    await engine.abort("queued")
    out = await waiting
    assert (out.output_ids, out.finish_reason) == ([], FinishReason.ABORT)
    await engine.abort("no-such-request")  # ignored


async def test_cancelled_generate_frees_its_slot(engine: HfEngine) -> None:
    task = await submitted(engine, engine.generate(random_ids(5, seed=9), greedy(LONG_TOKENS), "c"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.pause()  # acknowledged after the abort was applied
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


async def test_close_aborts_pending_requests(model_dir: Path) -> None:
    engine = await start_engine(model_dir)
    await engine.pause()
    pending = await submitted(engine, engine.generate([1, 2, 3], greedy(5), "pending"))
    await engine.close()
    out = await pending
    assert (out.output_ids, out.finish_reason) == ([], FinishReason.ABORT)
    with pytest.raises(FailedPreconditionError, match="closed"):
        await engine.generate([1], greedy(1), "late")
    await engine.close()  # a second close is a no-op


async def test_a_request_that_cannot_be_sampled_fails_alone(
    engine: HfEngine, reference: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = RunningBatch.decode

    def nan_for_the_victim(batch):
        logits = decode(batch)
        for row, request in enumerate(batch.requests):
            if request.request_id == "victim" and len(request.output_ids) == 2:
                logits[row] = math.nan
        return logits

    monkeypatch.setattr(RunningBatch, "decode", nan_for_the_victim)
    prompts = [random_ids(6, seed=11), random_ids(9, seed=12)]
    victim, mate = await asyncio.gather(
        engine.generate(prompts[0], greedy(5), "victim"),
        engine.generate(prompts[1], greedy(5), "mate"),
        return_exceptions=True,
    )
    assert isinstance(victim, FailedPreconditionError) and "logits are NaN" in str(victim)
    assert mate.output_ids == generate_reference(reference, prompts[1], 5)
    assert engine.stats()["running"] == 0
    assert (await engine.generate(prompts[0], greedy(2), "after")).output_ids == (
        generate_reference(reference, prompts[0], 2)
    )


async def test_a_broken_worker_fails_every_caller_and_the_watch(
    engine: HfEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    watching = asyncio.create_task(engine.watch())

    def bug(requests, logits):
        raise RuntimeError("a bug in sampling")

    monkeypatch.setattr(engine._runner, "sample", bug)
    with pytest.raises(RuntimeError, match="a bug in sampling"):
        await engine.generate(random_ids(4, seed=13), greedy(3), "hits-the-bug")
    with pytest.raises(UnavailableError, match="worker failed: RuntimeError"):
        await watching
    with pytest.raises(UnavailableError, match="worker failed"):
        await engine.watch()  # at once, for a watch begun after the failure
    with pytest.raises(FailedPreconditionError, match="closed"):
        await engine.generate([1], greedy(1), "late")


@pytest.mark.parametrize("key", ["model_path", "max_model_len"])
def test_model_and_context_are_rollout_settings_only(key: str) -> None:
    """The service hands the engine rollout.model_path and rollout.max_model_len; an engine
    option repeating one is refused when the config loads, naming the setting to use."""
    with pytest.raises(ValidationError, match=rf"\['{key}'\].*set rollout\.{key} instead"):
        RolloutConfig(engine_options={key: 2048})


def test_batched_sampling_draws_each_row_from_its_own_filtered_distribution() -> None:
    # One batch mixing a greedy row with sampled rows of different temperatures and filters:
    # each row's empirical frequencies follow its own distribution.
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    settings = [
        SamplingParams(max_new_tokens=1, temperature=0.0),
        SamplingParams(max_new_tokens=1),
        SamplingParams(max_new_tokens=1, top_k=2),
        SamplingParams(max_new_tokens=1, top_p=0.8),
        SamplingParams(max_new_tokens=1, temperature=2.0, min_p=0.5),
    ]
    expected = [
        [1.0, 0, 0, 0, 0],
        [0.4, 0.3, 0.15, 0.1, 0.05],
        [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0],
        [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0],  # the head that first reaches 0.8
    ]
    tempered = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).sqrt()
    kept = torch.where(tempered >= 0.5 * tempered.max(), tempered, 0.0)
    expected.append((kept / kept.sum()).tolist())
    requests = [
        Request(
            request_id=str(row),
            session_id="",
            sampling=s,
            stop_token_ids=frozenset(),
            token_ids=[0],
            prompt_len=1,
            future=None,
            loop=None,
            generator=None if s.temperature == 0 else torch.Generator().manual_seed(row),
        )
        for row, s in enumerate(settings)
    ]
    draws = 4000
    counts = torch.zeros(len(settings), 5)
    for _ in range(draws):
        tokens, failed = next_tokens(logits.expand(len(settings), -1).clone(), requests)
        assert not failed
        counts[torch.arange(len(settings)), tokens] += 1
    torch.testing.assert_close(counts / draws, torch.tensor(expected), atol=0.03, rtol=0)


def test_a_row_with_nothing_to_sample_fails_alone() -> None:
    logits = torch.zeros(3, 4)
    logits[1] = -math.inf  # every token filtered out
    logits[2, 0] = math.nan
    requests = [
        Request(
            request_id=str(row),
            session_id="",
            sampling=SamplingParams(max_new_tokens=1),
            stop_token_ids=frozenset(),
            token_ids=[0],
            prompt_len=1,
            future=None,
            loop=None,
            generator=torch.Generator().manual_seed(row),
        )
        for row in range(3)
    ]
    tokens, failed = next_tokens(logits, requests)
    assert sorted(failed) == [1, 2]
    assert "no token left to sample" in str(failed[1])
    assert "logits are NaN" in str(failed[2])
    assert 0 <= int(tokens[0]) < 4
