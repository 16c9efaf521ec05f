"""Fixtures of the real-engine tests (`make test-engines`): one real vLLM server of the tests'
tiny model for the whole session, launched the way the vLLM engine launches one (its worker
extension included), from the interpreter $TURNRL_VLLM_PYTHON names (`make engine-env
ENGINE=vllm` builds .venv-vllm). A test that changes the server's weights puts the shipped
ones back before it ends: the others compare with them."""

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from rollout_svc.engines.server_process import LaunchOptions
from rollout_svc.engines.vllm import VllmEngine, VllmEngineOptions

VLLM_PYTHON_VARIABLE = "TURNRL_VLLM_PYTHON"
# The shared server's context, and the max_model_len of the engines the tests make: the tiny
# model's max_position_embeddings, so that a request can run for 2,000 tokens (seconds), long
# enough for a test to act while it runs.
SERVER_MAX_MODEL_LEN = 2048
# A launched vLLM server imports torch and vLLM and profiles the model: 60-80 s on two cores.
STARTUP_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server: its base URL, the model it serves and its context."""

    url: str
    model_path: str
    max_model_len: int

    def engine_options(self, **fields) -> VllmEngineOptions:
        """Options of an engine that connects to this server."""
        return VllmEngineOptions(url=self.url, **fields)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of vLLM's environment; fails (never skips) when it is not there."""
    python = os.environ.get(VLLM_PYTHON_VARIABLE)
    if not python or not Path(python).is_file():
        pytest.fail(
            f"{VLLM_PYTHON_VARIABLE}={python!r} does not name vLLM's interpreter: build its "
            f"environment with `make engine-env ENGINE=vllm`, then set "
            f"{VLLM_PYTHON_VARIABLE}=.venv-vllm/bin/python",
            pytrace=False,
        )
    return python


def launch_options(python: str, **fields) -> LaunchOptions:
    """How the tests launch vLLM: float32, as the trainer computes (vLLM's "auto" would run the
    float32 checkpoint in bfloat16), and without the asyncio debug mode the tests turn on."""
    return LaunchOptions(
        python=python,
        port=0,
        extra_args=("--dtype", "float32"),
        env={"PYTHONASYNCIODEBUG": ""},
        **fields,
    )


def launched_engine_options(python: str, **fields) -> VllmEngineOptions:
    """Options of an engine that launches its own server on CPU, with 1 GiB of KV cache."""
    return VllmEngineOptions(
        launch=launch_options(python),
        cpu_kv_cache_space_gib=1,
        startup_timeout_seconds=STARTUP_TIMEOUT_SECONDS,
        **fields,
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_server(vllm_python, tiny_model_dir) -> AsyncIterator[VllmServer]:
    """One vLLM server of the tiny model for the session, started through the engine's own
    launch path; stopped (its process group) at the end."""
    engine = await VllmEngine.create(
        launched_engine_options(vllm_python), str(tiny_model_dir), SERVER_MAX_MODEL_LEN
    )
    try:
        yield VllmServer(engine.url, str(tiny_model_dir), SERVER_MAX_MODEL_LEN)
    finally:
        await engine.close()


@pytest.fixture
async def vllm_engine(vllm_server) -> AsyncIterator[VllmEngine]:
    """A vLLM engine on the session's server, in the test's event loop."""
    engine = await VllmEngine.create(
        vllm_server.engine_options(), vllm_server.model_path, vllm_server.max_model_len
    )
    try:
        yield engine
    finally:
        await engine.close()
