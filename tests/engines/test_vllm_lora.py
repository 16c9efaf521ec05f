"""LoRA adapters pushed (`WeightPusher.push(..., adapter=...)`) into a real vLLM CPU server
started with `engine_options.lora`, through a real rollout service on the vLLM engine: what the
server then samples is the peft model of base + adapter, a second adapter replaces the first,
whole weights pushed after them replace the adapter too, and the tokens carry each push's
version. The server is one of its own, as LoRA changes how
vLLM runs the model (no compilation, LoRA layers), and the other tests compare with the shared
server's plain runs."""

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from rollout_svc.engines.vllm import VllmEngine, VllmEngineOptions, lora_server_flags
from tests.engines.conftest import SERVER_MAX_MODEL_LEN, VllmServer, launched_engine_options
from tests.engines.test_vllm_weights import EXACT, greedy_trajectory, logprob_gap, vllm_replica
from tests.trainer_svc.test_weight_push import connected, load, packed
from tests.trainer_svc.test_weight_push_lora import ADAPTER, peft_model
from turnrl.v1 import common_pb2, rollout_pb2

pytestmark = pytest.mark.engines

LORA = {"max_rank": 8, "target_modules": ["q_proj", "v_proj"]}
WAIT_SECONDS = 30.0


@pytest.fixture
async def vllm_lora_server(vllm_python, tiny_model_dir) -> AsyncIterator[VllmServer]:
    """A vLLM server of the tiny model launched with LoRA (`engine_options.lora`) by the
    engine's own launch path; stopped at the end."""
    engine = await VllmEngine.create(
        launched_engine_options(vllm_python, lora=LORA), str(tiny_model_dir), SERVER_MAX_MODEL_LEN
    )
    try:
        yield VllmServer(engine.url, str(tiny_model_dir), SERVER_MAX_MODEL_LEN)
    finally:
        await engine.close()


def model_versions(trajectory: common_pb2.Trajectory) -> set[int]:
    return {
        s.policy_version for s in trajectory.segments if s.source == common_pb2.SEGMENT_SOURCE_MODEL
    }


async def served_models(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as http:
        reply = await http.get("/v1/models")
    return [model["id"] for model in reply.json()["data"]]  # adapters' have no max_model_len


async def wait_until_unloaded(url: str, adapter_name: str) -> None:
    async with asyncio.timeout(WAIT_SECONDS):
        # The engine unloads a replaced adapter in the background, with no event to wait on.
        while adapter_name in await served_models(url):  # noqa: ASYNC110
            await asyncio.sleep(0.1)


async def test_vllm_samples_base_plus_each_pushed_adapter_until_whole_weights_replace_it(
    vllm_lora_server,
):
    base = load(vllm_lora_server.model_path)
    first, first_tensors = peft_model(vllm_lora_server.model_path, seed=1)
    second, second_tensors = peft_model(vllm_lora_server.model_path, seed=2)
    perturbed = load(vllm_lora_server.model_path, noise_seed=5)
    async with (
        vllm_replica(vllm_lora_server, lora=LORA) as stub,
        connected([stub], "grpc") as pusher,
    ):
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        assert stats.loads_lora_adapters
        result = await pusher.push(packed(first_tensors), 1, adapter=ADAPTER)
        assert result.policy_versions == [1]
        with_first = await greedy_trajectory(stub)
        await pusher.push(packed(second_tensors), 2, adapter=ADAPTER)
        with_second = await greedy_trajectory(stub)
        await wait_until_unloaded(vllm_lora_server.url, "turnrl-v1")
        assert "turnrl-v2" in await served_models(vllm_lora_server.url)
        await pusher.push(packed(perturbed.state_dict()), 3)
        with_whole = await greedy_trajectory(stub)
        await wait_until_unloaded(vllm_lora_server.url, "turnrl-v2")
    assert logprob_gap(with_first, first) < EXACT < logprob_gap(with_first, base)
    # base + second, not base + first + second.
    assert logprob_gap(with_second, second) < EXACT < logprob_gap(with_second, first)
    assert logprob_gap(with_whole, perturbed) < EXACT
    assert [model_versions(t) for t in (with_first, with_second, with_whole)] == [{1}, {2}, {3}]


async def test_a_vllm_engine_without_lora_options_refuses_adapters_and_names_the_settings():
    engine = VllmEngine(
        VllmEngineOptions(url="http://127.0.0.1:1"), "model", 64, "http://127.0.0.1:1"
    )
    try:
        assert "engine_options.lora" in engine.lora_adapters_refusal
        assert "trainer.lora.push: merged" in engine.lora_adapters_refusal
    finally:
        await engine.close()


def test_lora_flags_round_the_rank_up_to_one_vllm_takes():
    assert lora_server_flags(None) == []
    assert lora_server_flags(VllmEngineOptions(url="http://h", lora={"max_rank": 4}).lora) == [
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
    ]  # fmt: skip
