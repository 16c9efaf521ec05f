"""Starting and stopping the SGLang server process that an SGLang engine launches itself.

`start_server` runs `python -m sglang.launch_server` (or the configured command) in a process
group of its own, tied to this process's life, and `stop_process_group` ends that group, the
scheduler and detokenizer processes SGLang forks included.
"""

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from pydantic import Field

from turnrl.config import StrictModel
from turnrl.subprocesses import die_with_parent

log = logging.getLogger(__name__)

DEFAULT_LAUNCH_COMMAND = (sys.executable, "-m", "sglang.launch_server")


class SglangLaunchOptions(StrictModel):
    """How the engine starts its own SGLang server. The model it serves is the rollout
    config's `model_path`."""

    host: str = Field(
        default="127.0.0.1",
        description="Interface the server binds (--host); 127.0.0.1 keeps it private.",
    )
    port: int = Field(
        default=30000, ge=0, le=65535, description="HTTP port (--port); 0 picks a free one."
    )
    extra_args: tuple[str, ...] = Field(
        default=(),
        description="More `sglang.launch_server` arguments, passed through as given, e.g. "
        "['--tp-size', '2', '--mem-fraction-static', '0.7'].",
    )
    command: tuple[str, ...] = Field(
        default=DEFAULT_LAUNCH_COMMAND,
        min_length=1,
        description="The command that starts the server; --model-path, --host, --port and "
        "extra_args are appended.",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Seconds the server gets to exit after SIGTERM before it is killed.",
    )


async def start_server(
    launch: SglangLaunchOptions, model_path: str
) -> tuple[asyncio.subprocess.Process, str]:
    """Starts the server of `model_path` in its own process group; returns it and its base
    URL."""
    port = launch.port or _free_port(launch.host)
    command = [
        *launch.command,
        *("--model-path", model_path, "--host", launch.host, "--port", str(port)),
        *launch.extra_args,
    ]
    log.info("starting SGLang: %s", " ".join(command))
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        # Its own group, so close() can stop the scheduler and detokenizer processes too.
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    client_host = "127.0.0.1" if launch.host in ("0.0.0.0", "") else launch.host
    return process, f"http://{client_host}:{port}"


def _free_port(host: str) -> int:
    # Another process may take the port before the server binds it; start-up then fails loudly.
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


async def stop_process_group(process: asyncio.subprocess.Process, timeout_seconds: float) -> None:
    """SIGTERM to the server's process group, SIGKILL after `timeout_seconds`."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_seconds):
                await process.wait()
        except TimeoutError:
            log.warning("SGLang server pid %d ignored SIGTERM; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    # Worker processes that outlived the main one would keep GPU memory.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
