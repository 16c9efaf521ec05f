"""A stand-in SGLang server, for the SGLang engine tests.

SGLang needs a GPU, so `SglangStandIn` implements the request and response shapes of SGLang's
native HTTP API (`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`) on
loopback: a counter model decodes one token per step (or, given a local model folder, a real
model samples: turnrl's hf engine behind SGLang's API), answers [logprob, token_id, text]
triples and finish reasons, honours max_new_tokens and stop_token_ids, aborts by rid, pauses
and continues, joins real weight-sync groups and receives the tensors broadcast on them (or
written to disk) as SGLang does (`sglang_stand_in_weights`), and records every request so
tests check the bodies the adapter sent. Run as a script, this module serves the stand-in on
the --host and --port it is given, which is how the launch tests stand in for
`python -m sglang.launch_server`.
"""

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from tests.rollout_svc.sglang_stand_in_weights import (
    WAIT_SECONDS,
    join_as_sglang,
    load_folder,
    receive_flattened,
    receive_per_tensor,
    spans_of,
    version_spans,
)
from turnrl.config import REPO_ROOT
from turnrl.errors import InvalidArgumentError

VOCAB_SIZE = 1000

EOS_TOKEN_ID = VOCAB_SIZE - 1
# The keyword arguments of SGLang's SamplingParams that callers may set.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}  # fmt: skip
# The model the stand-in claims to serve, and the context the tests give the engine.
MODEL_PATH = "stand-in/tiny-model"
MAX_MODEL_LEN = 64


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

    def __init__(
        self,
        model_path: str = MODEL_PATH,
        argv: list[str] | None = None,
        model: HfEngine | None = None,
    ):
        """With `model` (an hf engine of `model_path`), /generate samples from a real model,
        whose weights the weight updates replace; without, from the counter model."""
        self.model_path = model_path
        self.model = model
        self.argv = argv or []
        self.url = ""
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body)
        self.failures: dict[str, list[tuple[int, str]]] = {}  # path -> (status, message) first
        self.running: dict[str, RunningRequest] = {}
        self.hold_at_tokens: int | None = None  # requests wait there until release()
        self.pause_mode: str | None = None
        self.weight_version = "default"
        # Weight-sync groups joined as SGLang joins them (`join_as_sglang`), by name, and the
        # tensors received over them or from disk, by name.
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.data_parallel_size = 1
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
            "/destroy_weights_update_group": self._destroy_weights_update_group,
            "/update_weights_from_disk": self._update_weights_from_disk,
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

    def leave_groups(self) -> None:
        """Destroys the weight-sync groups joined, whose names are the test process's."""
        for group in self.groups.values():
            dist.destroy_process_group(group)
        self.groups.clear()

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
        if self.model is not None:
            return await self._generate_with_model(body)
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
            meta_info["weight_versions"] = version_spans(
                request.version_changes, self.weight_version, len(request.output_ids)
            )
        text = "".join(f"<{token}>" for token in request.output_ids)
        return JSONResponse(
            {"text": text, "output_ids": request.output_ids, "meta_info": meta_info}
        )

    async def _generate_with_model(self, body: dict) -> Response:
        """/generate's reply from the real model: its ids and raw logprobs, the versions of
        the weights that sampled each token."""
        params = body["sampling_params"]
        if unknown := set(params) - SGLANG_SAMPLING_KEYS:
            message = f"SamplingParams got an unexpected keyword argument {sorted(unknown)[0]!r}"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        sampling = SamplingParams(
            max_new_tokens=params.get("max_new_tokens", 128),
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            top_k=max(params.get("top_k", -1), 0),
            min_p=params.get("min_p", 0.0),
            repetition_penalty=params.get("repetition_penalty", 1.0),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            seed=params.get("sampling_seed"),
        )
        try:
            out = await self.model.generate(body["input_ids"], sampling, body["rid"])
        except InvalidArgumentError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        finish_reason = {"type": out.finish_reason.value}
        if out.finish_reason is FinishReason.STOP:
            finish_reason["matched"] = out.output_ids[-1]
        meta_info = {
            "id": body["rid"],
            "finish_reason": finish_reason,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(out.output_ids),
            "cached_tokens": int(out.metrics["cached_prompt_tokens"]),
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [logprob, token, None]
                for logprob, token in zip(out.logprobs, out.output_ids, strict=True)
            ],
            "weight_versions": spans_of(out.policy_versions),
        }
        return JSONResponse({"output_ids": out.output_ids, "meta_info": meta_info})

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
        if self.model is not None:
            await self.model.abort(body["rid"])
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
        if self.model is not None:
            await self.model.pause()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, body: dict | None) -> Response:
        if self.model is not None:
            await self.model.resume()
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
        try:
            group = await asyncio.to_thread(join_as_sglang, body, group_name)
        except Exception as e:  # SGLang answers the failure, it does not raise
            return _weight_sync_failure(f"Failed to initialize custom process group: {e}.")
        async with self._changed:
            self.groups[group_name] = group
            self._changed.notify_all()
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    async def _destroy_weights_update_group(self, body: dict) -> Response:
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return _weight_sync_failure("The group to be destroyed does not exist.")
        dist.destroy_process_group(group)
        return JSONResponse({"success": True, "message": "Succeeded to destroy group."})

    async def _update_weights_from_distributed(self, body: dict) -> Response:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            return _weight_sync_failure("names, dtypes and shapes differ in length")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return _weight_sync_failure("The weight update group is not initialized.")
        if not all(isinstance(getattr(torch, dtype, None), torch.dtype) for dtype in dtypes):
            return _weight_sync_failure(f"Unknown dtype in {dtypes}")
        if body.get("flush_cache", True) and self._cache_in_use():
            return PlainTextResponse("AssertionError: Cache flush failed", 500)  # SGLang asserts
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            return _weight_sync_failure(f"Unknown load_format {load_format!r}")
        if load_format and len(set(dtypes)) > 1:  # FlattenedTensorBucket concatenates them
            return _weight_sync_failure(f"a flattened bucket of several dtypes: {dtypes}")
        receive = receive_flattened if load_format else receive_per_tensor
        try:
            received = await asyncio.to_thread(receive, group, dtypes, shapes)
        except RuntimeError as e:  # SGLang's words: earlier buckets stay loaded
            return _weight_sync_failure(
                f"Failed to update parameter online: {e}. The full weights of the ModelRunner "
                "are partially updated. Please discard the whole weights."
            )
        await self._load(dict(zip(names, received, strict=True)), body.get("weight_version"))
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def _update_weights_from_disk(self, body: dict) -> Response:
        if body.get("flush_cache", True) and self._cache_in_use():
            return PlainTextResponse("AssertionError: Cache flush failed", 500)
        loaded = await asyncio.to_thread(load_folder, Path(body["model_path"]))
        if not loaded:
            return _weight_sync_failure(f"no safetensors in {body['model_path']}")
        await self._load(loaded, body.get("weight_version"))
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    async def _load(self, tensors: dict[str, torch.Tensor], version: str | None) -> None:
        """Keeps the tensors received, loads them into the real model when there is one, and
        takes `version`, as SGLang's load_weights and weight_version do."""
        self.weights.update(tensors)
        if self.model is not None:
            number = int(version) if version and version.isdigit() else self.model.policy_version
            await self.model.update_weights(tensors.items(), number)
        await self._take_version(version)

    async def _take_version(self, version: str | None) -> None:
        async with self._changed:
            if version is not None:
                for request in self.running.values():
                    if request.output_ids:
                        request.version_changes.append(
                            (self.weight_version, len(request.output_ids))
                        )
                self.weight_version = version
            self._changed.notify_all()

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
        return JSONResponse(
            {
                "model_path": self.model_path,
                "argv": self.argv,
                "tp_size": 1,
                "dp_size": self.data_parallel_size,
            }
        )


def _weight_sync_failure(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def engine_options(**overrides: Any) -> dict:
    return {
        "startup_timeout_seconds": WAIT_SECONDS,
        "control_timeout_seconds": WAIT_SECONDS,
        "request_timeout_seconds": WAIT_SECONDS,
        "max_retries": 1,
        **overrides,
    }


def stand_in_command() -> tuple[str, ...]:
    """Runs this module as the server script, importable from any working directory."""
    script = (
        f"import runpy, sys; sys.path.insert(0, {str(REPO_ROOT)!r}); "
        "runpy.run_module('tests.rollout_svc.sglang_stand_in', run_name='__main__')"
    )
    return (sys.executable, "-c", script)


def main(argv: list[str]) -> None:
    """Serves the stand-in like `python -m sglang.launch_server --model-path M --host H --port P`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context-length", type=int, default=2048)
    args, _ = parser.parse_known_args(argv)
    model = None
    if (Path(args.model_path) / "config.json").is_file():  # a real model: serve it
        options = HfEngineOptions()
        model = asyncio.run(HfEngine.create(options, args.model_path, args.context_length))
    server = SglangStandIn(model_path=args.model_path, argv=argv, model=model)
    uvicorn.run(server.app(), host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
