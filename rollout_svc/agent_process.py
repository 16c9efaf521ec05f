"""One process of a user's agent (rollout_svc/agent_runner.py), from its start to its end: run
in a session (process group) of its own, tied to this process's life, fed its stdin, the ends
of its output kept, and ended with its whole group however the run ends (the process exits,
runs past its time, or the caller is cancelled).

Killing the group ends the processes the agent started too, unless one left the group
(setsid); such a process is not waited for past PIPE_DRAIN_SECONDS even if it holds the pipes.
`die_with_parent` sends SIGTERM to the agent itself, not to its group, if this process dies.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.subprocesses import die_with_parent

# The end of an agent's stdout (1: its result line must fit) and of its stderr (2) kept, by file
# descriptor, in bytes.
MAX_OUTPUT_BYTES = {1: 1 << 20, 2: 8192}
# How long an agent's pipes may stay open once its group is killed (held by a process that left
# the group) before they are no longer read, in seconds.
PIPE_DRAIN_SECONDS = 5.0


@dataclass(frozen=True)
class ProcessEnd:
    """How an agent's process ended and what it wrote."""

    # Negative: killed by that signal (SIGKILL, when it timed out); None: not reaped within
    # PIPE_DRAIN_SECONDS of the kill.
    returncode: int | None
    timed_out: bool  # it ran past its time and its group was killed
    stdout: str  # the end of its stdout (MAX_OUTPUT_BYTES)
    stderr: str  # the end of its stderr (MAX_OUTPUT_BYTES)


async def run_in_group(
    command: Sequence[str], env: dict[str, str], stdin: bytes | None, timeout_seconds: float
) -> ProcessEnd:
    """Runs `command` with environment `env` and `stdin` (None: no stdin) until it exits or
    `timeout_seconds` pass, then kills its process group. Raises OSError when it cannot start;
    cancelled, kills the group and raises CancelledError."""
    transport, protocol = await _start(command, env, with_stdin=stdin is not None)
    timed_out = False
    try:
        async with asyncio.timeout(timeout_seconds):
            if stdin is not None:
                pipe = transport.get_pipe_transport(0)
                pipe.write(stdin)  # buffered by the transport; a dead reader is not an error
                pipe.close()  # once written
            # Not Process.wait(): Python 3.11's waits for the pipes too, which a process the
            # agent started may hold open long after the agent ended.
            await protocol.exited.wait()
    except TimeoutError:
        timed_out = True
    except BaseException:  # cancelled: the group goes before CancelledError does
        await _stop(transport, protocol)
        raise
    # Ended or killed, the agent leaves nothing behind: what it started goes too.
    await _stop(transport, protocol)
    return ProcessEnd(
        returncode=transport.get_returncode(),
        timed_out=timed_out,
        stdout=protocol.output[1].decode(errors="replace"),
        stderr=protocol.output[2].decode(errors="replace"),
    )


class _AgentProtocol(asyncio.SubprocessProtocol):
    """Keeps the ends of an agent's stdout and stderr, and tells when it exited and when it
    and its pipes are done."""

    def __init__(self) -> None:
        self.output = {1: bytearray(), 2: bytearray()}  # by file descriptor
        self.exited = asyncio.Event()  # the agent exited (and was reaped)
        self.done = asyncio.Event()  # it exited, and its stdout and stderr reached their ends

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        tail = self.output[fd]
        tail += data
        del tail[: -MAX_OUTPUT_BYTES[fd]]

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set()


async def _start(
    command: Sequence[str], env: dict[str, str], with_stdin: bool
) -> tuple[asyncio.SubprocessTransport, _AgentProtocol]:
    starting = asyncio.ensure_future(
        asyncio.get_running_loop().subprocess_exec(
            _AgentProtocol,
            *command,
            stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
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
            await _stop(*starting.result())
        raise


async def _stop(transport: asyncio.SubprocessTransport, protocol: _AgentProtocol) -> None:
    """Kills the process group, then waits for the agent to be reaped and its pipes to reach
    their ends (at most PIPE_DRAIN_SECONDS: a process that left the group may hold them), and
    closes them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(transport.get_pid(), signal.SIGKILL)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PIPE_DRAIN_SECONDS):
                await protocol.done.wait()
    finally:
        transport.close()


def describe_exit(returncode: int | None) -> str:
    """How a process ended, as a predicate: "exited with code 3", "was killed by SIGKILL"."""
    if returncode is None:
        return "did not end after SIGKILL"
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"
