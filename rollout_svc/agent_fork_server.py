"""The runner's side of a callable agent's fork server (rollout_svc/agent_zygote.py has the
process and its wire): started at the first episode, restarted at the next one when it died,
stopped by `close`.

Each episode's result and output go through two files of its own in a private temporary
directory, read once the zygote reports the episode's process reaped: a process the agent
started, even one that left the group, holds no pipe the runner waits on. A timeout or a
cancellation kills the episode's process group and waits for that report. A zygote that dies
takes its running episodes with it (their groups are killed) and fails them with
`ForkServerDied`.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from rollout_svc.agent_process import MAX_OUTPUT_BYTES, ProcessEnd, describe_exit
from turnrl.subprocesses import die_with_parent

log = logging.getLogger(__name__)

ZYGOTE_MODULE = "rollout_svc.agent_zygote"
# How long an episode's pid and exit may take to be reported once its group is killed, and the
# zygote to exit once told to stop, in seconds; reached only when something is stuck.
REPORT_SECONDS = 5.0


class ForkServerDied(Exception):
    """The zygote died (or was closed) while an episode ran; the message says how."""


@dataclasses.dataclass
class _Episode:
    """What the zygote reported about one episode."""

    result_path: str
    stderr_path: str
    pid: int | None = None
    returncode: int | None = None
    error: str = ""  # why it could not be forked
    over: bool = False  # its run is over (its process ended, timed out or was cancelled)
    # Set once its returncode is known (or never will be).
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class _Zygote:
    """One zygote process and the episodes it runs."""

    process: asyncio.subprocess.Process
    episodes: dict[int, _Episode] = dataclasses.field(default_factory=dict)
    death: str = ""  # how it died; "" while it serves
    reader: asyncio.Task | None = None


class AgentForkServer:
    """Runs episodes of the callable agent `target` in forks of one zygote started with `env`."""

    def __init__(self, target: str, env: dict[str, str]) -> None:
        self._target = target
        self._env = env
        self._starting: asyncio.Task[_Zygote] | None = None
        self._episode_ids = itertools.count()
        self._dir = ""  # the episodes' files; made with the first zygote
        self._closed = False

    async def run(self, request: dict[str, Any], timeout_seconds: float) -> ProcessEnd:
        """Plays `request` ({"prompt", "base_url", "api_key"}) in a fork until it exits or
        `timeout_seconds` pass, then kills its group. Raises OSError when the zygote cannot
        start or the episode cannot be forked, ForkServerDied when the zygote dies meanwhile;
        cancelled, kills the group and raises CancelledError."""
        zygote = await self._zygote()
        episode_id = next(self._episode_ids)
        episode = _Episode(
            os.path.join(self._dir, f"{episode_id}.result"),
            os.path.join(self._dir, f"{episode_id}.stderr"),
        )
        if zygote.death:  # died while this episode waited for its start
            raise ForkServerDied(zygote.death)
        zygote.episodes[episode_id] = episode  # before anything awaits: its reader fails it
        line = {"episode": episode_id, **request}
        line.update(result_path=episode.result_path, stderr_path=episode.stderr_path)
        # Buffered by the transport, which the zygote empties; a dead zygote drops it.
        zygote.process.stdin.write((json.dumps(line) + "\n").encode())
        timed_out = False
        try:
            async with asyncio.timeout(timeout_seconds):
                await episode.ended.wait()
        except TimeoutError:
            timed_out = True
        finally:  # ended, timed out or cancelled: the group goes, what the agent started too
            try:
                await _end(episode)
            finally:
                del zygote.episodes[episode_id]
                # At most MAX_OUTPUT_BYTES of a file just written: read here, not in a thread.
                result = _take_tail(episode.result_path, MAX_OUTPUT_BYTES[1])
                stderr = _take_tail(episode.stderr_path, MAX_OUTPUT_BYTES[2])
        if episode.error:
            raise OSError(episode.error)
        if episode.returncode is None and zygote.death:
            raise ForkServerDied(zygote.death)
        return ProcessEnd(episode.returncode, timed_out, result, stderr)

    async def close(self) -> None:
        """Stops the zygote, killing the episodes it still runs, and removes their files."""
        self._closed = True
        if self._starting is not None:
            await asyncio.wait([self._starting])
            if not self._starting.cancelled() and self._starting.exception() is None:
                await _stop(self._starting.result())
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _zygote(self) -> _Zygote:
        """The serving zygote, started when there is none (or it died)."""
        if self._closed:
            raise ForkServerDied("the agent's fork server was closed")
        starting = self._starting
        if starting is None or (
            starting.done()
            and (starting.cancelled() or starting.exception() or starting.result().death)
        ):
            self._starting = starting = asyncio.ensure_future(self._start())
        # Cancelling a subprocess mid-creation can hang Python 3.11's asyncio
        # (rollout_svc/agent_process.py), so the start runs on; the next episode uses it.
        return await asyncio.shield(starting)

    async def _start(self) -> _Zygote:
        if not self._dir:
            self._dir = tempfile.mkdtemp(prefix="turnrl-agent-")
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", ZYGOTE_MODULE, self._target),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=self._env,
            start_new_session=True,  # a signal to this service's group is not the agent's
            preexec_fn=die_with_parent,
        )
        zygote = _Zygote(process)
        zygote.reader = asyncio.create_task(_read_reports(zygote))
        return zygote


async def _read_reports(zygote: _Zygote) -> None:
    """Hands the zygote's reports to their episodes until its stdout ends; then, the zygote
    dead, kills the groups of its episodes and fails them."""
    try:
        async for line in zygote.process.stdout:
            _hand_over(zygote, json.loads(line))
    except (ValueError, KeyError):  # a bug: the zygote goes, and its episodes fail, not hang
        log.exception("a report off the agent fork server's wire")
        zygote.process.kill()
    try:
        async with asyncio.timeout(REPORT_SECONDS):
            returncode = await zygote.process.wait()
    except TimeoutError:  # its stdout closed, yet it lives on
        zygote.process.kill()
        returncode = await zygote.process.wait()
    zygote.death = f"the agent's fork server died: it {describe_exit(returncode)}"
    for episode in zygote.episodes.values():
        if episode.pid is not None:
            _kill(episode.pid)
        episode.ended.set()


def _hand_over(zygote: _Zygote, report: dict[str, Any]) -> None:
    """Records a report of the zygote's in its episode."""
    episode = zygote.episodes.get(report["episode"])
    if "pid" in report and (episode is None or episode.over):
        # Forked after its run timed out or was cancelled (behind a slow import, say), maybe
        # before its setsid: killed now, or no one would.
        _kill(report["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.kill(report["pid"], signal.SIGKILL)
    if episode is None:  # its run is over and forgotten
        return
    if "returncode" in report:
        episode.returncode = report["returncode"]
        episode.ended.set()
        return
    episode.pid = report.get("pid")
    episode.error = report.get("error", "")
    if episode.error:
        episode.ended.set()


async def _end(episode: _Episode) -> None:
    """Kills the episode's process group (once its pid is reported, if it is not yet) and
    waits for its end, at most REPORT_SECONDS."""
    episode.over = True
    if episode.pid is not None:
        _kill(episode.pid)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REPORT_SECONDS):
            await episode.ended.wait()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _take_tail(path: str, max_bytes: int) -> str:
    """The last `max_bytes` of the file at `path`, which is then removed; "" without it."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
            tail = f.read()
    except FileNotFoundError:
        return ""
    os.unlink(path)
    return tail.decode(errors="replace")


async def _stop(zygote: _Zygote) -> None:
    """Ends the zygote's stdin, which stops it, and waits for it to exit (killed past
    REPORT_SECONDS) and its reader to end."""
    zygote.process.stdin.close()
    try:
        async with asyncio.timeout(REPORT_SECONDS):
            await zygote.process.wait()
    except TimeoutError:
        zygote.process.kill()
    await zygote.reader
