"""The SGLang engine adapter against a stand-in SGLang server that it connects to by URL
(`sglang_stand_in.py`): the bodies it sends, the ids, logprobs and versions it returns, aborts,
pauses and weight pushes, and how the server's refusals and failures reach the caller. Servers
the adapter launches itself, or loses: test_sglang_engine_launch.py."""

import asyncio
import contextlib
import functools
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from rollout_svc.engines.sglang_api import sglang_rid
from tests.rollout_svc import weight_sender
from tests.rollout_svc.sglang_stand_in import (
    MAX_MODEL_LEN,
    MODEL_PATH,
    WAIT_SECONDS,
    SglangStandIn,
    continuation,
    engine_options,
    token_logprob,
)
from tests.tool_svc.http_stand_in import serve_app
from turnrl.config import REPO_ROOT
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from turnrl.weights import TensorMeta


@pytest.fixture
async def stand_in() -> AsyncIterator[SglangStandIn]:
    server = SglangStandIn()
    async with serve_app(server.app()) as url:
        server.url = url
        try:
            yield server
        finally:
            await server.abort_everything()  # uvicorn waits for open requests on shutdown
            server.leave_groups()


@pytest.fixture
async def engine(stand_in: SglangStandIn) -> AsyncIterator[SglangEngine]:
    engine = await SglangEngine.create(
        SglangEngineOptions(url=stand_in.url, **engine_options()), MODEL_PATH, MAX_MODEL_LEN
    )
    try:
        yield engine
    finally:
        await engine.close()


async def test_generate_sends_token_ids_and_returns_ids_with_logprobs(stand_in, engine):
    sampling = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=0, seed=11)
    output = await engine.generate([5, 17, 42], sampling, request_id="r1")

    expected = continuation([5, 17, 42], 4)
    assert output.output_ids == expected
    assert output.logprobs == [token_logprob(token) for token in expected]
    assert output.policy_versions == [0, 0, 0, 0]
    assert output.finish_reason is FinishReason.LENGTH
    assert output.metrics == {
        "prompt_tokens": 3.0,
        "cached_prompt_tokens": 0.0,
        "latency_seconds": 0.25,
    }
    assert stand_in.bodies("/generate") == [
        {
            "rid": "2:r1",  # sglang_rid: the length first
            "input_ids": [5, 17, 42],
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "stop_token_ids": [],
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "sampling_seed": 11,
            },
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
    ]
    assert engine.stats()["generated_tokens_total"] == 4.0


async def test_stop_token_ends_the_turn_and_is_kept(stand_in, engine):
    stop_id = continuation([7], 3)[-1]
    sampling = SamplingParams(max_new_tokens=50, stop_token_ids=(stop_id,), top_k=20)
    output = await engine.generate([7], sampling, request_id="r-stop")
    assert output.finish_reason is FinishReason.STOP
    assert output.output_ids == continuation([7], 3)
    assert output.output_ids[-1] == stop_id
    sent = stand_in.bodies("/generate")[0]["sampling_params"]
    assert sent["stop_token_ids"] == [stop_id]
    assert sent["top_k"] == 20
    assert "sampling_seed" not in sent


async def test_stop_string_ends_the_turn_and_its_tokens_are_kept(stand_in, engine):
    """The counter model spells token t "<t>": a stop string across two tokens ends the turn
    after the second, which comes back with the rest."""
    expected = continuation([7], 4)
    stop = f"{expected[2]}><{expected[3]}"
    sampling = SamplingParams(max_new_tokens=50, stop_strings=("never spelled", stop))
    output = await engine.generate([7], sampling, request_id="r-stop-string")
    assert output.finish_reason is FinishReason.STOP
    assert output.output_ids == expected
    assert output.logprobs == [token_logprob(token) for token in expected]
    sent = stand_in.bodies("/generate")[0]["sampling_params"]
    assert sent["stop"] == ["never spelled", stop] and sent["no_stop_trim"] is True


async def test_next_turn_of_a_session_reuses_the_cached_prefix(stand_in, engine):
    first = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3), "turn-1", "s1")
    second_input = [1, 2, 3, *first.output_ids, 9, 8]
    second = await engine.generate(second_input, SamplingParams(max_new_tokens=2), "turn-2", "s1")
    assert second.metrics["cached_prompt_tokens"] == 6.0
    assert second.output_ids == continuation(second_input, 2)
    await engine.end_session("s1")  # the radix cache needs no freeing: nothing is sent
    assert stand_in.paths() == [
        "/health_generate",
        "/get_model_info",
        "/get_server_info",
        "/generate",
        "/generate",
    ]


async def test_abort_returns_the_tokens_sampled_so_far(stand_in, engine):
    stand_in.hold_at_tokens = 3
    task = asyncio.create_task(engine.generate([4], SamplingParams(max_new_tokens=100), "r-ab"))
    await stand_in.wait_until(lambda: stand_in.decoded(sglang_rid("r-ab")) == 3)
    await engine.abort("r-ab")
    output = await task
    assert output.finish_reason is FinishReason.ABORT
    assert output.output_ids == continuation([4], 3)
    assert len(output.logprobs) == len(output.policy_versions) == 3
    assert stand_in.bodies("/abort_request") == [{"rid": sglang_rid("r-ab")}]
    assert engine.stats()["aborted_total"] == 1.0


async def test_abort_of_a_request_not_running_sends_nothing(stand_in, engine):
    await engine.abort("never-started")
    assert "/abort_request" not in stand_in.paths()


@contextlib.asynccontextmanager
async def weight_group(
    engine: SglangEngine,
    specs: list[str],
    name: str = "g",
    layout: str = "per_tensor",
    die_after_buckets: int | None = None,
) -> AsyncIterator[dict[str, torch.Tensor]]:
    """A real gloo weight-sync group that the stand-in server joins, its rank 0 a process
    (`weight_sender`) that broadcasts the tensors `specs` name once the server receives them
    (or dies after `die_after_buckets` buckets of 2 KiB); yields those tensors, and checks the
    sender's exit."""
    command = weight_sender.command(
        name, specs, layout=layout, bucket_size=2048, die_after_buckets=die_after_buckets
    )
    sender = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        port = int(await sender.stdout.readline())
        await engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo", name, WAIT_SECONDS)
        yield weight_sender.sent_tensors(specs)
        async with asyncio.timeout(WAIT_SECONDS):
            exit_code = 0 if die_after_buckets is None else weight_sender.DIED
            assert await sender.wait() == exit_code
    finally:
        if sender.returncode is None:
            sender.kill()
            await sender.wait()


async def test_pause_holds_a_request_across_a_weight_push(stand_in, engine):
    stand_in.hold_at_tokens = 2
    task = asyncio.create_task(engine.generate([3], SamplingParams(max_new_tokens=5), "r-push"))
    await stand_in.wait_until(lambda: stand_in.decoded(sglang_rid("r-push")) == 2)

    await engine.pause()
    await stand_in.release()
    specs = [
        "model.embed_tokens.weight:bfloat16:100x8", "model.norm.weight:float32:8",
        "lm_head.weight:bfloat16:100x8",
    ]  # fmt: skip
    async with weight_group(engine, specs) as sent:
        metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in sent.items()]
        # Buckets of 2 KiB: the embedding and the norm travel together, the head apart.
        await engine.receive_weights("g", metas, 2048, "per_tensor", policy_version=1)
    assert stand_in.decoded(sglang_rid("r-push")) == 2  # paused: not one step in all that time
    assert engine.policy_version == 1
    await engine.resume()
    output = await task

    assert output.output_ids == continuation([3], 5)
    assert output.policy_versions == [0, 0, 1, 1, 1]
    assert output.finish_reason is FinishReason.LENGTH
    assert stand_in.weights.keys() == sent.keys()
    for name, tensor in sent.items():
        assert torch.equal(stand_in.weights[name], tensor), name
    assert stand_in.bodies("/pause_generation") == [{"mode": "retract"}]
    assert stand_in.bodies("/continue_generation") == [{}]
    (joined,) = stand_in.bodies("/init_weights_update_group")
    assert joined == {
        "master_address": "127.0.0.1", "master_port": joined["master_port"], "rank_offset": 1,
        "world_size": 2, "group_name": "g", "backend": "gloo",
    }  # fmt: skip
    assert stand_in.bodies("/update_weights_from_distributed") == [
        {
            "names": ["model.embed_tokens.weight", "model.norm.weight"],
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[100, 8], [8]],
            "group_name": "g",
            "flush_cache": False,
            "weight_version": "0",
        },
        {
            "names": ["lm_head.weight"],
            "dtypes": ["bfloat16"],
            "shapes": [[100, 8]],
            "group_name": "g",
            "flush_cache": True,
            "weight_version": "1",
        },
    ]


async def test_flattened_buckets_go_one_call_per_run_of_one_dtype(stand_in):
    options = SglangEngineOptions(
        url=stand_in.url, weight_layout="flattened_buckets", **engine_options()
    )
    engine = await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)
    specs = [
        "a:float32:8", "b:float32:4x2", "c:bfloat16:16", "d:float32:100x8",
    ]  # fmt: skip
    await engine.pause()
    async with weight_group(engine, specs, layout="flattened_buckets") as sent:
        metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in sent.items()]
        # Buckets of 2 KiB: a, b, c together (two runs), d alone.
        await engine.receive_weights("g", metas, 2048, "flattened_buckets", 1)
    await engine.close()
    bodies = stand_in.bodies("/update_weights_from_distributed")
    assert [(body["names"], body["load_format"]) for body in bodies] == [
        (["a", "b"], "flattened_bucket"), (["c"], "flattened_bucket"),
        (["d"], "flattened_bucket"),
    ]  # fmt: skip
    for name, tensor in sent.items():
        assert torch.equal(stand_in.weights[name], tensor), name


async def test_joining_a_new_group_leaves_the_last(stand_in, engine):
    await engine.pause()
    for name in ("first", "second"):
        async with weight_group(engine, ["w:float32:2"], name):
            await engine.update_weights_from_distributed(
                ["w"], ["float32"], [[2]], 1, group_name=name
            )
    assert set(stand_in.groups) == {"second"}
    assert stand_in.bodies("/destroy_weights_update_group") == [{"group_name": "first"}]


async def test_a_server_of_several_data_parallel_replicas_cannot_join(stand_in, engine):
    stand_in.data_parallel_size = 2
    engine = await SglangEngine.create(
        SglangEngineOptions(url=stand_in.url, **engine_options()), MODEL_PATH, MAX_MODEL_LEN
    )
    with pytest.raises(FailedPreconditionError, match="dp_size=2"):
        await engine.join_weight_sync("127.0.0.1", 1, 2, 1, "gloo", "g", WAIT_SECONDS)
    await engine.close()
    assert "/init_weights_update_group" not in stand_in.paths()


async def test_without_version_spans_every_token_gets_the_reported_version(stand_in, engine):
    stand_in.report_version_spans = False
    await engine.pause()
    async with weight_group(engine, ["w:float32:2"]):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 3, group_name="g")
    await engine.resume()
    output = await engine.generate([2], SamplingParams(max_new_tokens=3), "r-v")
    assert output.policy_versions == [3, 3, 3]


async def test_weight_update_is_checked_before_anything_is_sent(stand_in, engine):
    update = functools.partial(engine.update_weights_from_distributed, group_name="g")
    with pytest.raises(FailedPreconditionError, match="pause"):
        await update(["w"], ["float32"], [[2]], 1)
    await engine.pause()
    with pytest.raises(InvalidArgumentError, match="differ in length: 2, 1, 1"):
        await update(["w", "v"], ["float32"], [[2]], 1)
    with pytest.raises(InvalidArgumentError, match="'float33' is not a torch dtype"):
        await update(["w"], ["float33"], [[2]], 1)
    w = [TensorMeta("w", torch.float32, (2,))]
    with pytest.raises(FailedPreconditionError, match="not in weight-sync group 'g'"):
        await engine.receive_weights("g", w, 64, "per_tensor", 1)
    with pytest.raises(InvalidArgumentError, match="not flattened_buckets"):
        await engine.receive_weights("g", w, 64, "flattened_buckets", 1)
    with pytest.raises(InvalidArgumentError, match="not aligned_buckets"):
        await engine.receive_weights("g", w, 64, "aligned_buckets", 1)
    assert "/update_weights_from_distributed" not in stand_in.paths()


async def test_stale_version_is_refused(stand_in, engine):
    await engine.pause()
    async with weight_group(engine, ["w:float32:2"]):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 4, group_name="g")
    with pytest.raises(
        FailedPreconditionError, match="policy_version 3 is older than the loaded version 4"
    ):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 3, group_name="g")


async def test_weights_sent_without_a_group_go_by_disk(stand_in, engine):
    """PushWeights' path: a safetensors folder the server loads, then deleted."""
    await engine.pause()
    sent = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8))]
    await engine.update_weights(sent, policy_version=2)
    (body,) = stand_in.bodies("/update_weights_from_disk")
    assert (body["flush_cache"], body["weight_version"]) == (True, "2")
    assert not Path(body["model_path"]).exists()  # noqa: ASYNC240
    for name, tensor in sent:
        assert torch.equal(stand_in.weights[name], tensor), name
    assert engine.policy_version == 2


async def test_weight_update_without_a_group_reports_the_server_message(stand_in, engine):
    await engine.pause()
    with pytest.raises(FailedPreconditionError) as failure:
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 1, group_name="g")
    assert stand_in.url in str(failure.value)
    assert "Group g not in []. Please call `init_weights_update_group` first." in str(failure.value)
    assert engine.policy_version == 0


async def test_an_update_the_checkpoint_does_not_fit_is_refused_before_it_travels(
    stand_in, tiny_model_dir
):
    """With the rollout config's model_path a local folder, names and shapes are checked
    against its safetensors headers: the server receives nothing of a bad update."""
    options = SglangEngineOptions(url=stand_in.url, **engine_options())
    engine = await SglangEngine.create(options, str(tiny_model_dir), MAX_MODEL_LEN)
    await engine.pause()
    norm = TensorMeta("model.norm.weight", torch.float32, (3,))
    with pytest.raises(InvalidArgumentError, match=r"'model.norm.weight' has shape \[3\]"):
        engine.check_weights([norm])
    with pytest.raises(InvalidArgumentError, match=r"'model\.nope' is not a parameter"):
        engine.check_weights([TensorMeta("model.nope", torch.float32, (3,))])
    with pytest.raises(InvalidArgumentError, match="has shape"):
        await engine.receive_weights("g", [norm], 64, "per_tensor", 1)
    await engine.close()
    assert "/update_weights_from_distributed" not in stand_in.paths()


async def test_flush_cache_while_requests_run_is_a_failed_precondition(stand_in, engine):
    await engine.flush_cache()
    stand_in.hold_at_tokens = 1
    task = asyncio.create_task(engine.generate([6], SamplingParams(max_new_tokens=3), "r-fl"))
    await stand_in.wait_until(lambda: sglang_rid("r-fl") in stand_in.running)
    with pytest.raises(FailedPreconditionError, match="requests are running"):
        await engine.flush_cache()
    await stand_in.release()
    assert len((await task).output_ids) == 3


async def test_rejected_request_names_the_server_and_its_message(stand_in, engine):
    with pytest.raises(InvalidArgumentError) as rejected:
        sampling = SamplingParams(max_new_tokens=2, repetition_penalty=2.5)
        await engine.generate([5, 6], sampling, "r-penalty")
    message = str(rejected.value)
    assert stand_in.url in message
    assert "POST /generate: HTTP 400" in message
    assert "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 2.5." in message
    with pytest.raises(InvalidArgumentError, match="input_ids is empty"):
        await engine.generate([], SamplingParams(max_new_tokens=2), "r-empty")


async def test_prompt_with_no_room_under_max_model_len_is_refused_unsent(stand_in, engine):
    with pytest.raises(InvalidArgumentError, match=f"max_model_len={MAX_MODEL_LEN}"):
        await engine.generate([1] * MAX_MODEL_LEN, SamplingParams(max_new_tokens=2), "r-long")
    assert "/generate" not in stand_in.paths()


async def test_server_failure_on_generate_is_not_retried(stand_in, engine):
    stand_in.failures["/generate"] = [(503, "scheduler overloaded")]
    with pytest.raises(UnavailableError, match="HTTP 503 'scheduler overloaded'") as failure:
        await engine.generate([1], SamplingParams(max_new_tokens=2), "r-503")
    assert stand_in.url in str(failure.value)
    assert stand_in.paths().count("/generate") == 1


async def test_idempotent_call_is_retried_after_a_server_failure(stand_in, engine):
    stand_in.failures["/pause_generation"] = [(503, "busy")]
    await engine.pause()
    assert stand_in.paths().count("/pause_generation") == 2
    assert engine.stats()["paused"] == 1.0
    stand_in.failures["/continue_generation"] = [(500, "a"), (500, "b")]
    with pytest.raises(UnavailableError, match="HTTP 500 'b'"):
        await engine.resume()  # one retry allowed, both attempts failed


async def test_malformed_answer_is_an_internal_error(stand_in, engine):
    stand_in.failures["/generate"] = [(200, "no meta_info here")]
    with pytest.raises(RuntimeError, match="malformed answer to POST /generate"):
        await engine.generate([1], SamplingParams(max_new_tokens=2), "r-bad")


async def test_generate_past_its_deadline_is_aborted_on_the_server(stand_in):
    options = SglangEngineOptions(url=stand_in.url, **engine_options(request_timeout_seconds=0.3))
    engine = await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)
    try:
        stand_in.hold_at_tokens = 1
        with pytest.raises(
            DeadlineExceededError, match=r"did not answer POST /generate within 0\.3 s"
        ):
            await engine.generate([8], SamplingParams(max_new_tokens=9), "r-slow")
        assert stand_in.bodies("/abort_request") == [{"rid": sglang_rid("r-slow")}]
        assert engine.stats()["running_requests"] == 0.0
    finally:
        await engine.close()


async def test_cancelled_generate_is_aborted_on_the_server(stand_in, engine):
    stand_in.hold_at_tokens = 1
    task = asyncio.create_task(engine.generate([8], SamplingParams(max_new_tokens=9), "r-cancel"))
    await stand_in.wait_until(lambda: sglang_rid("r-cancel") in stand_in.running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stand_in.bodies("/abort_request") == [{"rid": sglang_rid("r-cancel")}]


async def test_start_waits_for_health_and_reads_the_weight_version(stand_in):
    stand_in.unhealthy_checks_left = 2
    stand_in.weight_version = "7"
    engine = await SglangEngine.create(
        SglangEngineOptions(url=stand_in.url, **engine_options()), MODEL_PATH, MAX_MODEL_LEN
    )
    await engine.close()
    assert stand_in.paths() == ["/health_generate"] * 3 + ["/get_model_info", "/get_server_info"]
    assert engine.policy_version == 7


async def test_server_never_healthy_fails_start_in_time(stand_in):
    stand_in.unhealthy_checks_left = 10**6
    options = SglangEngineOptions(url=stand_in.url, **engine_options(startup_timeout_seconds=0.5))
    with pytest.raises(DeadlineExceededError, match=r"was not healthy within 0\.5 s"):
        await SglangEngine.create(options, MODEL_PATH, MAX_MODEL_LEN)


async def test_embedding_model_is_refused(stand_in):
    stand_in.is_generation = False
    with pytest.raises(InvalidArgumentError, match="not a generation model"):
        await SglangEngine.create(
            SglangEngineOptions(url=stand_in.url, **engine_options()), MODEL_PATH, MAX_MODEL_LEN
        )
