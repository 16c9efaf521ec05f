"""The processes a benchmark starts, stopped however it ends (an exception, Ctrl-C): each is
started with `die_with_parent` (a killed benchmark takes them down too) and stopped on the way
out of its `with`, by `stop_signal` and, past `grace_seconds`, by SIGKILL."""

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

from turnrl.subprocesses import die_with_parent

GRACE_SECONDS = 30.0


@contextlib.asynccontextmanager
async def async_child(
    *command: str,
    stop_signal: int = signal.SIGTERM,
    grace_seconds: float = GRACE_SECONDS,
    **kwargs: Any,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`asyncio.create_subprocess_exec(*command, **kwargs)`, stopped on exit."""
    process = await asyncio.create_subprocess_exec(*command, preexec_fn=die_with_parent, **kwargs)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(stop_signal)
            try:
                await asyncio.wait_for(process.wait(), grace_seconds)
            except TimeoutError:
                process.kill()
                await process.wait()


@contextlib.asynccontextmanager
async def served(
    name: str,
    *overrides: str,
    printed_before: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`turnrl serve name` on a free port with `overrides`, in `env` (None: this process's);
    yields it and its address. The lines it prints before its `serving` line (a gateway's
    URL) are added to `printed_before`."""
    command = [sys.executable, "-m", "turnrl_cli", "--log-level", "WARNING", "serve", name]
    async with async_child(
        *command, "--port", "0", *overrides, stdout=asyncio.subprocess.PIPE, env=env
    ) as process:
        while line := (await process.stdout.readline()).decode():
            if line.startswith("serving "):
                yield process, line.split()[-1]
                return
            if printed_before is not None:
                printed_before.append(line.rstrip("\n"))
        raise RuntimeError(f"{name} service exited with code {await process.wait()} at start-up")


@contextlib.contextmanager
def child(
    command: list[str], grace_seconds: float = GRACE_SECONDS, **kwargs: Any
) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command, **kwargs)`, terminated on exit unless it ended."""
    process = subprocess.Popen(command, preexec_fn=die_with_parent, **kwargs)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
