"""The local services as child processes: start, supervise, stop (`turnrl up`, `turnrl run`).

`local_services` starts the services the config does not point at
(ProjectConfig.services_to_start), each as many times as its `replicas`, and points the ones it
starts at the others (all replicas of a peer, comma-separated). Each child is
`python -m turnrl_cli serve <name>` with the same config file and overrides, in a session of
its own, dying with its parent; replica i > 0 of a service with a fixed port takes any free one. The address of each comes from the child's first stdout line
(`serving ... on HOST:PORT`); it is ready at gRPC health SERVING. `supervise` waits for Ctrl-C
or SIGTERM (`stop_on_signals`) or a child's death, which it reports with the exit status and
the child's last log lines; on the way out every child is stopped, trainer first. Each child's
output is copied to the launcher's stderr, prefixed with its name, and to a log file of its own.
"""

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.markup import escape

from rollout_svc.gateway import GATEWAY_LINE
from turnrl import rpc
from turnrl.config import ClientConfig, HttpJsonServerConfig, ServerConfig
from turnrl.rpc.http_json import HTTP_JSON_LINE
from turnrl.subprocesses import die_with_parent
from turnrl_cli.launch_tls import trusted_ca_file
from turnrl_cli.project_config import ProjectConfig, RestartPolicies, RestartPolicy

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 120.0
# Extra time past a service's own shutdown grace before it is killed.
STOP_SLACK_SECONDS = 5.0
LOG_TAIL_LINES = 20


# Tool and reward first: the rollout service is told where they listen, which for a port of 0
# is known only once they serve. The trainer learns the rollout's address from StartRun.
START_STAGES = (("tool", "reward"), ("rollout", "trainer"))


class ServiceDiedError(RuntimeError):
    """A child service exited when it should be running."""


class StartupInterruptedError(RuntimeError):
    """Ctrl-C or SIGTERM arrived before every service was SERVING."""


class LaunchedService(Protocol):
    """A service replica a launcher started: a local `ServiceProcess` or a Ray `RayService`."""

    name: str
    replica: int  # the trainer's: its rank
    address: str  # "" for a trainer rank > 0, which serves nothing
    gateway_url: str  # a rollout service's OpenAI-compatible gateway; "" when none is known
    http_json_url: str  # a tool or reward service's HTTP/JSON port; "" when none is known
    node_address: str  # the node it runs on; "" for this machine
    restarts: int  # by the launcher's supervisor

    @property
    def label(self) -> str: ...

    @property
    def returncode(self) -> int | None:
        """The exit status of its process once it ended (negative: killed by that signal)."""

    async def restart(self) -> None: ...

    @property
    def where(self) -> str: ...

    def client_config(self) -> ClientConfig: ...

    async def wait(self) -> None: ...

    def exit_description(self) -> str: ...


@dataclass
class ServiceProcess:
    """One running child service, and how to start it again."""

    name: str
    server: ServerConfig
    command: list[str]  # `python -m turnrl_cli serve NAME ...`
    env: dict[str, str] | None  # added to this process's environment
    process: asyncio.subprocess.Process | None = None
    replica: int = 0
    address: str = ""
    gateway_url: str = ""  # the rollout service's OpenAI-compatible gateway, when it serves one
    http_json_url: str = ""  # its methods as JSON over HTTP (server.http_port), when served
    node_address: str = ""  # this machine
    restarts: int = 0
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    log_task: asyncio.Task | None = None
    startup_timeout_seconds: float = STARTUP_TIMEOUT_SECONDS
    log_path: Path | None = None  # where its output is appended too, across restarts
    log_file: TextIO | None = None  # log_path, open from the first start to the stop

    async def start(self) -> None:
        """Starts the child process, its log copied to ours (and to `log_path`, after a line
        marking the start)."""
        if self.log_path is not None:
            if self.log_file is None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self.log_file = self.log_path.open("a", buffering=1)  # line by line
            how = f"restart {self.restarts}" if self.restarts else "start"
            self.write_log(f"turnrl: {how} of the {self.label} service at {time.ctime()}")
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children
            # in order.
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=None if self.env is None else {**os.environ, **self.env},
        )
        self.log_task = asyncio.create_task(_forward_log(self))

    async def restart(self) -> None:
        """Starts the service again, at the address it had (its callers reconnect there), once
        its process ended; raises ServiceDiedError when it fails to start."""
        port = self.address.rpartition(":")[2]
        if f"{self.name}.server.port={port}" not in self.command:
            self.command.append(f"{self.name}.server.port={port}")
        self.restarts += 1
        await self.start()
        await wait_ready(self)

    def client_config(self) -> ClientConfig:
        return launcher_client_config(self.server, self.address)

    def write_log(self, line: str) -> None:
        """Appends a line to the service's log file, when it has one."""
        if self.log_file is not None:
            self.log_file.write(line + "\n")

    @property
    def label(self) -> str:
        """The service's name, with its replica number after the first."""
        return f"{self.name}#{self.replica}" if self.replica else self.name

    @property
    def where(self) -> str:
        return f"pid {self.process.pid}"

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def wait(self) -> None:
        """Returns when the child exits, its last output read."""
        await self.process.wait()
        if self.log_task is not None:
            await self.log_task

    def exit_description(self) -> str:
        return exit_description(
            f"{self.label} service ({self.where})", self.returncode, self.log_tail
        )


def launcher_client_config(server: ServerConfig, address: str) -> ClientConfig:
    """How the launcher reaches a service it started at `address` (TLS verified against this
    launch's CA, or the service's own certificate: `trusted_ca_file`)."""
    return ClientConfig(
        address=address,
        tls_ca_file=trusted_ca_file(server),
        auth_token_env=server.auth_token_env,
    )


def exit_description(who: str, code: int, log_tail: Sequence[str]) -> str:
    """How a service's process ended (`code`, negative for a signal), with its last output."""
    status = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    tail = "\n".join(f"    {line}" for line in log_tail) or "    (no output)"
    return f"{who} {status}; its last output:\n{tail}"


@contextlib.asynccontextmanager
async def local_services(
    project: ProjectConfig,
    config_path: Path | None,
    overrides: Sequence[str],
    stop_requested: asyncio.Event,
    logs_dir: Path,
) -> AsyncIterator[list[ServiceProcess]]:
    """Starts the services the config does not point at, yields them once all are SERVING,
    stops them on exit. Each one's output goes to `logs_dir/<name>.log` too (`<name>#<i>.log`
    for replica i > 0), appended, after a line marking each start.

    Raises ServiceDiedError, naming the service and its last output, when one fails to start,
    and StartupInterruptedError when `stop_requested` is set first.
    """
    to_start = project.services_to_start()
    services: list[ServiceProcess] = []
    try:
        for stage in START_STAGES:
            started = [
                await spawn(
                    name,
                    replica,
                    project.server(name),
                    config_path,
                    [
                        *overrides,
                        *replica_overrides(name, replica, project.server(name)),
                        *peer_addresses(name, services),
                    ],
                    startup_timeout_seconds=project.launcher.startup_timeout_seconds,
                    logs_dir=logs_dir,
                )
                for name in stage
                if name in to_start
                for replica in range(project.replicas(name))
            ]
            services += started
            await ready_unless_stopped(
                asyncio.gather(*(wait_ready(service) for service in started)), stop_requested
            )
        yield services
    finally:
        await stop_processes(services)


async def ready_unless_stopped(ready: Awaitable[Any], stop_requested: asyncio.Event) -> None:
    """Waits for `ready` (which raises ServiceDiedError for a service that failed to start);
    raises StartupInterruptedError when `stop_requested` is set first."""
    ready = asyncio.ensure_future(ready)
    interrupted = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([ready, interrupted], return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if not ready.done():
        ready.cancel()
        raise StartupInterruptedError()
    ready.result()


def peer_addresses(name: str, started: Sequence[LaunchedService]) -> list[str]:
    """Overrides pointing service `name` at the services already `started`: the rollout
    service at every replica of the tool and reward services, sending the token each
    requires (`peer_token_env`) and verifying the TLS each serves (`peer_tls_ca_file`)."""
    if name != "rollout":
        return []
    overrides = []
    for peer in ("tool", "reward"):
        if addresses := replica_addresses(started, peer):
            overrides.append(f"rollout.{peer}_service.address={addresses}")
            if token_env := peer_token_env(started, peer):
                overrides.append(f"rollout.{peer}_service.auth_token_env={token_env}")
            if ca_file := peer_tls_ca_file(started, peer):
                overrides.append(f"rollout.{peer}_service.tls_ca_file={ca_file}")
    return overrides


def peer_tls_ca_file(started: Sequence[LaunchedService], name: str) -> Path | None:
    """The CA file that callers of the started service `name` verify its TLS with
    (`trusted_ca_file`: this launch's CA, the same path on every node); None for plaintext."""
    servers = [service.server for service in started if service.name == name]
    return trusted_ca_file(servers[0]) if servers else None


def peer_token_env(started: Sequence[LaunchedService], name: str) -> str | None:
    """The environment variable holding the token that the started service `name` requires
    (its `server.auth_token_env`, the launch's own token's for one without), which its
    callers started beside it have too; None when it requires none."""
    servers = [service.server for service in started if service.name == name]
    return servers[0].auth_token_env if servers else None


def replica_addresses(started: Sequence[LaunchedService], name: str) -> str:
    """The addresses of the replicas of service `name` among `started`, comma-separated (a
    ClientConfig address); "" when none."""
    return ",".join(service.address for service in started if service.name == name)


def replica_overrides(name: str, replica: int, server: ServerConfig) -> list[str]:
    """Replica i > 0 listens on any free port (and serves metrics and HTTP/JSON on one) where
    the config fixes them: the first replica has the config's."""
    if replica == 0:
        return []
    overrides = [f"{name}.server.port=0"] if server.port else []
    if server.metrics_port:
        overrides.append(f"{name}.server.metrics_port=0")
    if isinstance(server, HttpJsonServerConfig) and server.http_port:
        overrides.append(f"{name}.server.http_port=0")
    return overrides


async def spawn(
    name: str,
    replica: int,
    server: ServerConfig,
    config_path: Path | None,
    overrides: Sequence[str],
    env: dict[str, str] | None = None,
    startup_timeout_seconds: float = STARTUP_TIMEOUT_SECONDS,
    logs_dir: Path | None = None,
) -> ServiceProcess:
    """Starts `python -m turnrl_cli serve NAME` with the config file and `overrides`, and
    `env` added to this process's environment, its output appended to `logs_dir/LABEL.log`
    too when `logs_dir` is set; `wait_ready` then waits for it up to
    `startup_timeout_seconds`."""
    command = [sys.executable, "-m", "turnrl_cli", "serve", name, *overrides]
    if config_path is not None:
        command[5:5] = ["--config", str(config_path)]
    service = ServiceProcess(
        name,
        server,
        command,
        env,
        replica=replica,
        startup_timeout_seconds=startup_timeout_seconds,
    )
    if logs_dir is not None:
        service.log_path = logs_dir / f"{service.label}.log"
    await service.start()
    return service


async def _forward_log(service: ServiceProcess) -> None:
    """Copies the child's stderr to ours, each line prefixed with the service's name, keeping
    the last LOG_TAIL_LINES for `exit_description`."""
    assert service.process.stderr is not None
    async for raw in service.process.stderr:
        line = raw.decode(errors="replace").rstrip()
        service.log_tail.append(line)
        service.write_log(line)
        print(f"[{service.label}] {line}", file=sys.stderr, flush=True)


async def wait_ready(service: ServiceProcess) -> None:
    """Sets the child's address from its `serving` line and waits for health SERVING; raises
    ServiceDiedError when it exits first, or when it takes longer than its
    startup_timeout_seconds, after killing it (a restart that hangs is retried, or given up
    on, as its restart policy says)."""
    timeout_seconds = service.startup_timeout_seconds
    try:
        async with asyncio.timeout(timeout_seconds):
            line = await _read_serving_line(service)
            if not line.startswith("serving "):
                await service.process.wait()
                if service.log_task is not None:
                    await service.log_task
                raise ServiceDiedError(service.exit_description())
            host_port = line.rsplit(" ", 1)[-1]
            service.address = _reachable(host_port)
            await rpc.wait_until_serving(service.client_config(), timeout_seconds=timeout_seconds)
    except TimeoutError:
        reason = (
            f"did not report SERVING within {timeout_seconds:g}s "
            "(launcher.startup_timeout_seconds); killed"
        )
        # Killed, not left hanging: its supervisor waits for its end (`wait`) to start it
        # again. The whole process group: its session holds torchrun's ranks, an engine.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.process.pid, signal.SIGKILL)
        service.log_tail.append(f"turnrl: {reason}")
        raise ServiceDiedError(
            f"{service.label} service (pid {service.process.pid}) {reason}"
        ) from None


async def _read_serving_line(service: ServiceProcess) -> str:
    """The child's `serving ...` line, past any other (its gateway's URL is kept as
    `gateway_url`, its HTTP/JSON port's as `http_json_url`); "" when it exits first."""
    assert service.process is not None and service.process.stdout is not None
    while line := (await service.process.stdout.readline()).decode():
        service.write_log(line.rstrip())
        if line.startswith(GATEWAY_LINE):
            service.gateway_url = line.removeprefix(GATEWAY_LINE).strip()
        if line.startswith(HTTP_JSON_LINE):  # `HTTP/JSON of ToolService on <url>`
            service.http_json_url = line.rpartition(" on ")[2].strip()
        if line.startswith("serving "):
            return line.strip()
    return ""


def _reachable(host_port: str) -> str:
    """The address a local client dials for a server bound to `host_port` (0.0.0.0 -> loopback)."""
    host, _, port = host_port.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def stop_on_signals() -> asyncio.Event:
    """An event set by Ctrl-C (SIGINT) or SIGTERM, which then no longer kill the launcher."""
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_requested.set)
    return stop_requested


async def supervise(
    services: Sequence[LaunchedService],
    restart: RestartPolicies,
    stop_requested: asyncio.Event,
    console: Console,
) -> int:
    """Waits for `stop_requested` (0), starting each service that dies again as its `restart`
    policy says (it reports why on stderr, with the exit status and the last output); 1 when
    one dies that its policy does not restart. The caller's `local_services` (or
    `ray_services`) then stops the rest."""
    waiters = {asyncio.create_task(s.wait()): s for s in services}
    stop_waiter = asyncio.create_task(stop_requested.wait())
    try:
        while True:
            done, _ = await asyncio.wait(
                [stop_waiter, *waiters], return_when=asyncio.FIRST_COMPLETED
            )
            if stop_waiter in done:
                console.print("stopping all services")
                return 0
            for task in done:
                service = waiters.pop(task)
                if not await _restarted(service, getattr(restart, service.name), stop_requested):
                    Console(stderr=True).print(
                        f"[red]turnrl: {escape(service.exit_description())}[/red]", highlight=False
                    )
                    console.print("stopping the other services")
                    return 1
                waiters[asyncio.create_task(service.wait())] = service
    finally:
        for task in [stop_waiter, *waiters]:
            task.cancel()


async def _restarted(
    service: LaunchedService, policy: RestartPolicy, stop_requested: asyncio.Event
) -> bool:
    """Starts a dead `service` again after its back-off, if `policy` allows; whether it did
    (a start that fails counts as a restart: its death is seen at once)."""
    if policy.mode == "never" or service.returncode == 0 or service.restarts >= policy.max_restarts:
        return False
    wait = min(policy.backoff_seconds * 2**service.restarts, policy.max_backoff_seconds)
    Console(stderr=True).print(
        f"[yellow]turnrl: {escape(service.exit_description())}\nrestarting it in {wait:.1f}s "
        f"(restart {service.restarts + 1} of {policy.max_restarts})[/yellow]",
        highlight=False,
    )
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop_requested.wait(), timeout=wait)
    if stop_requested.is_set():
        return True  # stopping anyway
    try:
        await service.restart()
    except ServiceDiedError as e:
        log.error("%s", e)
    return True


async def stop_processes(services: list[ServiceProcess]) -> None:
    """SIGTERM to each child in reverse start order (callers first), SIGKILL to one still
    running past its shutdown grace plus STOP_SLACK_SECONDS."""
    for service in reversed(services):
        process = service.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(
                    service.server.shutdown_grace_seconds + STOP_SLACK_SECONDS
                ):
                    await process.wait()
            except TimeoutError:
                log.warning(
                    "%s service did not stop in time; killing pid %d", service.label, process.pid
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                await process.wait()
        if service.log_task is not None:
            await service.log_task
        if service.log_file is not None:
            service.log_file.close()
