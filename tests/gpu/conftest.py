"""The GPU tests (`tests/gpu/`, marked `gpu`): deselected by `make test`, run by `make test-gpu`
on a machine with a CUDA device and SGLang installed in this project's Python (`pip install
'.[sglang]'`). They fail, never skip, when either is missing.

The model is $TURNRL_GPU_MODEL (a local Hugging Face folder, e.g. Qwen2.5-0.5B-Instruct) or the
tests' tiny calculator model. With one GPU the SGLang server and the reference model share it
and the weight-sync group uses gloo (NCCL refuses two ranks on one device); with two or more
the reference sits on cuda:1 and the group uses NCCL, as in training.
"""

import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_svc.engines.server_process import LaunchOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions

# Low enough a memory fraction that the reference copy fits on the same GPU.
SGLANG_ARGS = ("--dtype", "bfloat16", "--mem-fraction-static", "0.5", "--disable-cuda-graph")
MAX_MODEL_LEN = 8192
STARTUP_TIMEOUT_SECONDS = 900.0


@pytest.fixture(scope="session")
def cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu need a CUDA device; `make test` leaves them out")
    if importlib.util.find_spec("sglang") is None:
        pytest.fail("tests/gpu need SGLang in this Python: pip install '.[sglang]'")


@pytest.fixture(scope="session")
def gpu_model_dir(cuda, tiny_model_dir) -> Path:
    return Path(os.environ.get("TURNRL_GPU_MODEL", tiny_model_dir))


@pytest.fixture(scope="session")
def weight_sync_backend(cuda) -> str:
    return "nccl" if torch.cuda.device_count() > 1 else "gloo"


@pytest.fixture(scope="session")
def reference(gpu_model_dir) -> torch.nn.Module:
    """The model in bf16 on the last GPU: what the engine's logprobs are checked against."""
    device = f"cuda:{torch.cuda.device_count() - 1}"
    model = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16)
    return model.to(device).eval()


@pytest.fixture(scope="session")
def tokenizer(gpu_model_dir):
    return AutoTokenizer.from_pretrained(gpu_model_dir)


def sglang_options(**overrides) -> SglangEngineOptions:
    """A server the engine launches itself: `python -m sglang.launch_server` on GPU 0."""
    launch = LaunchOptions(port=0, extra_args=SGLANG_ARGS)
    return SglangEngineOptions(
        launch=launch, startup_timeout_seconds=STARTUP_TIMEOUT_SECONDS, **overrides
    )


@pytest.fixture
async def sglang(gpu_model_dir) -> AsyncIterator[SglangEngine]:
    engine = await SglangEngine.create(sglang_options(), str(gpu_model_dir), MAX_MODEL_LEN)
    try:
        yield engine
    finally:
        await engine.close()


def encode(tokenizer, prompt: str) -> list[int]:
    """A one-turn chat prompt's ids, with the generation prompt."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def reference_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Logprob of each output token given everything before it, from one forward pass."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    targets = torch.tensor(output_ids, device=device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].cpu()
