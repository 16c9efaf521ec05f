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
command unsandboxed. cgroup v1 (one hierarchy per controller) and v2 (one unified hierarchy)
are both handled by `Cgroup`.
"""

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import tenacity

from turnrl.errors import FailedPreconditionError

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
# The memory controller's files by cgroup version: (limit, swap limit, counter with oom_kill).
MEMORY_FILES = {
    1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control"),
    2: ("memory.max", "memory.swap.max", "memory.events"),
}
# Each sandbox service's cgroup is this prefix plus its pid.
PARENT_PREFIX = "turnrl-sandbox-"
CLEANUP_TIMEOUT_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 30.0
READ_CHUNK_BYTES = 65536


class SandboxUnavailableError(FailedPreconditionError):
    """This machine cannot sandbox code: no bwrap, no namespaces, or no usable cgroup."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed process tree may use."""

    memory_bytes: int
    max_processes: int  # tasks in the cgroup: threads and bwrap's own two processes count
    max_file_size_bytes: int
    cpu_time_seconds: int | None  # None: no rlimit (a long-lived process sets its own)


@dataclass(frozen=True)
class LimitCounters:
    """How often a cgroup's limits struck so far."""

    oom_kills: int
    process_limit_hits: int

    def __sub__(self, other: "LimitCounters") -> "LimitCounters":
        return LimitCounters(
            self.oom_kills - other.oom_kills, self.process_limit_hits - other.process_limit_hits
        )


class Cgroup:
    """One cgroup with the memory and pids controllers, on cgroup v1 or v2.

    On v2 both controllers live in one directory; on v1 each has its own hierarchy, so the
    cgroup is a directory in each. All methods do blocking sysfs I/O: call them in a thread.
    """

    def __init__(self, version: int, memory_dir: Path, pids_dir: Path) -> None:
        self.version = version
        self.memory_dir = memory_dir
        self.pids_dir = pids_dir
        self._dirs = (memory_dir,) if memory_dir == pids_dir else (memory_dir, pids_dir)
        self._child_numbers = itertools.count()

    @classmethod
    def create_parent(cls, name: str) -> "Cgroup":
        """Creates the cgroup `name` to hold one child per run, under this process's own
        cgroup (v1; v2 where allowed) or beside it (v2).

        Raises SandboxUnavailableError when neither a usable v2 cgroup with memory and pids
        nor writable v1 memory and pids hierarchies are there.
        """
        mounts = _cgroup_mounts()
        own = _own_cgroups()
        if "cgroup2" in mounts and "" in own:
            own_dir = _own_dir(mounts["cgroup2"], own[""])
            # Listed here means our parent cgroup hands both controllers down to its children.
            if {"memory", "pids"} <= set((own_dir / "cgroup.controllers").read_text().split()):
                return cls._create_v2_parent(own_dir, mounts["cgroup2"][0], name)
        if "memory" in mounts and "pids" in mounts:
            dirs = [_own_dir(mounts[c], own.get(c, "/")) / name for c in ("memory", "pids")]
            try:
                for path in dirs:
                    path.mkdir(exist_ok=True)
            except OSError as e:
                raise SandboxUnavailableError(
                    f"cannot create a cgroup at {e.filename!r} ({e.strerror}); the sandbox "
                    "needs write access to the cgroup v1 memory and pids hierarchies (run the "
                    "tool service as root, or in a container with a writable /sys/fs/cgroup)"
                ) from e
            return cls(1, dirs[0], dirs[1])
        raise SandboxUnavailableError(
            "no cgroup with the memory and pids controllers is available (looked for cgroup v2 "
            "listing them in this process's cgroup.controllers, and for cgroup v1 memory and "
            "pids mounts in /proc/self/mountinfo); the sandbox needs them to limit memory and "
            "processes. Run the tool service as root where /sys/fs/cgroup is writable and "
            "those controllers are enabled for its cgroup"
        )

    @classmethod
    def _create_v2_parent(cls, own_dir: Path, mount_point: Path, name: str) -> "Cgroup":
        # On v2 only a cgroup without processes of its own (or the root) may hand controllers
        # to children. Our own cgroup holds us, so it works only at the root; otherwise the
        # parent goes beside it, in our parent cgroup, which already delegates both.
        bases = [own_dir] if own_dir == mount_point else [own_dir, own_dir.parent]
        problems = []
        for base in bases:
            parent = base / name
            try:
                if not {"memory", "pids"} <= set(
                    (base / "cgroup.subtree_control").read_text().split()
                ):
                    _write(base / "cgroup.subtree_control", "+memory +pids")
                parent.mkdir(exist_ok=True)
                try:
                    _write(parent / "cgroup.subtree_control", "+memory +pids")
                except OSError:
                    parent.rmdir()
                    raise
                return cls(2, parent, parent)
            except OSError as e:
                problems.append(f"{e.filename}: {e.strerror}")
        raise SandboxUnavailableError(
            f"cannot create a cgroup v2 with the memory and pids controllers under {bases} "
            f"({'; '.join(problems)}); the sandbox needs one. Run the tool service as root in "
            "a cgroup whose parent delegates memory and pids (e.g. `systemd-run --scope -p "
            "Delegate=yes turnrl serve tool`); in a container, first move every process out "
            "of the root cgroup (mkdir /sys/fs/cgroup/init, write each pid of "
            "/sys/fs/cgroup/cgroup.procs to /sys/fs/cgroup/init/cgroup.procs, then write "
            "'+memory +pids' to /sys/fs/cgroup/cgroup.subtree_control)"
        )

    def create_child(self, limits: SandboxLimits) -> "Cgroup":
        """A new child cgroup with `limits` applied; remove it with `remove`."""
        name = f"run-{next(self._child_numbers)}"
        child = Cgroup(self.version, self.memory_dir / name, self.pids_dir / name)
        try:
            for path in child._dirs:
                path.mkdir()
            memory_file, swap_file, _ = MEMORY_FILES[self.version]
            _write(child.memory_dir / memory_file, str(limits.memory_bytes))
            # No swapping past the limit; the file is absent without swap accounting.
            swap_limit = "0" if self.version == 2 else str(limits.memory_bytes)
            with contextlib.suppress(FileNotFoundError):
                _write(child.memory_dir / swap_file, swap_limit)
            _write(child.pids_dir / "pids.max", str(limits.max_processes))
        except BaseException:
            child.remove()
            raise
        return child

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to in order to join this cgroup."""
        return [str(path / "cgroup.procs") for path in self._dirs]

    def counters(self) -> LimitCounters:
        """OOM kills and refused forks in this cgroup since it was created."""
        oom_file = MEMORY_FILES[self.version][2]
        return LimitCounters(
            oom_kills=_read_key(self.memory_dir / oom_file, "oom_kill"),
            process_limit_hits=_read_key(self.pids_dir / "pids.events", "max"),
        )

    def kill(self) -> None:
        """Sends SIGKILL to every process in the cgroup (one pass: a process forked meanwhile
        may survive it, which `remove` handles)."""
        kill_file = self.memory_dir / "cgroup.kill"
        if self.version == 2 and kill_file.exists():  # Linux 5.14+: atomic, forks included
            _write(kill_file, "1")
            return
        for path in self._dirs:
            with contextlib.suppress(FileNotFoundError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        """Kills everything in the cgroup and removes it, retrying while it is still busy."""
        for attempt in tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: getattr(e, "errno", 0) == errno.EBUSY),
            stop=tenacity.stop_after_delay(CLEANUP_TIMEOUT_SECONDS),
            wait=tenacity.wait_fixed(0.005),
            reraise=True,
        ):
            with attempt:
                self.kill()
                for path in self._dirs:
                    with contextlib.suppress(FileNotFoundError):
                        path.rmdir()

    def remove_stale_siblings(self, prefix: str) -> None:
        """Removes the cgroups `prefix<pid>` beside this one, and their children, whose
        process is gone: what sandbox services that died without closing left behind."""
        for path in self.memory_dir.parent.glob(f"{prefix}*"):
            pid = path.name.removeprefix(prefix)
            if path == self.memory_dir or not pid.isdigit() or _is_alive(int(pid)):
                continue
            stale = Cgroup(self.version, path, self.pids_dir.parent / path.name)
            try:
                for child in path.glob("run-*"):
                    Cgroup(self.version, child, stale.pids_dir / child.name).remove()
                stale.remove_parent()
            except OSError as e:
                log.warning("could not remove stale sandbox cgroup %s: %s", e.filename, e.strerror)

    def remove_parent(self) -> None:
        """Removes this (parent) cgroup; its children must be gone."""
        for path in self._dirs:
            with contextlib.suppress(FileNotFoundError):
                path.rmdir()


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
    ) -> RunOutcome:
        """Runs `command` to completion with `stdin` as its input, killing the whole tree at
        the wall-time limit; stdout and stderr are kept up to `max_output_bytes` each."""
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


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user
        return True
    return True


def _cgroup_mounts() -> dict[str, tuple[Path, str]]:
    """(mount point, cgroup path mounted there) of the cgroup2 hierarchy, under "cgroup2",
    and of each cgroup v1 controller, under its name."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, fs = line.partition(" - ")
        fs_type, _, super_options = fs.split(" ")[:3]
        root, mount_point = fields.split(" ")[3:5]
        if fs_type == "cgroup2":
            mounts.setdefault("cgroup2", (Path(mount_point), root))
        elif fs_type == "cgroup":
            for option in super_options.split(","):
                mounts.setdefault(option, (Path(mount_point), root))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _own_dir(mount: tuple[Path, str], cgroup_path: str) -> Path:
    """The directory of `cgroup_path` under a mount that may show only a subtree of it."""
    mount_point, root = mount
    relative = os.path.relpath(cgroup_path, root) if cgroup_path.startswith(root) else "."
    return (mount_point / relative).resolve()


def _write(path: Path, text: str) -> None:
    # cgroup files take one write(2) each; a buffered text file could split or delay it.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_key(path: Path, key: str) -> int:
    """The number after `key` in a flat-keyed cgroup file ("key value" lines); 0 if absent."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0
