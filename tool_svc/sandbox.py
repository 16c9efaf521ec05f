"""Runs untrusted commands under bubblewrap, with memory and process limits from a cgroup.

Each run gets fresh namespaces (no network: only `lo`, down), a read-only view of the system
directories and of the paths the caller names, a private writable work dir at `/workspace`
(a host temp dir, deleted after), and its own cgroup (memory and process-count limits,
removed after, everything left in it killed first). CPU time and file size are rlimits that
prlimit sets before it execs bwrap. The sandbox runs as uid 0 of a fresh user namespace with no
capabilities; as that uid maps to the host's root, `/proc` is read-only too (a writable
`/proc/sys` would let it set host-wide sysctls).

`Sandbox.create` checks that all of this works on this machine and raises
`SandboxUnavailableError` saying what is missing and how to fix it; nothing here ever runs a
command unsandboxed. The cgroups, v1 or v2, are `tool_svc.cgroups.Cgroup`.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tool_svc.cgroups import (
    CLEANUP_TIMEOUT_SECONDS,
    Cgroup,
    LimitCounters,
    SandboxLimits,
    SandboxUnavailableError,
)

log = logging.getLogger(__name__)

WORKSPACE = "/workspace"
# Top-level system directories a dynamically linked program needs; symlinks are recreated.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The few /etc files programs read; the rest of /etc (shadow, keys, configs) stays hidden.
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/mime.types",
    "/etc/ssl",
)
# Run by /bin/sh before it execs prlimit, which execs bwrap: the process joins its cgroups
# first, so everything the sandbox starts is in them. (A preexec_fn could do this too, but the
# parent waits for its exec, and joining a cgroup v1 waits for an RCU grace period: the event
# loop would stall for 10-60 ms per start.) A failed join exits before bwrap ever runs.
JOIN_CGROUP_SCRIPT = (
    'for procs in $CGROUP_PROCS; do echo $$ > "$procs" || exit 125; done; exec "$@"'
)
# Made read-only once every mount is in place: /proc, with /proc/sys (the sandbox's uid is the
# host's root, which could set host-wide sysctls there), and the new root, a tmpfs that holds
# the mount points.
READ_ONLY_REMOUNTS = ("--remount-ro", "/proc", "--remount-ro", "/")
# Each sandbox service's cgroup is this prefix plus its pid.
PARENT_PREFIX = "turnrl-sandbox-"
PROBE_TIMEOUT_SECONDS = 30.0
READ_CHUNK_BYTES = 65536


@dataclass
class Captured:
    """The first bytes of an output stream, and how many more were thrown away."""

    data: bytes
    dropped_bytes: int
    # Bytes read past the marker, or None when the stream ended before it (or had none).
    rest: bytes | None = None

    def text(self) -> str:
        """The kept bytes as text, with a note when some were dropped."""
        text = self.data.decode(errors="replace")
        return text + f"...[truncated {self.dropped_bytes} bytes]" if self.dropped_bytes else text


async def read_capped(
    stream: asyncio.StreamReader, limit: int, marker: bytes | None = None, pending: bytes = b""
) -> Captured:
    """Reads `stream` (after `pending`) to EOF, or up to `marker` when one is given, keeping the
    first `limit` bytes and counting the rest, so a flood of output costs no memory."""
    kept = bytearray()
    dropped = 0

    def keep(data: bytes) -> None:
        nonlocal dropped
        room = max(limit - len(kept), 0)
        kept.extend(data[:room])
        dropped += max(len(data) - room, 0)

    buffer = pending
    while True:
        if marker is not None and (index := buffer.find(marker)) >= 0:
            keep(buffer[:index])
            return Captured(bytes(kept), dropped, buffer[index + len(marker) :])
        # Hold back what could be the start of a marker split across two reads.
        split = max(len(buffer) - len(marker) + 1, 0) if marker else len(buffer)
        keep(buffer[:split])
        buffer = buffer[split:]
        chunk = await stream.read(READ_CHUNK_BYTES)
        if not chunk:
            keep(buffer)
            return Captured(bytes(kept), dropped)
        buffer += chunk


@dataclass
class RunOutcome:
    """How a sandboxed run to completion ended."""

    exit_code: int | None  # None: killed at the wall-time limit
    stdout: Captured
    stderr: Captured
    runtime_seconds: float
    counters: LimitCounters


class SandboxProcess:
    """A started sandboxed process tree with its cgroup and work dir. `stop` frees all three."""

    def __init__(self, process: asyncio.subprocess.Process, cgroup: Cgroup, workdir: Path):
        self.process = process
        self.cgroup = cgroup
        self.workdir = workdir

    async def counters(self) -> LimitCounters:
        """The cgroup's limit counters now."""
        return await asyncio.to_thread(self.cgroup.counters)

    async def stop(self) -> None:
        """Kills the whole tree, then removes its cgroup and work dir. Safe to call twice."""
        # Cleanup runs in a thread, which finishes even if this task is cancelled meanwhile.
        await asyncio.to_thread(_remove, self.cgroup, self.workdir)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()  # bwrap itself, should killing its cgroup have raced its start
        async with asyncio.timeout(CLEANUP_TIMEOUT_SECONDS):
            await self.process.wait()


class Sandbox:
    """Starts commands in bubblewrap sandboxes. Build with `await Sandbox.create(...)`."""

    def __init__(self, prlimit: str, bwrap_options: Sequence[str], cgroup_parent: Cgroup):
        self._prlimit = prlimit
        self._bwrap_options = list(bwrap_options)  # bwrap and its options but the work dir
        self.cgroup_parent = cgroup_parent  # holds one child cgroup per running sandbox

    @classmethod
    async def create(
        cls,
        bwrap_executable: str,
        readonly_paths: Sequence[str],
        env: Mapping[str, str],
        probe_command: Sequence[str],
        limits: SandboxLimits,
    ) -> "Sandbox":
        """Checks bwrap, the cgroups and the paths, then runs `probe_command` sandboxed.

        Raises SandboxUnavailableError naming what is missing and how to fix it.
        """
        bwrap = shutil.which(bwrap_executable)
        if bwrap is None:
            raise SandboxUnavailableError(
                f"bubblewrap executable {bwrap_executable!r} not found; install it (Debian/"
                "Ubuntu: apt-get install bubblewrap, version 0.8 or newer) or set "
                "bwrap_executable to its path"
            )
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailableError(
                "prlimit not found on PATH; install util-linux (it sets the CPU time and file "
                "size limits)"
            )
        options = await asyncio.to_thread(_bwrap_options, bwrap, readonly_paths, env)
        parent = await asyncio.to_thread(Cgroup.create_parent, f"{PARENT_PREFIX}{os.getpid()}")
        await asyncio.to_thread(parent.remove_stale_siblings, PARENT_PREFIX)
        sandbox = cls(prlimit, options, parent)
        try:
            outcome = await sandbox.run(probe_command, b"", PROBE_TIMEOUT_SECONDS, limits, 4096)
        except BaseException:
            await sandbox.close()
            raise
        if outcome.exit_code != 0:
            await sandbox.close()
            raise SandboxUnavailableError(
                f"a sandboxed test run of {probe_command[0]!r} failed (exit code "
                f"{outcome.exit_code}): {outcome.stderr.text().strip()!r}. If bwrap could not "
                "create namespaces, run the tool service as root or allow unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1, and in Docker "
                "--security-opt seccomp=unconfined --security-opt apparmor=unconfined); an "
                "unknown option means bwrap is older than 0.8"
            )
        return sandbox

    async def start(self, command: Sequence[str], limits: SandboxLimits) -> SandboxProcess:
        """Starts `command` in a fresh sandbox, with pipes for stdin, stdout and stderr."""
        # Starting is shielded: cancelling a subprocess mid-creation can hang Python 3.11's
        # asyncio, and a cgroup made in a thread must not be lost. A cancelled start runs to
        # the end, then stops what it started.
        starting = asyncio.ensure_future(self._start(command, limits))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            await asyncio.wait([starting])
            if starting.exception() is None:
                await starting.result().stop()
            raise

    async def _start(self, command: Sequence[str], limits: SandboxLimits) -> SandboxProcess:
        cgroup, workdir = await asyncio.to_thread(self._prepare, limits)
        try:
            process = await asyncio.create_subprocess_exec(
                *("/bin/sh", "-c", JOIN_CGROUP_SCRIPT, "sh"),
                *(self._prlimit, *_rlimit_options(limits)),
                *self._bwrap_options,
                *("--bind", str(workdir), WORKSPACE, "--chdir", WORKSPACE),
                *READ_ONLY_REMOUNTS,
                "--",
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # Its own session, so no signal aimed at the service's group reaches it.
                start_new_session=True,
                env={"CGROUP_PROCS": " ".join(cgroup.procs_files)},
            )
        except BaseException:
            await asyncio.to_thread(_remove, cgroup, workdir)
            raise
        return SandboxProcess(process, cgroup, workdir)

    async def run(
        self,
        command: Sequence[str],
        stdin: bytes,
        wall_timeout_seconds: float,
        limits: SandboxLimits,
        max_output_bytes: int,
        read_workdir: Callable[[Path], object] | None = None,
    ) -> RunOutcome:
        """Runs `command` to completion with `stdin` as its input, killing the whole tree at
        the wall-time limit; stdout and stderr are kept up to `max_output_bytes` each.
        `read_workdir` is called (in a thread) with the work dir's host path once the tree is
        dead, before the dir is removed."""
        started = time.monotonic()
        sandbox = await self.start(command, limits)
        process = sandbox.process
        reads = [
            asyncio.create_task(read_capped(stream, max_output_bytes))
            for stream in (process.stdout, process.stderr)
        ]
        try:
            try:
                async with asyncio.timeout(wall_timeout_seconds):
                    await _feed(process, stdin)
                    exit_code: int | None = await process.wait()
            except TimeoutError:
                exit_code = None
                await asyncio.to_thread(sandbox.cgroup.kill)
            runtime_seconds = time.monotonic() - started
            # The tree is dead, so the pipes close; only a grandchild that escaped could hold
            # them open, and the cgroup kill in `stop` would end it.
            async with asyncio.timeout(CLEANUP_TIMEOUT_SECONDS):
                stdout, stderr = await asyncio.gather(*reads)
            counters = await sandbox.counters()
            if read_workdir is not None:
                await asyncio.to_thread(read_workdir, sandbox.workdir)
        finally:
            for read in reads:
                read.cancel()
            await sandbox.stop()
        return RunOutcome(exit_code, stdout, stderr, runtime_seconds, counters)

    async def close(self) -> None:
        """Removes the parent cgroup; every started process must have been stopped."""
        try:
            await asyncio.to_thread(self.cgroup_parent.remove_parent)
        except OSError as e:
            log.warning("could not remove sandbox cgroup %s: %s", e.filename, e.strerror)

    def _prepare(self, limits: SandboxLimits) -> tuple[Cgroup, Path]:
        cgroup = self.cgroup_parent.create_child(limits)
        try:
            return cgroup, Path(tempfile.mkdtemp(prefix="turnrl-sandbox-"))
        except BaseException:
            cgroup.remove()
            raise


def _bwrap_options(bwrap: str, readonly_paths: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """bwrap and the options every sandbox shares: namespaces, environment, mounts."""
    missing = [path for path in readonly_paths if not os.path.exists(path)]
    if missing:
        raise SandboxUnavailableError(f"read-only paths to expose do not exist: {missing}")
    args = [
        bwrap,
        "--unshare-all",  # every namespace bwrap knows, the network one included
        "--unshare-user",  # also as root, so the capabilities below are only the sandbox's
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for name, value in env.items():
        args += ["--setenv", name, value]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    for path in dict.fromkeys(readonly_paths):
        args += ["--ro-bind", path, path]
    return [*args, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]


def _rlimit_options(limits: SandboxLimits) -> list[str]:
    """prlimit's options for `limits`: CPU time and file size, and no core dumps."""
    cpu = limits.cpu_time_seconds
    # At the soft limit the kernel sends SIGXCPU; one second later, SIGKILL.
    cpu_limit = f"{cpu}:{cpu + 1}" if cpu is not None else "unlimited"
    return [f"--cpu={cpu_limit}", f"--fsize={limits.max_file_size_bytes}", "--core=0"]


async def _feed(process: asyncio.subprocess.Process, data: bytes) -> None:
    """Writes `data` to the process's stdin and closes it; a process that exits without
    reading it all is not an error."""
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
    process.stdin.close()


def _remove(cgroup: Cgroup, workdir: Path) -> None:
    try:
        cgroup.remove()
    except OSError as e:
        log.warning("could not remove sandbox cgroup %s: %s", e.filename, e.strerror)
    shutil.rmtree(workdir, ignore_errors=True)
