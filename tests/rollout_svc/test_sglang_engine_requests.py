"""The SGLang engine's requests against the rules of SGLang 0.5.23, as the stand-in
(`sglang_stand_in`, `sglang_stand_in_checks`) reproduces them: the context its scheduler
admits, the requests it answers with HTTP 400, and aborts that end every request whose rid
starts with the one given."""

import asyncio

import httpx
import pytest

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from rollout_svc.engines.sglang_api import sglang_rid
from tests.rollout_svc.sglang_stand_in import (
    MAX_MODEL_LEN,
    MODEL_PATH,
    SglangStandIn,
    continuation,
    engine_options,
)
from tests.rollout_svc.test_sglang_engine import engine as engine
from tests.rollout_svc.test_sglang_engine import stand_in as stand_in
from tests.tool_svc.http_stand_in import serve_app
from turnrl.errors import InvalidArgumentError


async def test_a_server_whose_context_is_shorter_than_max_model_len_is_refused():
    server = SglangStandIn(context_length=MAX_MODEL_LEN - 1)
    async with serve_app(server.app()) as url:
        options = SglangEngineOptions(url=url, **engine_options())
        with pytest.raises(InvalidArgumentError) as refused:
            await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)
    message = str(refused.value)
    assert url in message
    assert f"serves a context of {MAX_MODEL_LEN - 1} tokens" in message
    assert f"--context-length {MAX_MODEL_LEN} or more" in message


async def test_requests_fit_what_a_server_of_max_model_len_admits():
    """A server whose context is max_model_len admits prompts up to 7 tokens shorter; the
    engine refuses longer ones unsent, and cuts max_new_tokens to the room left."""
    server = SglangStandIn(context_length=MAX_MODEL_LEN)
    async with serve_app(server.app()) as url:
        options = SglangEngineOptions(url=url, **engine_options())
        engine = await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)
        try:
            with pytest.raises(
                InvalidArgumentError, match="prompt of 58 tokens is longer than the 57"
            ):
                await engine.generate([1] * 58, SamplingParams(max_new_tokens=1), "r-long")
            assert "/generate" not in server.paths()
            output = await engine.generate([1] * 57, SamplingParams(max_new_tokens=50), "r-fits")
        finally:
            await engine.close()
    assert server.bodies("/generate")[0]["sampling_params"]["max_new_tokens"] == 7
    # SGLang ends it 2 tokens short of the context (max_req_len - 1 tokens in all).
    assert (len(output.output_ids), output.finish_reason) == (5, FinishReason.LENGTH)


def generate_body(input_length: int = 3, **sampling) -> dict:
    return {
        "rid": "r",
        "input_ids": list(range(1, input_length + 1)),
        "sampling_params": {"max_new_tokens": 2, **sampling},
    }


# (request, what 0.5.23 answers with HTTP 400) for a server of context 64.
REFUSED = [
    (generate_body(beam=2), "unknown field `beam`, expected one of `max_new_tokens`, `stop`"),
    (generate_body(64), "The input (64 tokens) is longer than the model's context length (64"),
    (
        generate_body(60, max_new_tokens=5),
        "Requested token count exceeds the model's maximum context length of 64 tokens. You "
        "requested a total of 65 tokens: 60 tokens from the input messages and 5 tokens",
    ),
    (generate_body(58), "Input length (58 tokens) exceeds the maximum allowed length (58 tokens)"),
    (generate_body(temperature=-0.5), "temperature must be a non-negative finite number"),
    (generate_body(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (generate_body(top_k=0), "top_k must be -1 (disable) or at least 1, got 0."),
    (generate_body(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (generate_body(repetition_penalty=0.0), "repetition_penalty must be in (0, 2]"),
    (generate_body(max_new_tokens=-1), "max_new_tokens must be at least 0, got -1."),
]


@pytest.mark.parametrize(("body", "message"), REFUSED)
async def test_the_stand_in_refuses_what_sglang_refuses_with_400(body, message):
    server = SglangStandIn(context_length=64)
    async with (
        serve_app(server.app()) as url,
        httpx.AsyncClient(base_url=url, trust_env=False) as client,
    ):
        response = await client.post("/generate", json=body)
    assert response.status_code == 400
    error = response.json()["error"]  # the API contract's is a string, the others an object
    assert message in (error if isinstance(error, str) else error["message"])


async def test_a_sampling_value_the_server_refuses_is_invalid_and_not_retried(stand_in, engine):
    with pytest.raises(InvalidArgumentError, match=r"HTTP 400 'min_p must be in \[0, 1\]"):
        await engine.generate([5], SamplingParams(max_new_tokens=2, min_p=1.5), "r-min-p")
    assert stand_in.paths().count("/generate") == 1


async def test_aborting_a_request_leaves_one_whose_id_starts_alike(stand_in, engine):
    stand_in.hold_at_tokens = 1
    short, longer = (
        asyncio.create_task(engine.generate([4], SamplingParams(max_new_tokens=3), request_id))
        for request_id in ("r1", "r10")
    )
    await stand_in.wait_until(
        lambda: stand_in.decoded(sglang_rid("r1")) == stand_in.decoded(sglang_rid("r10")) == 1
    )
    await engine.abort("r1")
    assert (await short).finish_reason is FinishReason.ABORT
    await stand_in.release()
    assert (await longer).output_ids == continuation([4], 3)


async def test_the_stand_in_aborts_by_rid_prefix_as_sglang_does(stand_in):
    stand_in.hold_at_tokens = 1
    body = generate_body(1)

    async def finish_reason(rid: str) -> str:
        response = await client.post("/generate", json={**body, "rid": rid})
        return response.json()["meta_info"]["finish_reason"]["type"]

    async with httpx.AsyncClient(base_url=stand_in.url, trust_env=False) as client:
        requests = {rid: asyncio.create_task(finish_reason(rid)) for rid in ("a1", "a10", "b")}
        await stand_in.wait_until(lambda: len(stand_in.running) == 3)
        await client.post("/abort_request", json={"rid": "a"})  # no request's rid: nothing
        assert not any(request.aborted for request in stand_in.running.values())
        await client.post("/abort_request", json={"rid": "a1"})  # "a1" and "a10"
        assert [await requests["a1"], await requests["a10"]] == ["abort", "abort"]
        assert not requests["b"].done()
        await client.post("/abort_request", json={"abort_all": True})
        assert await requests["b"] == "abort"


async def test_on_tokens_gets_the_whole_output_when_the_request_returns(stand_in, engine):
    runs: list[list[int]] = []
    sampling = SamplingParams(max_new_tokens=3)
    output = await engine.generate([4, 5], sampling, "r-runs", on_tokens=runs.append)
    assert runs == [output.output_ids] and output.output_ids
