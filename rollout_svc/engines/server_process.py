"""Starting and stopping the server process of an engine that runs in a server of its own
(SGLang, vLLM), from the Python environment the configuration names.

Such an engine needs none of its packages in turnrl's environment: `LaunchOptions.python` is the
interpreter of the engine's own environment (`make engine-env`), which runs the engine's server
module. `start_server` runs it in a process group of its own, tied to this process's life, and
`stop_process_group` ends that group, the worker processes the server forks included.
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


class LaunchOptions(StrictModel):
    """How an engine starts its own server. The model it serves is the rollout config's
    `model_path`, its context the rollout config's `max_model_len`."""

    python: str = Field(
        default=sys.executable,
        description="The interpreter of the environment the engine is installed in, e.g. "
        ".venv-vllm/bin/python (`make engine-env`); it runs the engine's server module. "
        "Default: the rollout service's own interpreter.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Interface the server binds (--host); 127.0.0.1 keeps it private.",
    )
    port: int = Field(
        default=30000, ge=0, le=65535, description="HTTP port (--port); 0 picks a free one."
    )
    extra_args: tuple[str, ...] = Field(
        default=(),
        description="More server arguments, passed through as given, e.g. ['--tp-size', '2'].",
    )
    command: tuple[str, ...] | None = Field(
        default=None,
        min_length=1,
        description="The command that starts the server, instead of `python -m` the engine's "
        "server module; the model, host, port and extra_args are appended.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables set for the server."
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Seconds the server gets to exit after SIGTERM before it is killed.",
    )


async def start_server(
    launch: LaunchOptions, module: str, arguments: list[str], env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """Starts `python -m module` (or `launch.command`) with `arguments`, then --host, --port and
    `launch.extra_args`, in its own process group; returns the process and its base URL.
    `env` (the engine's own variables) and `launch.env` are added to this process's
    environment."""
    port = launch.port or _free_port(launch.host)
    command = [
        *(launch.command or (launch.python, "-m", module)),
        *arguments,
        *("--host", launch.host, "--port", str(port)),
        *launch.extra_args,
    ]
    log.info("starting %s", " ".join(command))
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        # Onto this process's stderr (fd 2): a launcher reads a service's stdout only until
        # its address line, and a server logging a line per request there would fill the pipe
        # and block.
        stdout=2,
        env={**os.environ, **(env or {}), **launch.env},
        # Its own group, so close() can stop the server's worker processes too.
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
            log.warning("server pid %d ignored SIGTERM; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    # Worker processes that outlived the main one would keep memory (GPU memory, too).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
