"""The vLLM engine on a real vLLM CPU server of the tiny model (`conftest.vllm_server`): greedy
generation against a transformers forward pass, abort, pause and resume, the requests it
refuses, a server with a shorter context, and the life of a server it launches."""

import asyncio
import os
import signal
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.server_process import start_server
from rollout_svc.engines.vllm import VLLM_SERVER_MODULE, VllmEngine, VllmEngineOptions
from tests.engines.conftest import launch_options
from tests.rollout_svc.test_rollout_service import teacher_forced_logprobs
from tests.tiny_vlm import image_tokens, random_image
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)

pytestmark = pytest.mark.engines

# The tiny model samples no EOS greedily after this prompt (checked to 2,043 tokens): a request
# runs for as many tokens as it is given; LONG of them take seconds.
ENDLESS_PROMPT = [5, 17, 42, 99, 3]
LONG = 2000
# How long a LONG request decodes before the pause: a small part of the 5-10 s its tokens take
# here, so it has most of them to go. Nothing is asked of the server meanwhile: on two busy cores
# each call from the test's process (CPU-starved beside the server's) can take seconds, and a
# call that polled the running-requests gauge was seen to return only after the request ended.
DECODING_SECONDS = 0.5
# Tries at catching a LONG request while it runs (`paused_mid_request`).
ATTEMPTS = 6
# How long a paused request is watched to stay still.
STILL_SECONDS = 1.0
EOS_TOKEN_ID = 615  # the tiny model's


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


@pytest.fixture(scope="module")
def hf_model(vllm_server):
    return AutoModelForCausalLM.from_pretrained(vllm_server.model_path, dtype=torch.float32).eval()


async def generated_tokens_total(url: str) -> float:
    """The server's count of tokens generated so far (its Prometheus metrics)."""
    async with httpx.AsyncClient(trust_env=False) as client:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


async def test_greedy_generation_is_deterministic_and_matches_transformers(
    vllm_engine, vllm_server, hf_model
):
    prompt = [1, 2, 3, 4]  # greedy: 40 tokens, then EOS
    first = await vllm_engine.generate(prompt, greedy(64), "greedy-1")
    second = await vllm_engine.generate(prompt, greedy(64), "greedy-2")
    assert first.output_ids == second.output_ids
    assert first.logprobs == second.logprobs
    assert len(first.output_ids) == len(first.logprobs) == len(first.policy_versions)
    assert first.finish_reason is FinishReason.STOP and first.output_ids[-1] == EOS_TOKEN_ID
    assert first.policy_versions == [0] * len(first.output_ids)
    assert first.metrics["prompt_tokens"] == len(prompt)
    expected = teacher_forced_logprobs(hf_model, prompt + first.output_ids)[len(prompt) - 1 :]
    assert torch.max(torch.abs(torch.tensor(first.logprobs) - expected)).item() < 1e-5
    # Greedy takes the most likely token at every step.
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + first.output_ids])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == first.output_ids
    # A stop token ends the turn where it is first sampled, and is kept.
    stop_id = first.output_ids[5]
    stopped = await vllm_engine.generate(
        prompt,
        SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=(stop_id,)),
        "stop",
    )
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == first.output_ids[: first.output_ids.index(stop_id) + 1]
    # A stop string of three tokens ends the turn after the one that completes it, and every
    # sampled id is kept, the stop string's too.
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_path)
    stop = tokenizer.decode(first.output_ids[10:13])
    stop_at = next(
        i
        for i in range(len(first.output_ids))
        if stop in tokenizer.decode(first.output_ids[: i + 1])
    )
    at_stop = await vllm_engine.generate(
        prompt,
        SamplingParams(max_new_tokens=64, temperature=0.0, stop_strings=("never spelled", stop)),
        "stop-string",
    )
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    assert at_stop.finish_reason is FinishReason.STOP
    assert at_stop.output_ids == first.output_ids[: stop_at + 1]
    assert at_stop.logprobs == first.logprobs[: stop_at + 1]


async def start_generating(engine: VllmEngine, request_id: str) -> asyncio.Task:
    """Starts a greedy request of ENDLESS_PROMPT; returns its task DECODING_SECONDS later.
    Whether the server has scheduled it by then, or finished it, is not certain on a busy
    machine, so the callers check that it is still running once paused and try again if not.
    (Awaiting a short request as a clock, or the server's running-requests gauge, was tried:
    on a loaded CI machine either answered only after the long request had ended.)"""
    task = asyncio.create_task(engine.generate(ENDLESS_PROMPT, greedy(LONG), request_id))
    await asyncio.sleep(DECODING_SECONDS)
    return task


async def paused_while_running(engine: VllmEngine, running: asyncio.Task) -> bool:
    """Pauses the server; whether `running` then stays unfinished for STILL_SECONDS (if not,
    the server is resumed)."""
    await engine.pause()
    # Nothing to await here: the check is that the request stays unfinished for a while.
    await asyncio.sleep(STILL_SECONDS)
    if not running.done():
        return True
    await engine.resume()
    return False


async def paused_mid_request(engine: VllmEngine, name: str) -> tuple[asyncio.Task, str]:
    """A request paused while it generates: its task and request_id, the engine paused, and
    checked to stay still. Whether the pause lands before the request's LONG tokens are done
    is the server's speed against its HTTP answers on a busy machine, so a request that ends
    first is tried again with another."""
    for attempt in range(ATTEMPTS):
        request_id = f"{name}-{attempt}"
        running = await start_generating(engine, request_id)
        if await paused_while_running(engine, running):
            return running, request_id
    pytest.fail(f"{ATTEMPTS} requests of {LONG} tokens ended before the pause landed")


async def test_abort_ends_a_running_request_with_its_tokens_so_far(vllm_engine, vllm_server):
    for attempt in range(ATTEMPTS):
        running, request_id = await paused_mid_request(vllm_engine, f"long{attempt}")
        try:
            await vllm_engine.abort(request_id)
            aborted = await asyncio.wait_for(running, timeout=30)
        finally:
            await vllm_engine.resume()
        assert aborted.finish_reason is FinishReason.ABORT
        if aborted.output_ids:
            break  # else the server had not scheduled it before the pause (see start_generating)
    assert 0 < len(aborted.output_ids) < LONG
    assert len(aborted.logprobs) == len(aborted.output_ids)
    reference = await vllm_engine.generate(ENDLESS_PROMPT, greedy(len(aborted.output_ids)), "ref")
    assert reference.output_ids == aborted.output_ids
    assert vllm_engine.stats()["aborted_total"] == attempt + 1
    await vllm_engine.abort(request_id)  # no longer running: left alone


async def test_abort_reaches_only_this_clients_request_of_that_id(vllm_server, vllm_engine):
    """Two clients of one server may use one request_id; each request gets its own name."""
    other = await VllmEngine.create(
        vllm_server.engine_options(), vllm_server.model_path, vllm_server.max_model_len
    )
    try:
        for attempt in range(ATTEMPTS):
            request_id = f"same-id-{attempt}"
            theirs = asyncio.create_task(other.generate(ENDLESS_PROMPT, greedy(LONG), request_id))
            mine = await start_generating(vllm_engine, request_id)
            # Both paused (a pause is the server's) before the abort, so neither ends first.
            if await paused_while_running(vllm_engine, mine):
                break
            await theirs
        else:
            pytest.fail(f"{ATTEMPTS} requests of {LONG} tokens ended before the pause landed")
        try:
            await vllm_engine.abort(request_id)
            mine_output = await asyncio.wait_for(mine, timeout=60)
        finally:
            await vllm_engine.resume()
        their_output = await asyncio.wait_for(theirs, timeout=60)
        assert mine_output.finish_reason is FinishReason.ABORT
        assert their_output.finish_reason is FinishReason.LENGTH
        assert len(their_output.output_ids) == LONG
    finally:
        await other.close()


async def test_pause_keeps_a_request_waiting_and_resume_finishes_it(vllm_engine, vllm_server):
    reference = await vllm_engine.generate(ENDLESS_PROMPT, greedy(LONG), "reference")
    running, _ = await paused_mid_request(vllm_engine, "paused")
    assert vllm_engine.stats()["paused"] == 1.0
    await vllm_engine.resume()
    resumed = await asyncio.wait_for(running, timeout=60)
    # Paused while it decoded (or, on a slow machine, before it was scheduled), it keeps its
    # tokens and KV and goes on exactly as if never paused.
    assert resumed.finish_reason is FinishReason.LENGTH
    assert resumed.output_ids == reference.output_ids
    differences = [abs(a - b) for a, b in zip(resumed.logprobs, reference.logprobs, strict=True)]
    assert max(differences) < 1e-5


async def test_resume_after_a_broken_push_aborts_the_requests_in_flight(vllm_engine, vllm_server):
    running, _ = await paused_mid_request(vllm_engine, "in-flight")
    await vllm_engine.begin_weight_update(1)  # and no update completes it
    await vllm_engine.resume()
    with pytest.raises(FailedPreconditionError, match="broken push to version 1"):
        await asyncio.wait_for(running, timeout=30)
    with pytest.raises(FailedPreconditionError, match="broken push to version 1"):
        await vllm_engine.generate([5, 6], greedy(2), "after")
    assert vllm_engine.broken_push_version == 1
    assert vllm_engine.stats()["running_requests"] == 0.0


async def test_prompts_the_engine_or_the_server_refuse(vllm_engine, vllm_server):
    too_long = [5] * vllm_server.max_model_len
    with pytest.raises(InvalidArgumentError, match=r"prompt of 2048 tokens .* max_model_len=2048"):
        await vllm_engine.generate(too_long, greedy(1), "too-long")
    with pytest.raises(InvalidArgumentError, match="input_ids is empty"):
        await vllm_engine.generate([], greedy(1), "empty")
    with pytest.raises(InvalidArgumentError, match="Token id 99999 is out of vocabulary"):
        await vllm_engine.generate([1, 99999], greedy(1), "bad-id")
    # Images for a text model: the server refuses their content parts (the rollout service
    # refuses them before, tests/rollout_svc/test_rollout_images.py).
    image = random_image(1, (1, 2, 4), seed=0)
    with pytest.raises(InvalidArgumentError, match="vLLM"):
        await vllm_engine.generate([1, *image_tokens(image)], greedy(1), "image", images=[image])
    # A prompt one short of the context gets the one token there is room for.
    last = await vllm_engine.generate(too_long[:-1], greedy(10), "last-token")
    assert last.finish_reason is FinishReason.LENGTH and len(last.output_ids) == 1


async def test_a_request_id_already_running_is_refused(vllm_engine):
    running = asyncio.create_task(vllm_engine.generate(ENDLESS_PROMPT, greedy(200), "twice"))
    await asyncio.sleep(0)  # lets it send its request
    try:
        with pytest.raises(InvalidArgumentError, match="request_id 'twice' is already running"):
            await vllm_engine.generate([5], greedy(1), "twice")
    finally:
        await vllm_engine.abort("twice")
        await running  # aborted, or done if the abort came before the server had it


async def test_the_deadline_aborts_the_request_on_the_server(vllm_server):
    engine = await VllmEngine.create(
        vllm_server.engine_options(request_timeout_seconds=1.0),
        vllm_server.model_path,
        vllm_server.max_model_len,
    )
    try:
        with pytest.raises(
            DeadlineExceededError, match=r"did not answer POST /inference/v1/generate within 1 s"
        ):
            await engine.generate(ENDLESS_PROMPT, greedy(LONG), "slow")
        # The server stops generating for it, long before its LONG tokens.
        stopped = await generated_tokens_total(vllm_server.url)
        await asyncio.sleep(1.0)
        assert await generated_tokens_total(vllm_server.url) == stopped
    finally:
        await engine.close()


async def test_a_server_with_a_shorter_context_is_refused(vllm_server):
    with pytest.raises(InvalidArgumentError, match=r"context of 2048 tokens, less than .*=2049"):
        await VllmEngine.create(
            vllm_server.engine_options(), vllm_server.model_path, vllm_server.max_model_len + 1
        )


async def test_the_watch_reports_a_launched_server_that_dies():
    """A process in the launched server's place (a real one takes a minute to start): the
    watch raises once its process group is killed, and close stops what is left."""
    options = VllmEngineOptions(launch=launch_options(sys.executable))
    process, url = await start_server(
        options.launch.model_copy(
            update={"command": (sys.executable, "-c", "import time; time.sleep(600)")}
        ),
        VLLM_SERVER_MODULE,
        [],
    )
    engine = VllmEngine(options, "m", 64, url, process)
    try:
        watching = asyncio.create_task(engine.watch())
        await asyncio.sleep(0.2)
        assert not watching.done()
        os.killpg(process.pid, signal.SIGKILL)
        with pytest.raises(
            UnavailableError, match=r"vLLM server at .*: process \d+ exited with code -9"
        ):
            await asyncio.wait_for(watching, timeout=30)
    finally:
        await engine.close()


async def test_launch_reports_a_server_that_exits_during_start_up():
    launch = launch_options(sys.executable).model_copy(
        update={"command": (sys.executable, "-c", "import sys; sys.exit(3)")}
    )
    with pytest.raises(UnavailableError, match="exited with code 3 before it became healthy"):
        await VllmEngine.create(VllmEngineOptions(launch=launch), "m", 64)


def test_options_need_exactly_one_server():
    with pytest.raises(ValueError, match="exactly one of url"):
        VllmEngineOptions()
    with pytest.raises(ValueError, match="must start with http"):
        VllmEngineOptions(url="127.0.0.1:8000")
