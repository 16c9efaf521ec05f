"""Inference engines, by the name a config's `rollout.engine` uses, with their options model.

The rollout service builds one with `await engine_class.create(options, model_path,
max_model_len)`: the options validated from `rollout.engine_options`, the model and its context
length from `rollout.model_path` and `rollout.max_model_len`."""

from pydantic import BaseModel

from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from rollout_svc.engines.vllm import VllmEngine, VllmEngineOptions

ENGINES: dict[str, tuple[type, type[BaseModel]]] = {
    "hf": (HfEngine, HfEngineOptions),
    "sglang": (SglangEngine, SglangEngineOptions),
    "vllm": (VllmEngine, VllmEngineOptions),
}
