"""The local launcher's two commands, `turnrl up` and `turnrl run`, start to end: the config
with its model paths (`model_paths`), the services as child processes (`processes`), then
`up` prints their addresses (or checks them) and supervises until Ctrl-C or a death, and
`run` submits the run to the trainer (StartRun) and follows it (`progress`).
"""

import asyncio
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from turnrl import errors, rpc
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc
from turnrl_cli.model_paths import load_with_tiny_model
from turnrl_cli.processes import (
    ServiceDiedError,
    ServiceProcess,
    StartupInterruptedError,
    local_services,
    stop_on_signals,
    supervise,
)
from turnrl_cli.progress import follow_run
from turnrl_cli.project_config import ProjectConfig


async def up(config_path: Path | None, overrides: Sequence[str], check: bool) -> int:
    """`turnrl up`: start the services, print their addresses, supervise until Ctrl-C or a death."""
    project, overrides = await asyncio.to_thread(load_with_tiny_model, config_path, overrides)
    console = Console()
    stop_requested = stop_on_signals()
    try:
        async with local_services(project, config_path, overrides, stop_requested) as services:
            if check:
                return await _check(services, console)
            console.print(_table(services, {}))
            console.print(f"{len(services)} services SERVING; Ctrl-C stops them")
            return await supervise(services, stop_requested, console)
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
    stop_requested = stop_on_signals()
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
                except errors.RpcError as e:
                    console.print(
                        f"[red]turnrl run: StartRun failed: {e.status}: {e.details}[/red]",
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


def _run_config_yaml(project: ProjectConfig, services: dict[str, ServiceProcess]) -> str:
    """The config for StartRun, pointing the trainer at the rollout service this launcher
    started."""
    data = project.model_dump(mode="json")
    if "rollout" in services:
        data["trainer"]["rollout_service"]["address"] = services["rollout"].address
    return yaml.safe_dump(data)


async def _check(services: list[ServiceProcess], console: Console) -> int:
    """`turnrl up --check`: 0 when every service lists its turnrl.v1 service by reflection."""
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
    """The services' addresses and pids, with the turnrl services each lists (`listed`)."""
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
