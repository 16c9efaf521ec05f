"""Local launcher: runs the four services as child processes (`turnrl up`, `turnrl run`).

It starts the services the config does not point at (ProjectConfig.services_to_start), and
points the ones it starts at the others. Each child is `python -m turnrl_cli serve <name>` with the same config file and overrides. The
launcher learns each address from the child's first stdout line, waits for gRPC health
SERVING, and supervises: when one child dies it says which and why (exit status and its last
log lines) and stops the others; on Ctrl-C or SIGTERM it stops them all, trainer first.
"""

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from turnrl import rpc
from turnrl.config import ClientConfig, ServerConfig
from turnrl.subprocesses import die_with_parent
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc
from turnrl_cli.project_config import ProjectConfig, load_project_config

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 120.0
# Extra time past a service's own shutdown grace before it is killed.
STOP_SLACK_SECONDS = 5.0
LOG_TAIL_LINES = 20


class ServiceDiedError(RuntimeError):
    """A child service exited when it should be running."""


class StartupInterruptedError(RuntimeError):
    """Ctrl-C or SIGTERM arrived before every service was SERVING."""


@dataclass
class ServiceProcess:
    """One running child service."""

    name: str
    server: ServerConfig
    process: asyncio.subprocess.Process
    address: str = ""
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    log_task: asyncio.Task | None = None

    def client_config(self) -> ClientConfig:
        """How the launcher reaches this service (TLS verified against its own certificate)."""
        return ClientConfig(
            address=self.address,
            tls_ca_file=self.server.tls.cert_file if self.server.tls else None,
            auth_token_env=self.server.auth_token_env,
        )

    def exit_description(self) -> str:
        code = self.process.returncode
        status = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = "\n".join(f"    {line}" for line in self.log_tail) or "    (no output)"
        return f"{self.name} service (pid {self.process.pid}) {status}; its last output:\n{tail}"


async def up(config_path: Path | None, overrides: Sequence[str], check: bool) -> int:
    """`turnrl up`: start the services, print their addresses, supervise until Ctrl-C or a death."""
    project, overrides = await asyncio.to_thread(load_with_tiny_model, config_path, overrides)
    console = Console()
    stop_requested = _stop_on_signals()
    try:
        async with local_services(project, config_path, overrides, stop_requested) as services:
            if check:
                return await _check(services, console)
            console.print(_table(services, {}))
            console.print(f"{len(services)} services SERVING; Ctrl-C stops them")
            return await _supervise(services, stop_requested, console)
    except ServiceDiedError as e:
        Console(stderr=True).print(f"[red]turnrl up: {e}[/red]", highlight=False)
        return 1
    except StartupInterruptedError:
        console.print("interrupted during start-up; stopped all services")
        return 0


async def run(config_path: Path, overrides: Sequence[str], resume: bool) -> int:
    """`turnrl run`: start the services the config does not point at, submit the run
    (StartRun), follow it (StreamProgress) to its end; Ctrl-C stops it after the current step
    (StopRun, with a checkpoint)."""
    project, overrides = await asyncio.to_thread(load_with_tiny_model, config_path, overrides)
    console = Console(stderr=True)
    stop_requested = _stop_on_signals()
    try:
        async with local_services(project, config_path, overrides, stop_requested) as services:
            by_name = {service.name: service for service in services}
            trainer = by_name["trainer"].client_config() if "trainer" in by_name else None
            async with rpc.open_channel(trainer or project.trainer_service) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                request = trainer_pb2.StartRunRequest(
                    config_yaml=_run_config_yaml(project, by_name), resume=resume
                )
                try:
                    reply = await stub.StartRun(request, timeout=60.0)
                except grpc.aio.AioRpcError as e:
                    console.print(
                        f"[red]turnrl run: StartRun failed: {e.code().name}: {e.details()}[/red]",
                        highlight=False,
                    )
                    return 1
                console.print(f"run {reply.run.name!r} started in {reply.run.output_dir}")
                return await follow_run(stub, reply.run, stop_requested, console)
    except ServiceDiedError as e:
        console.print(f"[red]turnrl run: {e}[/red]", highlight=False)
        return 1
    except StartupInterruptedError:
        console.print("interrupted during start-up; stopped all services")
        return 0


def load_with_tiny_model(
    config_path: Path | None, overrides: Sequence[str], services: Sequence[str] | None = None
) -> tuple[ProjectConfig, list[str]]:
    """The config, and the overrides, with `model_path` set for each of `services` (default:
    those to start) that leaves it null: the tiny model of the config's `tiny_model`, built
    here on first use (minutes; cached), so that a service loads it at once instead of racing
    to build it within its start-up timeout. Blocks while it builds."""
    project = load_project_config(config_path, overrides)
    services = project.services_to_start() if services is None else services
    needing = [
        name
        for name in ("rollout", "trainer")
        if name in services and getattr(project, name).model_path is None
    ]
    if not needing:
        return project, list(overrides)
    # Imported here: torch would slow every thin client.
    from turnrl.tiny_model import build_tiny_model

    folder = build_tiny_model(settings=project.tiny_model)
    overrides = [*overrides, *(f"{name}.model_path={folder}" for name in needing)]
    return load_project_config(config_path, overrides), overrides


def _run_config_yaml(project: ProjectConfig, services: dict[str, "ServiceProcess"]) -> str:
    """The config for StartRun, pointing the trainer at the services this launcher started,
    and at the rollout service's tool service when only that one is set."""
    data = project.model_dump(mode="json")
    if "rollout" in services:
        data["trainer"]["rollout_service"]["address"] = services["rollout"].address
    if "tool" in services:
        data["trainer"]["tool_service"]["address"] = services["tool"].address
    elif "tool_service" not in project.trainer.model_fields_set:
        data["trainer"]["tool_service"] = data["rollout"]["tool_service"]
    return yaml.safe_dump(data)


async def follow_run(
    stub: trainer_pb2_grpc.TrainerServiceStub,
    run: trainer_pb2.Run,
    stop_requested: asyncio.Event,
    console: Console,
) -> int:
    """Shows a run's progress until it ends; 0 when it succeeded or was stopped, 1 when it failed."""
    stopper = asyncio.create_task(_stop_run_on_request(stub, run.name, stop_requested, console))
    State = trainer_pb2.Run.State
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
    ) as progress:
        bar = progress.add_task(run.name, total=run.total_steps, status="starting")
        request = trainer_pb2.StreamProgressRequest(run_name=run.name)
        async for event in stub.StreamProgress(request):
            if event.stage == "setup":  # an SFT run counted in epochs knows its length from here
                reply = await stub.GetRun(trainer_pb2.GetRunRequest(run_name=run.name), timeout=30)
                progress.update(bar, total=reply.run.total_steps)
            progress.update(bar, completed=event.step, status=_status_line(event))
            if event.stage in ("eval", "setup", "state") and event.message:
                progress.console.print(f"step {event.step}: {event.stage}: {event.message}")
    stopper.cancel()
    final = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name=run.name), timeout=30)).run
    if final.state == State.STATE_FAILED:
        console.print(f"[red]turnrl run: run failed: {final.error_message}[/red]", highlight=False)
        return 1
    console.print(_summary_table(final))
    return 0


def _status_line(event: trainer_pb2.StreamProgressResponse) -> str:
    shown = {
        "rollout/reward_mean": "reward",
        "eval/accuracy": "eval acc",
        "train/loss": "loss",
        "eval/loss": "eval loss",
        "train/grad_norm": "grad",
        "mismatch/mean_abs_diff": "mismatch",
    }
    return (
        "  ".join(
            f"{label} {event.metrics[name]:.3f}"
            for name, label in shown.items()
            if name in event.metrics
        )
        or event.stage
    )


async def _stop_run_on_request(
    stub: trainer_pb2_grpc.TrainerServiceStub,
    run_name: str,
    stop_requested: asyncio.Event,
    console: Console,
) -> None:
    await stop_requested.wait()
    console.print("stopping the run after its current step (with a checkpoint)")
    await stub.StopRun(trainer_pb2.StopRunRequest(run_name=run_name, save_checkpoint=True))


def _summary_table(run: trainer_pb2.Run) -> Table:
    """The run's summary.json; the last value of each metric, from GetRun, when the trainer
    runs on another machine and the file is there."""
    summary_file = Path(run.output_dir) / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        table = Table(title=f"run summary ({summary_file})")
    else:
        summary = dict(sorted(run.metrics.items()))
        table = Table(title=f"last metrics of run {run.name!r} ({summary_file} is on the trainer)")
    table.add_column("metric")
    table.add_column("value")
    for name, value in summary.items():
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
    return table


@contextlib.asynccontextmanager
async def local_services(
    project: ProjectConfig,
    config_path: Path | None,
    overrides: Sequence[str],
    stop_requested: asyncio.Event,
) -> AsyncIterator[list[ServiceProcess]]:
    """Starts the services the config does not point at, yields them once all are SERVING,
    stops them on exit.

    Raises ServiceDiedError, naming the service and its last output, when one fails to start,
    and StartupInterruptedError when `stop_requested` is set first.
    """
    servers = {
        "tool": project.tool.server,
        "reward": project.reward.server,
        "rollout": project.rollout.server,
        "trainer": project.trainer.server,
    }
    to_start = project.services_to_start()
    services: list[ServiceProcess] = []
    try:
        # Tool and reward first: the rollout service is told where they listen, which for a
        # port of 0 is known only once they serve. The trainer learns the rollout's address
        # from StartRun.
        for stage in (("tool", "reward"), ("rollout", "trainer")):
            started = [
                await _spawn(
                    name,
                    servers[name],
                    config_path,
                    [*overrides, *_peer_addresses(name, project, services)],
                )
                for name in stage
                if name in to_start
            ]
            services += started
            ready = asyncio.gather(*(_wait_ready(service) for service in started))
            interrupted = asyncio.ensure_future(stop_requested.wait())
            await asyncio.wait([ready, interrupted], return_when=asyncio.FIRST_COMPLETED)
            interrupted.cancel()
            if not ready.done():
                ready.cancel()
                raise StartupInterruptedError()
            ready.result()  # raises the first ServiceDiedError
        yield services
    finally:
        await _stop_all(services)


def _peer_addresses(name: str, project: ProjectConfig, started: list[ServiceProcess]) -> list[str]:
    """Overrides pointing service `name` at the services already started, and the rollout
    service at the trainer's tool service when the config sets only that one."""
    if name != "rollout":
        return []
    address = {service.name: service.address for service in started}
    if "tool" not in address and "tool_service" not in project.rollout.model_fields_set:
        address["tool"] = project.trainer.tool_service.address
    return [
        f"rollout.{peer}_service.address={address[peer]}"
        for peer in ("tool", "reward")
        if peer in address
    ]


async def _spawn(
    name: str, server: ServerConfig, config_path: Path | None, overrides: Sequence[str]
) -> ServiceProcess:
    command = [sys.executable, "-m", "turnrl_cli", "serve", name, *overrides]
    if config_path is not None:
        command[5:5] = ["--config", str(config_path)]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children in order.
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    service = ServiceProcess(name=name, server=server, process=process)
    service.log_task = asyncio.create_task(_forward_log(service))
    return service


async def _forward_log(service: ServiceProcess) -> None:
    assert service.process.stderr is not None
    async for raw in service.process.stderr:
        line = raw.decode(errors="replace").rstrip()
        service.log_tail.append(line)
        print(f"[{service.name}] {line}", file=sys.stderr, flush=True)


async def _wait_ready(service: ServiceProcess) -> None:
    assert service.process.stdout is not None
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
            line = await _read_serving_line(service.process.stdout)
            if not line.startswith("serving "):
                await service.process.wait()
                if service.log_task is not None:
                    await service.log_task
                raise ServiceDiedError(service.exit_description())
            host_port = line.rsplit(" ", 1)[-1]
            service.address = _reachable(host_port)
            await rpc.wait_until_serving(
                service.client_config(), timeout_seconds=STARTUP_TIMEOUT_SECONDS
            )
    except TimeoutError:
        raise ServiceDiedError(
            f"{service.name} service (pid {service.process.pid}) did not report SERVING within "
            f"{STARTUP_TIMEOUT_SECONDS:.0f}s"
        ) from None


async def _read_serving_line(stdout: asyncio.StreamReader) -> str:
    """The child's `serving ...` line, past any `metrics of ...` line; "" when it exits first."""
    while line := (await stdout.readline()).decode():
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


def _stop_on_signals() -> asyncio.Event:
    """An event set by Ctrl-C (SIGINT) or SIGTERM, which then no longer kill the launcher."""
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_requested.set)
    return stop_requested


async def _supervise(
    services: list[ServiceProcess], stop_requested: asyncio.Event, console: Console
) -> int:
    waiters = {asyncio.create_task(s.process.wait()): s for s in services}
    stop_waiter = asyncio.create_task(stop_requested.wait())
    done, _ = await asyncio.wait([stop_waiter, *waiters], return_when=asyncio.FIRST_COMPLETED)
    for task in [stop_waiter, *waiters]:
        task.cancel()
    dead = [waiters[task] for task in done if task in waiters]
    if dead:
        if dead[0].log_task is not None:
            await dead[0].log_task
        Console(stderr=True).print(
            f"[red]turnrl up: {dead[0].exit_description()}[/red]", highlight=False
        )
        console.print("stopping the other services")
        return 1
    console.print("stopping all services")
    return 0


async def _stop_all(services: list[ServiceProcess]) -> None:
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
                    "%s service did not stop in time; killing pid %d", service.name, process.pid
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                await process.wait()
        if service.log_task is not None:
            await service.log_task


async def _check(services: list[ServiceProcess], console: Console) -> int:
    listed: dict[str, list[str]] = {}
    for service in services:
        async with rpc.open_channel(service.client_config()) as channel:
            listed[service.name] = await rpc.list_services(channel, timeout_seconds=10.0)
    console.print(_table(services, listed))
    expected = {f"turnrl.v1.{service.name.capitalize()}Service" for service in services}
    missing = expected - {name for names in listed.values() for name in names}
    if missing:
        console.print(f"[red]turnrl up --check: not served: {sorted(missing)}[/red]")
        return 1
    console.print(
        f"check passed: {len(services)} services SERVING over gRPC health, each listed by "
        "reflection"
    )
    return 0


def _table(services: list[ServiceProcess], listed: dict[str, list[str]]) -> Table:
    table = Table(title="turnrl services")
    for column in ("service", "address", "pid", "health", "reflection"):
        table.add_column(column)
    for service in services:
        names = [n for n in listed.get(service.name, []) if n.startswith("turnrl.")]
        table.add_row(
            service.name,
            service.address,
            str(service.process.pid),
            "SERVING",
            ", ".join(names) or "-",
        )
    return table
