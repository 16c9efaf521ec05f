"""The SGLang engine's server life: options naming exactly one server, a server it launches
itself (the stand-in of `sglang_stand_in.py`, run as the server script) and stops on close, one
that exits during start-up, one that dies while serving, and one that goes away."""

import asyncio
import os
import signal
import sys

import httpx
import pytest
from pydantic import ValidationError

from rollout_svc.engines.base import SamplingParams
from rollout_svc.engines.server_process import LaunchOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from tests.rollout_svc.sglang_stand_in import (
    MAX_MODEL_LEN,
    MODEL_PATH,
    SglangStandIn,
    continuation,
    engine_options,
    stand_in_command,
)
from tests.tool_svc.http_stand_in import serve_app
from turnrl.errors import UnavailableError


async def test_server_gone_is_unavailable():
    server = SglangStandIn()
    async with serve_app(server.app()) as url:
        server.url = url
        engine = await SglangEngine.create(
            SglangEngineOptions(url=url, **engine_options()), MODEL_PATH, MAX_MODEL_LEN
        )
    try:
        with pytest.raises(UnavailableError, match="is unreachable for POST /generate") as failure:
            await engine.generate([1], SamplingParams(max_new_tokens=1), "r-gone")
        assert url in str(failure.value)
    finally:
        await engine.close()


def test_options_need_exactly_one_server():
    with pytest.raises(ValueError, match="exactly one of url"):
        SglangEngineOptions()
    with pytest.raises(ValueError, match="exactly one of url"):
        SglangEngineOptions(url="http://127.0.0.1:1", launch={})
    with pytest.raises(ValueError, match="must start with http"):
        SglangEngineOptions(url="127.0.0.1:30000")


async def test_launch_starts_the_server_with_its_arguments_and_stops_it():
    launch = LaunchOptions(
        port=0,
        extra_args=("--tp-size", "2", "--mem-fraction-static", "0.5"),
        command=stand_in_command(),
    )
    # The stand-in script imports torch and starlette: seconds on a loaded machine.
    options = SglangEngineOptions(launch=launch, **engine_options(startup_timeout_seconds=120))
    engine = await SglangEngine.create(options, "stand-in/launched", MAX_MODEL_LEN)
    try:
        port = engine.url.rsplit(":", 1)[1]
        async with httpx.AsyncClient(trust_env=False) as client:
            info = (await client.get(f"{engine.url}/get_server_info")).json()
        assert info["argv"] == [
            *("--model-path", "stand-in/launched", "--context-length", str(MAX_MODEL_LEN)),
            *("--host", "127.0.0.1", "--port", port),
            *("--tp-size", "2", "--mem-fraction-static", "0.5"),
        ]
        assert info["context_length"] == MAX_MODEL_LEN
        assert engine.weight_sync_ranks == 2
        output = await engine.generate([2, 3], SamplingParams(max_new_tokens=2), "r-launched")
        assert output.output_ids == continuation([2, 3], 2)
    finally:
        await engine.close()
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{engine.url}/health_generate")


async def test_the_watch_reports_a_launched_server_that_dies():
    launch = LaunchOptions(port=0, command=stand_in_command())
    options = SglangEngineOptions(launch=launch, **engine_options(startup_timeout_seconds=120))
    engine = await SglangEngine.create(options, "stand-in/launched", MAX_MODEL_LEN)
    try:
        watching = asyncio.create_task(engine.watch())
        await asyncio.sleep(0.5)
        assert not watching.done()
        os.killpg(engine._process.pid, signal.SIGKILL)  # the server's whole process group
        with pytest.raises(UnavailableError, match=r"exited with code -9; its log is above"):
            await asyncio.wait_for(watching, timeout=30)
    finally:
        await engine.close()


async def test_an_unknown_launch_flag_ends_the_server_as_sglang_does():
    """SGLang 0.5.23's argparse parser (prog "sglang serve") refuses a flag it does not
    define with exit code 2, so a wrong extra_args fails start-up, as the real server does."""
    launch = LaunchOptions(port=0, extra_args=("--tp_size", "2"), command=stand_in_command())
    options = SglangEngineOptions(launch=launch, **engine_options(startup_timeout_seconds=120))
    with pytest.raises(UnavailableError, match="exited with code 2 before it became healthy"):
        await SglangEngine.create(options, "stand-in/launched", MAX_MODEL_LEN)
    arguments = ["--model-path", "m", "--port", "0", "--mem-fraction", "0.5", "--no-such-flag"]
    server = await asyncio.create_subprocess_exec(
        *stand_in_command(), *arguments, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(server.communicate(), timeout=120)
    assert server.returncode == 2
    # argparse takes an unambiguous prefix of a flag, as the real parser does.
    assert stderr.decode().endswith("sglang serve: error: unrecognized arguments: --no-such-flag\n")


async def test_launch_reports_a_server_that_exits_during_start_up():
    launch = LaunchOptions(port=0, command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    with pytest.raises(UnavailableError, match="exited with code 3 before"):
        await SglangEngine.create(
            SglangEngineOptions(launch=launch, **engine_options()), "m", MAX_MODEL_LEN
        )


def test_the_launched_model_is_the_rollout_configs():
    """The server serves rollout.model_path, handed to create(); launch options name none."""
    with pytest.raises(ValidationError, match=r"model_path\n +Extra inputs are not permitted"):
        LaunchOptions(model_path="m")
