"""The vLLM engine against a real vLLM server (its CUDA build) on a GPU, launched from
$TURNRL_VLLM_PYTHON (`server_engine_checks` says what each test checks). One server serves the
module; the last test launches and closes its own. tests/engines runs vLLM's CPU build."""

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollout_svc.engines.vllm import VllmEngine
from tests.gpu import server_engine_checks as checks
from tests.gpu.conftest import vllm_options

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(vllm_python, gpu_model_dir, max_model_len) -> AsyncIterator[VllmEngine]:
    engine = await VllmEngine.create(vllm_options(vllm_python), str(gpu_model_dir), max_model_len)
    try:
        yield engine
    finally:
        await engine.close()


async def test_logprobs_are_the_models(vllm, tokenizer, reference):
    await checks.check_logprobs_are_the_models(vllm, tokenizer, reference)


async def test_a_stop_token_ends_the_turn_and_stays_last(vllm, tokenizer):
    await checks.check_a_stop_token_ends_the_turn_and_stays_last(vllm, tokenizer)


async def test_abort_returns_the_tokens_so_far(vllm, tokenizer, max_model_len):
    await checks.check_abort_returns_the_tokens_so_far(vllm, tokenizer, max_model_len)


async def test_a_push_reaches_the_server_with_a_request_in_flight(
    vllm, tokenizer, reference, weight_sync_backend
):
    await checks.check_a_push_reaches_the_server_with_a_request_in_flight(
        vllm, tokenizer, reference, weight_sync_backend
    )


async def test_close_stops_the_server(vllm_python, gpu_model_dir, max_model_len):
    engine = await VllmEngine.create(vllm_options(vllm_python), str(gpu_model_dir), max_model_len)
    await checks.check_close_stops_the_server(engine)
