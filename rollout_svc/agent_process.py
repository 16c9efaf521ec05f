"""One process of a user's agent (rollout_svc/agent_runner.py), from its start to its end: run
in a session (process group) of its own, tied to this process's life, fed its stdin, read, and
ended with its whole group, however the run ends (the process exits, runs past its time, or
the caller is cancelled).

Killing the group ends the processes the agent started too, unless one left the group
(setsid); such a process is not waited for past PIPE_DRAIN_SECONDS even if it holds the pipes.
`die_with_parent` sends SIGTERM to the agent itself, not to its group, if this process dies.
"""

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.subprocesses import die_with_parent

# The end of an agent's stdout kept, in bytes: its result line must fit.
MAX_STDOUT_BYTES = 1 << 20
# The end of an agent's stderr kept, in bytes.
MAX_STDERR_BYTES = 8192
# How long an agent's pipes may stay open once its group is killed (held by a process that left
# the group) before they are no longer read, in seconds.
PIPE_DRAIN_SECONDS = 5.0


@dataclass(frozen=True)
class ProcessEnd:
    """How an agent's process ended and what it wrote."""

    returncode: (
        int | None
    )  # None: not reaped within PIPE_DRAIN_SECONDS; negative: killed by that signal (SIGKILL too, when it timed out)
    timed_out: bool  # it ran past its time and its group was killed
    stdout: str  # the last MAX_STDOUT_BYTES of its stdout
    stderr: str  # the last MAX_STDERR_BYTES of its stderr


async def run_in_group(
    command: Sequence[str], env: dict[str, str], stdin: bytes | None, timeout_seconds: float
) -> ProcessEnd:
    """Runs `command` with environment `env` and `stdin` (None: no stdin) until it exits or
    `timeout_seconds` pass, then kills its process group. Raises OSError when it cannot start;
    cancelled, kills the group and raises CancelledError."""
    process = await _start(command, env, with_stdin=stdin is not None)
    stdout, stderr = bytearray(), bytearray()
    reads = [
        asyncio.create_task(_read_tail(process.stdout, stdout, MAX_STDOUT_BYTES)),
        asyncio.create_task(_read_tail(process.stderr, stderr, MAX_STDERR_BYTES)),
    ]
    timed_out = False
    try:
        async with asyncio.timeout(timeout_seconds):
            if stdin is not None:
                await _feed(process, stdin)
            await process.wait()
    except TimeoutError:
        timed_out = True
    except BaseException:  # cancelled: the group goes before CancelledError does
        await _stop(process, reads)
        raise
    # Ended or killed, the agent leaves nothing behind: what it started goes too.
    await _stop(process, reads)
    return ProcessEnd(
        returncode=process.returncode,
        timed_out=timed_out,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
    )


async def _start(
    command: Sequence[str], env: dict[str, str], with_stdin: bool
) -> asyncio.subprocess.Process:
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own group: killing it kills what the agent started
            preexec_fn=die_with_parent,
        )
    )
    # Cancelling a subprocess mid-creation can hang Python 3.11's asyncio (tool_svc/sandbox.py),
    # so a cancelled start runs to its end, then kills what it started.
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        await asyncio.wait([starting])
        if not starting.cancelled() and starting.exception() is None:
            _kill_group(starting.result())
            await starting.result().wait()
        raise


async def _feed(process: asyncio.subprocess.Process, data: bytes) -> None:
    """Writes `data` to the process's stdin and closes it; an agent that died first is not an
    error here (its exit code tells)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
    process.stdin.close()


async def _read_tail(stream: asyncio.StreamReader, tail: bytearray, max_bytes: int) -> None:
    """Reads `stream` to its end, keeping its last `max_bytes` bytes in `tail`."""
    while chunk := await stream.read(65536):
        tail += chunk
        del tail[:-max_bytes]


async def _stop(process: asyncio.subprocess.Process, reads: list[asyncio.Task]) -> None:
    """Kills the process group, reaps the agent, and reads its pipes to their end (at most
    PIPE_DRAIN_SECONDS: a process that left the group may hold them)."""
    _kill_group(process)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PIPE_DRAIN_SECONDS):
                await process.wait()
                await asyncio.gather(*reads)
    finally:
        for read in reads:
            read.cancel()


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the agent's process group: the agent and what it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
