"""The GPU tests (`tests/gpu/`, marked `gpu`): deselected by `make test`, run by
scripts/gpu_check.sh (`make test-gpu`) on a machine with a CUDA device. They fail, never skip,
when what they need is missing. Every test needs `cuda`; the engine tests also need their
engine importable by the interpreter that launches its server ($TURNRL_SGLANG_PYTHON,
$TURNRL_VLLM_PYTHON; default: this one), and the FSDP tests need no engine.

The model is $TURNRL_GPU_MODEL (a local Hugging Face folder, e.g. Qwen2.5-0.5B-Instruct) or the
tests' tiny calculator model. Engine servers and the reference model sit on the last GPU;
turnrl's own end of a weight-sync group (the trainer's rank 0) on cuda:0. With one GPU they
share it and the group uses gloo (NCCL refuses two ranks on one device); with two or more the
group uses NCCL, as in training.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollout_svc.engines.server_process import LaunchOptions
from rollout_svc.engines.sglang import SglangEngineOptions
from rollout_svc.engines.sglang_api import SCHEDULER_RESERVED_TOKENS
from rollout_svc.engines.vllm import VllmEngineOptions

# Low enough memory fractions that the reference copy fits on the same GPU; no CUDA graphs,
# whose capture would double a server's start-up.
SGLANG_ARGS = ("--dtype", "bfloat16", "--mem-fraction-static", "0.5", "--disable-cuda-graph")
VLLM_ARGS = ("--dtype", "bfloat16", "--gpu-memory-utilization", "0.4", "--enforce-eager")
MAX_MODEL_LEN = 8192
STARTUP_TIMEOUT_SECONDS = 900.0
# Where the launched servers' interpreters are named.
ENGINE_PYTHON_VARIABLES = {"sglang": "TURNRL_SGLANG_PYTHON", "vllm": "TURNRL_VLLM_PYTHON"}


@pytest.fixture(scope="session")
def cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu need a CUDA device; `make test` leaves them out", pytrace=False)


def engine_python(engine: str) -> str:
    """The interpreter that launches `engine`'s server; fails the test unless it imports the
    engine's package."""
    variable = ENGINE_PYTHON_VARIABLES[engine]
    python = os.environ.get(variable) or sys.executable
    try:
        found = subprocess.run(
            [python, "-c", f"import {engine}"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"{variable}={python!r} cannot import {engine}: {e}", pytrace=False)
    if found.returncode != 0:
        last_line = (found.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.fail(
            f"{variable}={python!r} cannot import {engine} ({last_line}); name the "
            f"interpreter of an environment that has it (`make engine-env ENGINE={engine}`)",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def sglang_python(cuda) -> str:
    return engine_python("sglang")


@pytest.fixture(scope="session")
def vllm_python(cuda) -> str:
    return engine_python("vllm")


@pytest.fixture(scope="session")
def gpu_model_dir(cuda, tiny_model_dir) -> Path:
    return Path(os.environ.get("TURNRL_GPU_MODEL", tiny_model_dir))


@pytest.fixture(scope="session")
def max_model_len(gpu_model_dir) -> int:
    """The engines' max_model_len: within the model's own context, less what SGLang's
    scheduler keeps back from the --context-length its engine asks for (servers refuse a
    context longer than the model's)."""
    context = AutoConfig.from_pretrained(gpu_model_dir).max_position_embeddings
    return min(MAX_MODEL_LEN, context) - SCHEDULER_RESERVED_TOKENS


@pytest.fixture(scope="session")
def weight_sync_backend(cuda) -> str:
    return "nccl" if torch.cuda.device_count() > 1 else "gloo"


def last_gpu() -> str:
    """The last GPU as a child process's CUDA_VISIBLE_DEVICES names it: where servers run."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return visible.split(",")[-1].strip()
    return str(torch.cuda.device_count() - 1)


@pytest.fixture(scope="session")
def reference(gpu_model_dir) -> torch.nn.Module:
    """The model in bf16 on the last GPU: what the engines' logprobs are checked against."""
    device = f"cuda:{torch.cuda.device_count() - 1}"
    model = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16)
    return model.to(device).eval()


@pytest.fixture(scope="session")
def tokenizer(gpu_model_dir):
    return AutoTokenizer.from_pretrained(gpu_model_dir)


def launch_options(python: str, extra_args: tuple[str, ...]) -> LaunchOptions:
    """A server the engine launches itself from `python`, on the last GPU."""
    return LaunchOptions(
        python=python, port=0, extra_args=extra_args, env={"CUDA_VISIBLE_DEVICES": last_gpu()}
    )


def sglang_options(python: str) -> SglangEngineOptions:
    return SglangEngineOptions(
        launch=launch_options(python, SGLANG_ARGS), startup_timeout_seconds=STARTUP_TIMEOUT_SECONDS
    )


def vllm_options(python: str) -> VllmEngineOptions:
    return VllmEngineOptions(
        launch=launch_options(python, VLLM_ARGS), startup_timeout_seconds=STARTUP_TIMEOUT_SECONDS
    )


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
