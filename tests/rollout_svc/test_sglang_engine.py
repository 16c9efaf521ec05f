"""The SGLang engine adapter against a stand-in SGLang server.

SGLang needs a GPU, so `SglangStandIn` implements the request and response shapes of SGLang's
native HTTP API (`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`) on
loopback: a counter model decodes one token per step, answers [logprob, token_id, text]
triples and finish reasons, honours max_new_tokens and stop_token_ids, aborts by rid, pauses
and continues, takes weight-group calls, and records every request so tests check the bodies
the adapter sent. Run as a script, this module serves the stand-in on the --host and --port
it is given, which is how the launch tests stand in for `python -m sglang.launch_server`.
"""

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions, SglangLaunchOptions
from tests.tool_svc.http_stand_in import serve_app
from turnrl.config import REPO_ROOT
from turnrl.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)

VOCAB_SIZE = 1000
EOS_TOKEN_ID = VOCAB_SIZE - 1
WAIT_SECONDS = 10.0
# The keyword arguments of SGLang's SamplingParams that callers may set.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}  # fmt: skip


def next_token(previous: int) -> int:
    """The stand-in model: each token follows from the one before (never EOS)."""
    return (previous * 7 + 3) % EOS_TOKEN_ID


def token_logprob(token: int) -> float:
    return -((token % 10) + 1) / 10


def continuation(input_ids: list[int], length: int) -> list[int]:
    tokens = [input_ids[-1]]
    for _ in range(length):
        tokens.append(next_token(tokens[-1]))
    return tokens[1:]


@dataclass
class RunningRequest:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    # (version, output tokens so far) at each weight update while it ran, as SGLang records.
    version_changes: list[tuple[str, int]] = field(default_factory=list)


class SglangStandIn:
    """SGLang's native HTTP API shapes on a deterministic counter model (module docstring)."""

    def __init__(self, model_path: str = "stand-in/tiny-model", argv: list[str] | None = None):
        self.model_path = model_path
        self.argv = argv or []
        self.url = ""
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body)
        self.failures: dict[str, list[tuple[int, str]]] = {}  # path -> (status, message) first
        self.running: dict[str, RunningRequest] = {}
        self.hold_at_tokens: int | None = None  # requests wait there until release()
        self.pause_mode: str | None = None
        self.weight_version = "default"
        self.groups: set[str] = set()
        self.report_version_spans = True
        self.is_generation = True
        self.unhealthy_checks_left = 0
        self.sequences: list[list[int]] = []  # what the radix cache holds
        self._changed = asyncio.Condition()

    def app(self) -> Starlette:
        routes = {
            "/generate": self._generate,
            "/abort_request": self._abort_request,
            "/pause_generation": self._pause_generation,
            "/continue_generation": self._continue_generation,
            "/flush_cache": self._flush_cache,
            "/init_weights_update_group": self._init_weights_update_group,
            "/update_weights_from_distributed": self._update_weights_from_distributed,
            "/health_generate": self._health,
            "/get_model_info": self._model_info,
            "/get_server_info": self._server_info,
        }
        return Starlette(
            routes=[
                Route(path, self._recorded(path, handler), methods=["GET", "POST"])
                for path, handler in routes.items()
            ]
        )

    def decoded(self, rid: str) -> int:
        """Tokens the running request `rid` has so far; 0 when it is not running."""
        return len(self.running[rid].output_ids) if rid in self.running else 0

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    def bodies(self, path: str) -> list[Any]:
        return [body for _, recorded, body in self.requests if recorded == path]

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_SECONDS), self._changed:
            await self._changed.wait_for(condition)

    async def release(self) -> None:
        async with self._changed:
            self.hold_at_tokens = None
            self._changed.notify_all()

    async def abort_everything(self) -> None:
        async with self._changed:
            for request in self.running.values():
                request.aborted = True
            self._changed.notify_all()

    def _recorded(self, path: str, handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            raw = await request.body()
            body = await request.json() if raw else None
            self.requests.append((request.method, path, body))
            if self.failures.get(path):
                status, message = self.failures[path].pop(0)
                return JSONResponse({"error": {"message": message}}, status_code=status)
            return await handler(body)

        return endpoint

    async def _generate(self, body: dict) -> Response:
        problem = self._generate_problem(body)
        if problem:  # SGLang's _create_error_response
            return JSONResponse({"error": {"message": problem}}, status_code=400)
        input_ids, params = body["input_ids"], body["sampling_params"]
        request = RunningRequest(body["rid"])
        self.running[request.rid] = request
        try:
            finish_reason = await self._decode(request, input_ids, params)
        finally:
            del self.running[request.rid]
        cached = max((_common_prefix(input_ids, s) for s in self.sequences), default=0)
        self.sequences.append(input_ids + request.output_ids)
        meta_info = {
            "id": request.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(request.output_ids),
            "cached_tokens": min(cached, len(input_ids) - 1),
            "weight_version": self.weight_version,
            "e2e_latency": 0.25,
        }
        if body.get("return_logprob"):
            meta_info["output_token_logprobs"] = [
                [token_logprob(token), token, None] for token in request.output_ids
            ]
        if self.report_version_spans:
            meta_info["weight_versions"] = _version_spans(
                request.version_changes, self.weight_version, len(request.output_ids)
            )
        text = "".join(f"<{token}>" for token in request.output_ids)
        return JSONResponse(
            {"text": text, "output_ids": request.output_ids, "meta_info": meta_info}
        )

    def _generate_problem(self, body: dict) -> str | None:
        """What SGLang would reject in a generate request (the parts the adapter sends)."""
        input_ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not input_ids or not all(isinstance(token, int) for token in input_ids):
            return "input_ids must be a non-empty list of token ids"
        if bad := [token for token in input_ids if not 0 <= token < VOCAB_SIZE]:
            return f"Token id {bad[0]} is out of vocabulary (vocab size {VOCAB_SIZE})"
        if unknown := set(params) - SGLANG_SAMPLING_KEYS:
            return f"SamplingParams got an unexpected keyword argument {sorted(unknown)[0]!r}"
        top_k = params.get("top_k", -1)
        if top_k < 1 and top_k != -1:
            return f"top_k must be -1 (disable) or at least 1, got {top_k}."
        if not 0.0 < params.get("top_p", 1.0) <= 1.0 or params.get("temperature", 1.0) < 0:
            return "top_p must be in (0, 1] and temperature non-negative"
        if body.get("rid") in self.running:
            return f"Duplicate request ID: {body['rid']}"
        return None

    async def _decode(self, request: RunningRequest, input_ids: list[int], params: dict) -> dict:
        stop_ids = {EOS_TOKEN_ID, *(params.get("stop_token_ids") or [])}
        max_new_tokens = params.get("max_new_tokens", 128)
        previous = input_ids[-1]
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: request.aborted or self._may_decode(request))
                if request.aborted:
                    return {"type": "abort", "message": "Abort in running batch."}
                if len(request.output_ids) >= max_new_tokens:
                    return {"type": "length", "length": max_new_tokens}
                previous = next_token(previous)
                request.output_ids.append(previous)
                self._changed.notify_all()
            if previous in stop_ids:
                return {"type": "stop", "matched": previous}
            await asyncio.sleep(0)  # one decode step per loop turn, as a batch would interleave

    def _may_decode(self, request: RunningRequest) -> bool:
        held = self.hold_at_tokens is not None and len(request.output_ids) >= self.hold_at_tokens
        return self.pause_mode is None and not held

    async def _abort_request(self, body: dict) -> Response:
        async with self._changed:
            if body["rid"] in self.running:
                self.running[body["rid"]].aborted = True
                self._changed.notify_all()
        return Response(status_code=200)

    async def _pause_generation(self, body: dict | None) -> Response:
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return JSONResponse({"error": {"message": f"Invalid mode: {mode!r}"}}, 400)
        async with self._changed:
            if mode == "abort":
                for request in self.running.values():
                    request.aborted = True
            else:
                self.pause_mode = mode
            self._changed.notify_all()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, body: dict | None) -> Response:
        async with self._changed:
            self.pause_mode = None
            self._changed.notify_all()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    def _cache_in_use(self) -> bool:
        # Retracted requests free their KV cache; running or in-place paused ones hold it.
        return bool(self.running) and self.pause_mode != "retract"

    async def _flush_cache(self, body: None) -> Response:
        if self._cache_in_use():
            return PlainTextResponse("Cache not flushed: requests are running.\n", 400)
        self.sequences.clear()
        return PlainTextResponse("Cache flushed.\n")

    async def _init_weights_update_group(self, body: dict) -> Response:
        group_name = body.get("group_name", "weight_update_group")
        if group_name in self.groups:
            return _weight_sync_failure(f"Process group {group_name!r} already exists.")
        self.groups.add(group_name)
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    async def _update_weights_from_distributed(self, body: dict) -> Response:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            return _weight_sync_failure("names, dtypes and shapes differ in length")
        if body.get("group_name", "weight_update_group") not in self.groups:
            return _weight_sync_failure("The weight update group is not initialized.")
        if not all(isinstance(getattr(torch, dtype, None), torch.dtype) for dtype in dtypes):
            return _weight_sync_failure(f"Unknown dtype in {dtypes}")
        if body.get("flush_cache", True) and self._cache_in_use():
            return PlainTextResponse("AssertionError: Cache flush failed", 500)  # SGLang asserts
        async with self._changed:
            if (version := body.get("weight_version")) is not None:
                for request in self.running.values():
                    if request.output_ids:
                        request.version_changes.append(
                            (self.weight_version, len(request.output_ids))
                        )
                self.weight_version = version
            self._changed.notify_all()
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def _health(self, body: None) -> Response:
        if self.unhealthy_checks_left:
            self.unhealthy_checks_left -= 1
            return Response(status_code=503)
        return Response(status_code=200)

    async def _model_info(self, body: None) -> Response:
        return JSONResponse(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": self.is_generation,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _server_info(self, body: None) -> Response:
        return JSONResponse({"model_path": self.model_path, "argv": self.argv})


def _weight_sync_failure(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def _version_spans(changes: list[tuple[str, int]], current: str, count: int) -> list[dict]:
    """SGLang's meta_info["weight_versions"]: which version sampled which output tokens."""
    spans: list[dict] = []
    for version, end in [*changes, (current, count)]:
        start = spans[-1]["end"] if spans else 0
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        elif not spans or end > start:
            spans.append({"version": version, "start": start, "end": end})
    return spans


@pytest.fixture
async def stand_in() -> AsyncIterator[SglangStandIn]:
    server = SglangStandIn()
    async with serve_app(server.app()) as url:
        server.url = url
        try:
            yield server
        finally:
            await server.abort_everything()  # uvicorn waits for open requests on shutdown


def engine_options(**overrides: Any) -> dict:
    return {
        "startup_timeout_seconds": WAIT_SECONDS,
        "control_timeout_seconds": WAIT_SECONDS,
        "request_timeout_seconds": WAIT_SECONDS,
        "max_retries": 1,
        **overrides,
    }


@pytest.fixture
async def engine(stand_in: SglangStandIn) -> AsyncIterator[SglangEngine]:
    engine = await SglangEngine.create(SglangEngineOptions(url=stand_in.url, **engine_options()))
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
            "rid": "r1",
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


async def test_next_turn_of_a_session_reuses_the_cached_prefix(stand_in, engine):
    first = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3), "turn-1", "s1")
    second_input = [1, 2, 3, *first.output_ids, 9, 8]
    second = await engine.generate(second_input, SamplingParams(max_new_tokens=2), "turn-2", "s1")
    assert second.metrics["cached_prompt_tokens"] == 6.0
    assert second.output_ids == continuation(second_input, 2)
    await engine.end_session("s1")  # the radix cache needs no freeing: nothing is sent
    assert stand_in.paths() == ["/health_generate", "/get_model_info", "/generate", "/generate"]


async def test_abort_returns_the_tokens_sampled_so_far(stand_in, engine):
    stand_in.hold_at_tokens = 3
    task = asyncio.create_task(engine.generate([4], SamplingParams(max_new_tokens=100), "r-ab"))
    await stand_in.wait_until(lambda: stand_in.decoded("r-ab") == 3)
    await engine.abort("r-ab")
    output = await task
    assert output.finish_reason is FinishReason.ABORT
    assert output.output_ids == continuation([4], 3)
    assert len(output.logprobs) == len(output.policy_versions) == 3
    assert stand_in.bodies("/abort_request") == [{"rid": "r-ab"}]
    assert engine.stats()["aborted_total"] == 1.0


async def test_abort_of_a_request_not_running_sends_nothing(stand_in, engine):
    await engine.abort("never-started")
    assert "/abort_request" not in stand_in.paths()


async def test_pause_holds_a_request_across_a_weight_push(stand_in, engine):
    stand_in.hold_at_tokens = 2
    task = asyncio.create_task(engine.generate([3], SamplingParams(max_new_tokens=5), "r-push"))
    await stand_in.wait_until(lambda: stand_in.decoded("r-push") == 2)

    await engine.pause()
    await stand_in.release()
    await engine.init_weight_sync("10.0.0.1", 29500, rank_offset=1, world_size=2)
    names, shapes = ["model.embed_tokens.weight", "lm_head.weight"], [[1000, 64], [1000, 64]]
    await engine.update_weights_from_distributed(
        names, [torch.bfloat16, "bfloat16"], shapes, policy_version=1
    )
    assert stand_in.decoded("r-push") == 2  # paused: not one step in all that time
    assert engine.policy_version == 1
    await engine.resume()
    output = await task

    assert output.output_ids == continuation([3], 5)
    assert output.policy_versions == [0, 0, 1, 1, 1]
    assert output.finish_reason is FinishReason.LENGTH
    assert stand_in.bodies("/pause_generation") == [{"mode": "retract"}]
    assert stand_in.bodies("/continue_generation") == [{}]
    assert stand_in.bodies("/init_weights_update_group") == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "weight_update_group",
            "backend": "nccl",
        }
    ]
    assert stand_in.bodies("/update_weights_from_distributed") == [
        {
            "names": names,
            "dtypes": ["bfloat16", "bfloat16"],
            "shapes": shapes,
            "group_name": "weight_update_group",
            "flush_cache": True,
            "weight_version": "1",
        }
    ]


async def test_without_version_spans_every_token_gets_the_reported_version(stand_in, engine):
    stand_in.report_version_spans = False
    await engine.init_weight_sync("127.0.0.1", 29501, 1, 2, group_name="g")
    await engine.pause()
    await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 3, group_name="g")
    await engine.resume()
    output = await engine.generate([2], SamplingParams(max_new_tokens=3), "r-v")
    assert output.policy_versions == [3, 3, 3]


async def test_weight_update_is_checked_before_anything_is_sent(stand_in, engine):
    with pytest.raises(FailedPreconditionError, match="pause"):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 1)
    await engine.pause()
    with pytest.raises(InvalidArgumentError, match="differ in length: 2, 1, 1"):
        await engine.update_weights_from_distributed(["w", "v"], ["float32"], [[2]], 1)
    with pytest.raises(InvalidArgumentError, match="'float33' is not a torch dtype"):
        await engine.update_weights_from_distributed(["w"], ["float33"], [[2]], 1)
    assert "/update_weights_from_distributed" not in stand_in.paths()


async def test_stale_version_is_refused(stand_in, engine):
    await engine.init_weight_sync("127.0.0.1", 29502, 1, 2)
    await engine.pause()
    await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 4)
    with pytest.raises(
        FailedPreconditionError, match="policy_version 3 is older than the loaded version 4"
    ):
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 3)


async def test_weight_update_without_a_group_reports_the_server_message(stand_in, engine):
    await engine.pause()
    with pytest.raises(FailedPreconditionError) as failure:
        await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], 1)
    assert stand_in.url in str(failure.value)
    assert "The weight update group is not initialized." in str(failure.value)
    assert engine.policy_version == 0


async def test_tensor_updates_are_refused_with_the_distributed_way_named(engine):
    with pytest.raises(NotImplementedError, match="distributed group"):
        await engine.update_weights([("w", torch.zeros(2))], 1)


async def test_flush_cache_while_requests_run_is_a_failed_precondition(stand_in, engine):
    await engine.flush_cache()
    stand_in.hold_at_tokens = 1
    task = asyncio.create_task(engine.generate([6], SamplingParams(max_new_tokens=3), "r-fl"))
    await stand_in.wait_until(lambda: "r-fl" in stand_in.running)
    with pytest.raises(FailedPreconditionError, match="requests are running"):
        await engine.flush_cache()
    await stand_in.release()
    assert len((await task).output_ids) == 3


async def test_rejected_request_names_the_server_and_its_message(stand_in, engine):
    with pytest.raises(InvalidArgumentError) as rejected:
        await engine.generate([5, VOCAB_SIZE + 3], SamplingParams(max_new_tokens=2), "r-oov")
    message = str(rejected.value)
    assert stand_in.url in message
    assert "POST /generate: HTTP 400" in message
    assert f"Token id {VOCAB_SIZE + 3} is out of vocabulary" in message
    with pytest.raises(InvalidArgumentError, match="input_ids is empty"):
        await engine.generate([], SamplingParams(max_new_tokens=2), "r-empty")


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
    engine = await SglangEngine.create(options)
    try:
        stand_in.hold_at_tokens = 1
        with pytest.raises(
            DeadlineExceededError, match=r"did not answer POST /generate within 0\.3 s"
        ):
            await engine.generate([8], SamplingParams(max_new_tokens=9), "r-slow")
        assert stand_in.bodies("/abort_request") == [{"rid": "r-slow"}]
        assert engine.stats()["running_requests"] == 0.0
    finally:
        await engine.close()


async def test_cancelled_generate_is_aborted_on_the_server(stand_in, engine):
    stand_in.hold_at_tokens = 1
    task = asyncio.create_task(engine.generate([8], SamplingParams(max_new_tokens=9), "r-cancel"))
    await stand_in.wait_until(lambda: "r-cancel" in stand_in.running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stand_in.bodies("/abort_request") == [{"rid": "r-cancel"}]


async def test_server_gone_is_unavailable():
    server = SglangStandIn()
    async with serve_app(server.app()) as url:
        server.url = url
        engine = await SglangEngine.create(SglangEngineOptions(url=url, **engine_options()))
    try:
        with pytest.raises(UnavailableError, match="is unreachable for POST /generate") as failure:
            await engine.generate([1], SamplingParams(max_new_tokens=1), "r-gone")
        assert url in str(failure.value)
    finally:
        await engine.close()


async def test_start_waits_for_health_and_reads_the_weight_version(stand_in):
    stand_in.unhealthy_checks_left = 2
    stand_in.weight_version = "7"
    engine = await SglangEngine.create(SglangEngineOptions(url=stand_in.url, **engine_options()))
    await engine.close()
    assert stand_in.paths() == ["/health_generate"] * 3 + ["/get_model_info"]
    assert engine.policy_version == 7


async def test_server_never_healthy_fails_start_in_time(stand_in):
    stand_in.unhealthy_checks_left = 10**6
    options = SglangEngineOptions(url=stand_in.url, **engine_options(startup_timeout_seconds=0.5))
    with pytest.raises(DeadlineExceededError, match=r"was not healthy within 0\.5 s"):
        await SglangEngine.create(options)


async def test_embedding_model_is_refused(stand_in):
    stand_in.is_generation = False
    with pytest.raises(InvalidArgumentError, match="not a generation model"):
        await SglangEngine.create(SglangEngineOptions(url=stand_in.url, **engine_options()))


def test_options_need_exactly_one_server():
    with pytest.raises(ValueError, match="exactly one of url"):
        SglangEngineOptions()
    with pytest.raises(ValueError, match="exactly one of url"):
        SglangEngineOptions(url="http://127.0.0.1:1", launch={"model_path": "m"})
    with pytest.raises(ValueError, match="must start with http"):
        SglangEngineOptions(url="127.0.0.1:30000")


def stand_in_command() -> tuple[str, ...]:
    """Runs this module as the server script, importable from any working directory."""
    script = (
        f"import runpy, sys; sys.path.insert(0, {str(REPO_ROOT)!r}); "
        "runpy.run_module('tests.rollout_svc.test_sglang_engine', run_name='__main__')"
    )
    return (sys.executable, "-c", script)


async def test_launch_starts_the_server_with_its_arguments_and_stops_it():
    launch = SglangLaunchOptions(
        model_path="stand-in/launched",
        port=0,
        extra_args=("--tp-size", "1", "--mem-fraction-static", "0.5"),
        command=stand_in_command(),
    )
    # The stand-in script imports torch and starlette: seconds on a loaded machine.
    options = SglangEngineOptions(launch=launch, **engine_options(startup_timeout_seconds=120))
    engine = await SglangEngine.create(options)
    try:
        port = engine.url.rsplit(":", 1)[1]
        async with httpx.AsyncClient(trust_env=False) as client:
            info = (await client.get(f"{engine.url}/get_server_info")).json()
        assert info["argv"] == [
            *("--model-path", "stand-in/launched", "--host", "127.0.0.1", "--port", port),
            *("--tp-size", "1", "--mem-fraction-static", "0.5"),
        ]
        output = await engine.generate([2, 3], SamplingParams(max_new_tokens=2), "r-launched")
        assert output.output_ids == continuation([2, 3], 2)
    finally:
        await engine.close()
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{engine.url}/health_generate")


async def test_launch_reports_a_server_that_exits_during_start_up():
    launch = SglangLaunchOptions(
        model_path="m", port=0, command=(sys.executable, "-c", "import sys; sys.exit(3)")
    )
    with pytest.raises(UnavailableError, match="exited with code 3 before"):
        await SglangEngine.create(SglangEngineOptions(launch=launch, **engine_options()))


def main(argv: list[str]) -> None:
    """Serves the stand-in like `python -m sglang.launch_server --model-path M --host H --port P`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    server = SglangStandIn(model_path=args.model_path, argv=argv)
    uvicorn.run(server.app(), host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
