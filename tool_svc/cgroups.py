"""The cgroup a sandboxed process tree runs in: memory and process-count limits, counters of how
often they struck, and the kill and removal of everything left in it, on cgroup v1 (one hierarchy
per controller) or v2 (one unified hierarchy). `tool_svc.sandbox` puts each run in one.
All I/O here is blocking sysfs access: async callers use a thread.
"""

import contextlib
import errno
import itertools
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import tenacity

from turnrl.errors import FailedPreconditionError

log = logging.getLogger(__name__)

# The memory controller's files by cgroup version: (limit, swap limit, counter with oom_kill).
MEMORY_FILES = {
    1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control"),
    2: ("memory.max", "memory.swap.max", "memory.events"),
}
CLEANUP_TIMEOUT_SECONDS = 5.0


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
