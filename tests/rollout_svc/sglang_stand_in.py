"""A stand-in SGLang server, for the SGLang engine tests.

SGLang needs a GPU, so `SglangStandIn` implements the request and response shapes of SGLang
0.5.23's native HTTP API (`sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`)
on loopback: a counter model decodes one token per step (or, given a local model folder, a
real model samples: turnrl's hf engine behind SGLang's API), answers [logprob, token_id, text]
triples and finish reasons, honours max_new_tokens, stop_token_ids, stop strings and its
context length,
refuses what 0.5.23 refuses with HTTP 400 (`sglang_stand_in_checks`), aborts every request
whose rid starts with the one given, pauses and continues, joins real weight-sync groups with
each of its tensor-parallel ranks and receives the tensors broadcast on them (or written to
disk) inside weight-update sessions as 0.5.23 does (`sglang_stand_in_weights`), and records
every request so tests check the bodies the adapter sent. Run as a script, this module serves
the stand-in on the --host and --port it is given, refusing flags 0.5.23 does not define, which
is how the launch tests stand in for `python -m sglang.launch_server`.
"""

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
from safetensors.torch import load_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_svc.engines.base import FinishReason, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from tests.rollout_svc.sglang_stand_in_checks import (
    RESERVED_TOKENS,
    generate_refusal,
    lora_load_refusal,
    lora_reply,
    server_arguments,
)
from tests.rollout_svc.sglang_stand_in_weights import (
    WAIT_SECONDS,
    StandInWeights,
    spans_of,
    version_spans,
)
from tests.rollout_svc.stand_in_images import sglang_served_prompt
from turnrl.config import REPO_ROOT
from turnrl.errors import InvalidArgumentError
from turnrl.vision import VisionProcessor

VOCAB_SIZE = 1000

EOS_TOKEN_ID = VOCAB_SIZE - 1
# The model the stand-in claims to serve, its context (as a config.json would give it), and
# the context the tests give the engine.
MODEL_PATH = "stand-in/tiny-model"
MODEL_CONTEXT_LENGTH = 2048
MAX_MODEL_LEN = 64


def next_token(previous: int) -> int:
    """The stand-in model: each token follows from the one before (never EOS)."""
    return (previous * 7 + 3) % EOS_TOKEN_ID


def token_text(output_ids: list[int]) -> str:
    """The counter model's text: each token spelled "<id>"."""
    return "".join(f"<{token}>" for token in output_ids)


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
        context_length: int | None = None,
        tp_size: int = 1,
        vision: VisionProcessor | None = None,
    ):
        """With `model` (an hf engine of `model_path`), /generate samples from a real model,
        whose weights the weight updates replace; without, from the counter model.
        `context_length` is --context-length (None: the model's), `tp_size` --tp-size;
        `vision`: the processor a vision-language model's server expands images with."""
        self.model_path = model_path
        self.model = model
        self.vision = vision
        self.argv = argv or []
        self.context_length_flag = context_length
        self.context_length = context_length or MODEL_CONTEXT_LENGTH
        self.url = ""
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body)
        self.failures: dict[str, list[tuple[int, str]]] = {}  # path -> (status, message) first
        self.running: dict[str, RunningRequest] = {}
        self.hold_at_tokens: int | None = None  # requests wait there until release()
        self.pause_mode: str | None = None
        self.weight_version = "default"
        # The weight routes: groups, sessions, the tensors received (`sglang_stand_in_weights`).
        self.weight_routes = StandInWeights(tp_size, self._load, self._cache_in_use, self._notify)
        self.model_rids: set[str] = set()  # requests the real model runs
        self.data_parallel_size = 1
        self.report_version_spans = True
        self.is_generation = True
        self.unhealthy_checks_left = 0
        self.sequences: list[list[int]] = []  # what the radix cache holds
        self._changed = asyncio.Condition()
        # The LoRA adapters loaded (--enable-lora), by name: their tensors, read from the
        # folder /load_lora_adapter named when it loaded them.
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}

    def app(self) -> Starlette:
        routes = {
            "/generate": self._generate,
            "/abort_request": self._abort_request,
            "/pause_generation": self._pause_generation,
            "/continue_generation": self._continue_generation,
            "/flush_cache": self._flush_cache,
            "/health_generate": self._health,
            "/get_model_info": self._model_info,
            "/get_server_info": self._server_info,
            "/load_lora_adapter": self._load_lora_adapter,
            "/unload_lora_adapter": self._unload_lora_adapter,
            **self.weight_routes.routes(),
        }
        return Starlette(
            routes=[
                Route(path, self._recorded(path, handler), methods=["GET", "POST"])
                for path, handler in routes.items()
            ]
        )

    @property
    def groups(self) -> dict[str, list[dist.ProcessGroup]]:
        """The weight-sync groups joined, by name: one per tensor-parallel rank."""
        return self.weight_routes.groups

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors tensor-parallel rank 0 received, by name."""
        return self.weight_routes.weights

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
        self.weight_routes.leave_groups()

    async def _notify(self) -> None:
        async with self._changed:
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
        running = set(self.running) | self.model_rids
        if refusal := generate_refusal(body, self.context_length, running):
            return refusal
        if body.get("lora_path") is not None and body["lora_path"] not in self.adapters:
            message = f"LoRA adapter {body['lora_path']!r} is not loaded"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if self.model is not None:
            return await self._generate_with_model(body)
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
        text = token_text(request.output_ids)  # no_stop_trim: a stop string is not cut
        return JSONResponse(
            {"text": text, "output_ids": request.output_ids, "meta_info": meta_info}
        )

    async def _generate_with_model(self, body: dict) -> Response:
        """/generate's reply from the real model: its ids and raw logprobs, the versions of
        the weights that sampled each token."""
        params = body["sampling_params"]
        sampling = SamplingParams(
            max_new_tokens=self._max_new_tokens(body),
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            top_k=max(params.get("top_k", -1), 0),
            min_p=params.get("min_p", 0.0),
            repetition_penalty=params.get("repetition_penalty", 1.0),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            stop_strings=tuple(params.get("stop") or ()),
            seed=params.get("sampling_seed"),
        )
        prompt = sglang_served_prompt(body, self.vision)
        if isinstance(prompt, Response):
            return prompt
        self.model_rids.add(body["rid"])
        try:
            out = await self.model.generate(
                prompt.input_ids, sampling, body["rid"], images=prompt.images
            )
        except InvalidArgumentError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        finally:
            self.model_rids.discard(body["rid"])
        finish_reason = {"type": out.finish_reason.value}
        if out.finish_reason is FinishReason.STOP:
            # SGLang names the stop string instead when one ended it; the adapter reads the type.
            finish_reason["matched"] = out.output_ids[-1]
        meta_info = {
            "id": body["rid"],
            "finish_reason": finish_reason,
            "prompt_tokens": len(prompt.input_ids),
            "completion_tokens": len(out.output_ids),
            "cached_tokens": int(out.metrics["cached_prompt_tokens"]),
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [logprob, token, None]
                for logprob, token in zip(out.logprobs, out.output_ids, strict=True)
            ],
            "weight_versions": spans_of(out.policy_versions),
        }
        reply = {"output_ids": out.output_ids, "meta_info": meta_info}
        if body.get("return_prompt_token_ids"):
            reply["prompt_token_ids"] = prompt.input_ids
        return JSONResponse(reply)

    def _max_new_tokens(self, body: dict) -> int:
        """The request's max_new_tokens, cut where the scheduler ends a generation: one token
        short of max_req_len = context - 1 in all (`managers/scheduler.py`
        init_req_max_new_tokens)."""
        max_new_tokens = body["sampling_params"].get("max_new_tokens", 128)
        return min(max_new_tokens, self.context_length - 2 - len(body["input_ids"]))

    async def _decode(self, request: RunningRequest, input_ids: list[int], params: dict) -> dict:
        stop_ids = {EOS_TOKEN_ID, *(params.get("stop_token_ids") or [])}
        stop_strings = params.get("stop") or []
        max_new_tokens = self._max_new_tokens({"sampling_params": params, "input_ids": input_ids})
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
            # As SGLang checks the decoded output after each token, ids kept
            # (`managers/schedule_batch.py` Req._check_str_based_finish).
            text = token_text(request.output_ids)
            if matched := next((stop for stop in stop_strings if stop in text), None):
                return {"type": "stop", "matched": matched}
            await asyncio.sleep(0)  # one decode step per loop turn, as a batch would interleave

    def _may_decode(self, request: RunningRequest) -> bool:
        held = self.hold_at_tokens is not None and len(request.output_ids) >= self.hold_at_tokens
        return self.pause_mode is None and not held

    async def _abort_request(self, body: dict) -> Response:
        """Aborts, as 0.5.23 does, nothing for an empty rid or one that is not running
        (`managers/tokenizer_manager.py` abort_request), else every request whose rid starts
        with the one given (`managers/scheduler.py` abort_request: `startswith`); with
        abort_all, every request."""
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not abort_all and rid not in set(self.running) | self.model_rids:
            return Response(status_code=200)
        for model_rid in [r for r in self.model_rids if abort_all or r.startswith(rid)]:
            await self.model.abort(model_rid)
        async with self._changed:
            for request in self.running.values():
                if abort_all or request.rid.startswith(rid):
                    request.aborted = True
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

    async def _load_lora_adapter(self, body: dict) -> Response:
        """0.5.23's `/load_lora_adapter` (`LoadLoRAAdapterReqInput`): loads the peft folder
        `lora_path` as `lora_name`; HTTP 400 with success false when LoRA is off, the name is
        taken, or the folder holds no adapter within --max-lora-rank."""
        error = lora_load_refusal(body, self.argv, self.adapters)
        if error is None:
            self.adapters[body["lora_name"]] = load_file(
                Path(body["lora_path"]) / "adapter_model.safetensors"
            )
        return lora_reply(error, self.adapters)

    async def _unload_lora_adapter(self, body: dict) -> Response:
        """0.5.23's `/unload_lora_adapter` (`UnloadLoRAAdapterReqInput`)."""
        error = None
        if self.adapters.pop(body["lora_name"], None) is None:
            error = f"LoRA adapter {body['lora_name']!r} is not loaded"
        await self._notify()
        return lora_reply(error, self.adapters)

    def _cache_in_use(self) -> bool:
        # Retracted requests free their KV cache; running or in-place paused ones hold it.
        return bool(self.running) and self.pause_mode != "retract"

    async def _flush_cache(self, body: None) -> Response:
        if self._cache_in_use():
            return PlainTextResponse("Cache not flushed: requests are running.\n", 400)
        self.sequences.clear()
        return PlainTextResponse("Cache flushed.\n")

    async def _load(self, tensors: dict[str, torch.Tensor], version: str | None) -> None:
        """Keeps the tensors received, loads them into the real model when there is one, and
        takes `version`, as SGLang's load_weights and weight_version do."""
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
        """The server's arguments and its scheduler's limits (`utils/common.py`
        build_server_info; `managers/scheduler.py` get_init_info); `argv` stands for the
        launch command."""
        return JSONResponse(
            {
                "model_path": self.model_path,
                "argv": self.argv,
                "context_length": self.context_length_flag,
                "tp_size": self.weight_routes.tp_size,
                "dp_size": self.data_parallel_size,
                "max_req_input_len": self.context_length - RESERVED_TOKENS,
                "max_total_num_tokens": self.context_length * 4,
            }
        )


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
    """Serves the stand-in like `python -m sglang.launch_server --model-path M --host H --port P
    ...`; a flag SGLang 0.5.23 does not define ends it as it ends that server."""
    args = server_arguments(argv)
    model = None
    context_length = args.context_length or MODEL_CONTEXT_LENGTH
    if (Path(args.model_path) / "config.json").is_file():  # a real model: serve it
        options = HfEngineOptions()
        model = asyncio.run(HfEngine.create(options, args.model_path, context_length))
    server = SglangStandIn(
        model_path=args.model_path,
        argv=argv,
        model=model,
        context_length=args.context_length,
        tp_size=args.tp_size,
    )
    uvicorn.run(server.app(), host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
