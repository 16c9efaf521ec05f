"""A stand-in vLLM 0.32 server of a vision-language model, for the vLLM engine's image requests.

vLLM's CPU build, which the engine tests run for real (tests/engines), cannot serve a
vision-language model here: its processor (transformers' AutoProcessor) loads the video
processor, which needs torchvision, and the only torchvision wheel this machine installs is a
CUDA build. So the images' wire format is tested against this stand-in: the routes
`VllmEngine.create` reads, and `/inference/v1/generate` with `token_ids`, `content_parts` and
`return_token_ids` in the shapes of `entrypoints/scale_out/token_in_token_out/protocol.py`,
answered by turnrl's hf engine of the model (`stand_in_images` expands the images as vLLM
does). Every /inference/v1/generate body is recorded.
"""

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.hf import HfEngine
from tests.rollout_svc.stand_in_images import error_reply, served_prompt
from turnrl.vision import VisionProcessor


class VllmVisionStandIn:
    """vLLM 0.32's HTTP API over `model` (an hf engine of `model_path`), expanding images with
    `vision` (the server's processor)."""

    def __init__(self, model_path: str, model: HfEngine, vision: VisionProcessor, context: int):
        self.model_path = model_path
        self.model = model
        self.vision = vision
        self.context = context
        self.generate_bodies: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        answers = {
            "/health": lambda: {},
            "/v1/models": lambda: {
                "data": [{"id": self.model_path, "max_model_len": self.context}]
            },
            "/get_world_size": lambda: {"world_size": 1},
            "/weight_info": lambda: {"weight_version": "default"},
            "/server_info": lambda: {"vllm_config": {"device_config": {"device": "cpu"}}},
        }
        routes = [
            Route(path, self._answering(answer), methods=["GET"])
            for path, answer in answers.items()
        ]
        return Starlette(
            routes=[*routes, Route("/inference/v1/generate", self._generate, methods=["POST"])]
        )

    @staticmethod
    def _answering(answer) -> Any:
        async def endpoint(request: Request) -> Response:
            return JSONResponse(answer())

        return endpoint

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.generate_bodies.append(body)
        parts = body.get("content_parts") or []
        if any(
            set(part) - {"type", "url", "uuid"} or part["type"] != "image_url" for part in parts
        ):
            return error_reply(400, "content_parts items are {type: image_url, url, uuid}")
        prompt = served_prompt(body["token_ids"], [part["url"] for part in parts], self.vision)
        if isinstance(prompt, Response):
            return prompt
        params = body["sampling_params"]
        sampling = SamplingParams(
            max_new_tokens=params["max_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            min_p=params["min_p"],
            repetition_penalty=params["repetition_penalty"],
            stop_token_ids=tuple(params["stop_token_ids"]),
        )
        out = await self.model.generate(
            prompt.input_ids, sampling, body["request_id"], images=prompt.images
        )
        content = [
            {"token_id": token, "logprob": logprob}
            for token, logprob in zip(out.output_ids, out.logprobs, strict=True)
        ]
        reply = {
            "choices": [
                {"finish_reason": out.finish_reason.value, "logprobs": {"content": content}}
            ],
            "usage": {"prompt_tokens": len(prompt.input_ids)},
        }
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = prompt.input_ids
        return JSONResponse(reply)
