"""Weight updates of the hf engine, on the tiny random Qwen3 of hf_engine_fixtures: a pause,
an update and a resume switch a running request to the new weights between two tokens; a bad
update changes nothing; a push received into the parameters' own buffer is the load; an
update that does not complete refuses generation until one does."""

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from rollout_svc.engines.hf import HfEngine
from tests.rollout_svc.hf_engine_fixtures import (
    LOGPROB_TOLERANCE,
    LONG_TOKENS,
    assert_logprobs_match,
    generate_reference,
    greedy,
    random_ids,
    start_engine,
    start_long,
    teacher_forced_logprobs,
)
from tests.rollout_svc.hf_engine_fixtures import engine as engine
from tests.rollout_svc.hf_engine_fixtures import model_dir as model_dir
from tests.rollout_svc.hf_engine_fixtures import one_torch_thread as one_torch_thread
from tests.rollout_svc.hf_engine_fixtures import reference as reference
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.weights import TensorMeta


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


async def test_an_update_that_does_not_complete_refuses_generation(
    model_dir: Path, reference: Qwen3ForCausalLM, perturbed: dict[str, torch.Tensor]
) -> None:
    prompt = random_ids(9, seed=42)
    engine = await start_engine(model_dir)
    try:
        in_flight = asyncio.create_task(engine.generate(prompt, greedy(LONG_TOKENS), "flying"))
        await engine.pause()
        await engine.begin_weight_update(policy_version=1)
        # One bucket of the update lands, then the push breaks off.
        await engine.update_weights(list(perturbed.items())[:1], policy_version=0)
        assert engine.broken_push_version is None  # paused: the update may still complete
        assert engine.stats()["weights_incomplete"] == 1.0
        await engine.resume()
        assert engine.broken_push_version == 1
        with pytest.raises(FailedPreconditionError, match="broken push to version 1; push again"):
            await in_flight
        with pytest.raises(FailedPreconditionError, match="broken push to version 1"):
            await engine.generate(prompt, greedy(4), "refused")
        await engine.pause()
        await engine.update_weights(perturbed.items(), policy_version=1)
        await engine.resume()
        assert (engine.broken_push_version, engine.stats()["weights_incomplete"]) == (None, 0.0)
        out = await engine.generate(prompt, greedy(10), "whole")
    finally:
        await engine.close()
    assert out.output_ids == generate_reference(reference, prompt, 10)
    assert out.policy_versions == [1] * 10
