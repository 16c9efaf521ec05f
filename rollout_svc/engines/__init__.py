"""Inference engines, by the name a config's `rollout.engine` uses, with their options model."""

from pydantic import BaseModel

from rollout_svc.engines.hf import HfEngine, HfEngineOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions

ENGINES: dict[str, tuple[type, type[BaseModel]]] = {
    "hf": (HfEngine, HfEngineOptions),
    "sglang": (SglangEngine, SglangEngineOptions),
}
