"""The hf engine on a tiny random Qwen3 saved to disk: continuous batching must not change what a
request samples, logprobs must equal a teacher-forced forward pass, and sessions, aborts, pauses
and weight updates must keep both true."""

import asyncio
import re
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rollout_svc.engines.base import FinishReason, GenerateOutput, SamplingParams
from rollout_svc.engines.hf import HfEngine, HfEngineOptions
from turnrl.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from turnrl.weights import TensorMeta

VOCAB_SIZE = 512
MAX_MODEL_LEN = 512
# Long enough that a batch mate finishes and the test reacts while this one still runs.
LONG_TOKENS = 480
LOGPROB_TOLERANCE = 1e-4


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; OpenMP's threads crawl when another process is
    busy on the same cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with no EOS id, so greedy runs go to max_new_tokens."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(tiny_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Qwen3ForCausalLM:
    """The same model, loaded directly, to check the engine against."""
    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def start_engine(model_dir: Path, **options: object) -> HfEngine:
    return await HfEngine.create(
        HfEngineOptions(model_path=str(model_dir), max_model_len=MAX_MODEL_LEN, **options)
    )


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HfEngine]:
    engine = await start_engine(model_dir)
    yield engine
    await engine.close()


def random_ids(length: int, seed: int) -> list[int]:
    return torch.randint(
        0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def greedy(max_new_tokens: int, **sampling: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **sampling)


@torch.no_grad()
def generate_reference(
    model: Qwen3ForCausalLM, prompt: list[int], max_new_tokens: int, **kwargs: object
) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, **kwargs
    )
    return output[0, len(prompt) :].tolist()


@torch.no_grad()
def teacher_forced_logprobs(
    model: Qwen3ForCausalLM, prompt: list[int], output_ids: list[int]
) -> list[float]:
    logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def assert_logprobs_match(model: Qwen3ForCausalLM, prompt: list[int], out: GenerateOutput) -> None:
    expected = teacher_forced_logprobs(model, prompt, out.output_ids)
    assert out.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


async def submitted(
    engine: HfEngine, call: Coroutine[None, None, GenerateOutput]
) -> asyncio.Task[GenerateOutput]:
    """Starts a generate() call as a task and returns once the engine holds its request. The
    check below needs the engine paused or no other request about to finish."""
    before = engine.stats()
    task = asyncio.create_task(call)
    # generate() submits before its first await, so one pass of the loop runs it that far.
    await asyncio.sleep(0)
    after = engine.stats()
    assert after["waiting"] + after["running"] == before["waiting"] + before["running"] + 1
    return task


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


async def test_stop_token_ends_the_turn(engine: HfEngine, reference: Qwen3ForCausalLM) -> None:
    prompt = random_ids(8, seed=5)
    full = generate_reference(reference, prompt, 30)
    # The first token that did not occur before it, past the first few.
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i])
    out = await engine.generate(prompt, greedy(30, stop_token_ids=(full[stop_at],)), "stop")
    assert out.output_ids == full[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP


async def test_model_eos_ids_end_the_turn(
    model_dir: Path, reference: Qwen3ForCausalLM, tmp_path: Path
) -> None:
    prompt = random_ids(8, seed=5)
    full = generate_reference(reference, prompt, 30)
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i])
    reference.generation_config.eos_token_id = [VOCAB_SIZE - 1, full[stop_at]]
    try:
        reference.save_pretrained(tmp_path)
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


async def start_long(
    engine: HfEngine, model: Qwen3ForCausalLM, prompt: list[int], request_id: str
) -> asyncio.Task[GenerateOutput]:
    """Starts a greedy LONG_TOKENS request and returns once it has sampled at least 2 tokens:
    a 2-token probe queued behind it has finished (admission is first come, first served)."""
    task = await submitted(engine, engine.generate(prompt, greedy(LONG_TOKENS), request_id))
    probe_prompt = random_ids(3, seed=99)
    probe = await engine.generate(probe_prompt, greedy(2), f"{request_id}-probe")
    assert probe.output_ids == generate_reference(model, probe_prompt, 2)
    return task


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


@pytest.fixture
def perturbed(reference: Qwen3ForCausalLM) -> Iterator[dict[str, torch.Tensor]]:
    """New weights for every parameter, and the reference model holding them meanwhile."""
    original = {name: p.detach().clone() for name, p in reference.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    new = {n: p + 0.2 * torch.randn(p.shape, generator=generator) for n, p in original.items()}
    reference.load_state_dict(new, strict=False)
    yield new
    reference.load_state_dict(original, strict=False)


async def test_pause_update_weights_resume(
    model_dir: Path, reference: Qwen3ForCausalLM, perturbed: dict[str, torch.Tensor]
) -> None:
    old_model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = await start_engine(model_dir)
    try:
        await engine.generate(random_ids(6, seed=30), greedy(4), "warm", session_id="kept")
        assert engine.stats()["cached_sessions"] == 1
        prompt = random_ids(12, seed=31)
        task = await start_long(engine, old_model, prompt, "spanning")
        await engine.pause()
        before = engine.stats()
        await engine.update_weights(perturbed.items(), policy_version=1)
        after = engine.stats()
        # Nothing was decoded while paused; the running request waits to recompute its KV.
        assert after["tokens_generated"] == before["tokens_generated"]
        assert (before["running"], after["running"], after["waiting"]) == (1, 0, 1)
        assert (after["cached_sessions"], after["policy_version"]) == (0, 1)
        assert engine.policy_version == 1
        assert not task.done()
        await engine.resume()
        out = await task
    finally:
        await engine.close()
    switch = out.policy_versions.index(1)
    assert switch >= 2
    assert out.policy_versions == [0] * switch + [1] * (LONG_TOKENS - switch)
    old_part = out.output_ids[:switch]
    assert old_part == generate_reference(old_model, prompt, switch)
    assert out.logprobs[:switch] == pytest.approx(
        teacher_forced_logprobs(old_model, prompt, old_part), abs=LOGPROB_TOLERANCE
    )
    new_prompt = prompt + old_part
    new_part = out.output_ids[switch:]
    assert new_part == generate_reference(reference, new_prompt, LONG_TOKENS - switch)
    assert out.logprobs[switch:] == pytest.approx(
        teacher_forced_logprobs(reference, new_prompt, new_part), abs=LOGPROB_TOLERANCE
    )


async def test_bad_weight_updates_change_nothing(
    engine: HfEngine, reference: Qwen3ForCausalLM
) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    good = torch.zeros(128, 64)
    with pytest.raises(InvalidArgumentError, match=rf"{re.escape(name)}.*\(128, 64\).*\(64, 128\)"):
        await engine.update_weights([(name, good), (name, torch.zeros(64, 128))], policy_version=1)
    with pytest.raises(InvalidArgumentError, match=re.escape("'model.no_such.weight'")):
        await engine.update_weights([(name, good), ("model.no_such.weight", good)], 1)
    assert engine.policy_version == 0
    prompt = random_ids(9, seed=40)
    out = await engine.generate(prompt, greedy(10), "after")
    assert out.output_ids == generate_reference(reference, prompt, 10)


async def test_a_push_is_received_into_the_parameters_themselves(
    model_dir: Path, reference: Qwen3ForCausalLM, perturbed: dict[str, torch.Tensor]
) -> None:
    old_model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in perturbed.items()]
    prompt = random_ids(9, seed=41)
    engine = await start_engine(model_dir)
    try:
        await engine.pause()
        place = await engine.weight_buffer(metas, bucket_size_bytes=16 * 1024)
        assert place is not None and len(place.buckets) > 1
        assert await engine.weight_buffer(metas, bucket_size_bytes=16 * 1024) is place
        await engine.resume()
        # Moving the parameters into the layout kept their values.
        out = await engine.generate(prompt, greedy(10), "moved")
        assert out.output_ids == generate_reference(old_model, prompt, 10)
        await engine.pause()
        for index, meta in enumerate(metas):  # what the broadcast writes
            place.tensor(index).copy_(perturbed[meta.name])
        await engine.update_weights(place.named_tensors(), policy_version=1)
        await engine.resume()
        out = await engine.generate(prompt, greedy(10), "pushed")
        assert out.output_ids == generate_reference(reference, prompt, 10)
        assert_logprobs_match(reference, prompt, out)
        assert engine.policy_version == 1
        # The engine keeps its parameters as they are where the layout cannot be theirs.
        bf16 = [TensorMeta(m.name, torch.bfloat16, m.shape) for m in metas]
        assert await engine.weight_buffer(bf16, bucket_size_bytes=16 * 1024) is None
        assert await engine.weight_buffer(metas + metas[:1], bucket_size_bytes=16 * 1024) is None
        with pytest.raises(InvalidArgumentError, match="unknown parameter 'nope'"):
            await engine.weight_buffer([TensorMeta("nope", torch.float32, (2,))], 1024)
    finally:
        await engine.close()


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
