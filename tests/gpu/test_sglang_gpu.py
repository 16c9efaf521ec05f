"""The SGLang engine against a real SGLang server on a GPU, launched from $TURNRL_SGLANG_PYTHON
(`server_engine_checks` says what each test checks). One server serves the module; the last
test launches and closes its own."""

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollout_svc.engines.sglang import SglangEngine
from tests.gpu import server_engine_checks as checks
from tests.gpu.conftest import sglang_options

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sglang(sglang_python, gpu_model_dir, max_model_len) -> AsyncIterator[SglangEngine]:
    engine = await SglangEngine.create(
        sglang_options(sglang_python), str(gpu_model_dir), max_model_len
    )
    try:
        yield engine
    finally:
        await engine.close()


async def test_logprobs_are_the_models(sglang, tokenizer, reference):
    await checks.check_logprobs_are_the_models(sglang, tokenizer, reference)


async def test_a_stop_token_ends_the_turn_and_stays_last(sglang, tokenizer):
    await checks.check_a_stop_token_ends_the_turn_and_stays_last(sglang, tokenizer)


async def test_abort_returns_the_tokens_so_far(sglang, tokenizer, max_model_len):
    await checks.check_abort_returns_the_tokens_so_far(sglang, tokenizer, max_model_len)


async def test_a_push_reaches_the_server_with_a_request_in_flight(
    sglang, tokenizer, reference, weight_sync_backend
):
    await checks.check_a_push_reaches_the_server_with_a_request_in_flight(
        sglang, tokenizer, reference, weight_sync_backend
    )


async def test_close_stops_the_server(sglang_python, gpu_model_dir, max_model_len):
    engine = await SglangEngine.create(
        sglang_options(sglang_python), str(gpu_model_dir), max_model_len
    )
    await checks.check_close_stops_the_server(engine)
