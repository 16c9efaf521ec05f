"""The launcher's commands, `turnrl up`, `turnrl run` and `turnrl eval`, start to end: the
config with its model paths (`model_paths`), the launch's token and TLS (`launch_token`,
`launch_tls`), the services as child processes (`processes`) or Ray actors
(`ray_services`, `launcher.kind: ray`), then `up` prints their addresses (or checks them) and
supervises until Ctrl-C or a death, `run` submits the run to the trainer (StartRun) and
follows it (`progress`), and `eval` does the same with an evaluation run (`trainer.mode: eval`).
"""

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainer_svc.config import RUN_LOGS_FOLDER
from turnrl import errors, rpc
from turnrl.config import CLIENT_TOKEN_ENV, ClientConfig
from turnrl.errors import ConfigError
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc
from turnrl_cli.launch_tls import (
    CA_CERT,
    launch_tls_dir,
    launch_tls_overrides,
    remove_launch_tls_files,
)
from turnrl_cli.launch_token import LAUNCH_TOKEN_ENV, launch_token_overrides
from turnrl_cli.model_paths import load_with_tiny_model
from turnrl_cli.processes import (
    LaunchedService,
    ServiceDiedError,
    StartupInterruptedError,
    local_services,
    peer_tls_ca_file,
    peer_token_env,
    replica_addresses,
    stop_on_signals,
    supervise,
)
from turnrl_cli.progress import eval_table, follow_run, summary_table
from turnrl_cli.project_config import ProjectConfig, load_project_config
from turnrl_cli.run_folder import RunFolderError
from turnrl_cli.run_report import write_report


async def up(config_path: Path | None, overrides: Sequence[str], check: bool) -> int:
    """`turnrl up`: start the services, print their addresses, supervise until Ctrl-C or a death.
    Their output goes to <trainer.output_dir>/logs/<service>.log too."""
    project, overrides = await _load(config_path, overrides)
    console = Console()
    stop_requested = stop_on_signals()
    logs_dir = project.trainer.output_dir / RUN_LOGS_FOLDER
    try:
        async with start_services(
            project, config_path, overrides, stop_requested, logs_dir
        ) as services:
            if check:
                return await _check(services, console)
            console.print(_table(services, {}))
            for service in services:
                if service.gateway_url:
                    console.print(
                        f"{service.label}'s OpenAI-compatible gateway: {service.gateway_url} "
                        f"(an agent's base_url: {service.gateway_url}/sessions/<episode>/v1)",
                        highlight=False,
                        soft_wrap=True,
                    )
                if service.http_json_url:
                    console.print(
                        f"{service.label} over HTTP/JSON: {service.http_json_url} "
                        f"(POST /v1/<Service>/<Method>; {service.http_json_url}/openapi.json)",
                        highlight=False,
                        soft_wrap=True,
                    )
            if token := os.environ.get(LAUNCH_TOKEN_ENV):
                console.print(
                    "They take this launch's bearer token (launcher.auth_token); for turnrl's "
                    f"client commands: export {CLIENT_TOKEN_ENV}={token}",
                    highlight=False,
                    soft_wrap=True,
                )
            if tls_dir := launch_tls_dir():
                console.print(
                    "They serve TLS with this launch's certificates (launcher.tls); turnrl's "
                    f"client commands verify them with --tls-ca {tls_dir / CA_CERT}",
                    highlight=False,
                    soft_wrap=True,
                )
            console.print(f"{len(services)} services SERVING; Ctrl-C stops them")
            return await supervise(services, project.launcher.restart, stop_requested, console)
    except ServiceDiedError as e:
        Console(stderr=True).print(f"[red]turnrl up: {escape(str(e))}[/red]", highlight=False)
        return 1
    except StartupInterruptedError:
        console.print("interrupted during start-up; stopped all services")
        return 0


async def evaluate(
    config_path: Path, overrides: Sequence[str], model: Path, output: Path | None
) -> int:
    """`turnrl eval`: `run` an evaluation run (`trainer.mode: eval`) of the model folder
    `model`, which the rollout service serves, written to `output` (default:
    <trainer.output_dir>/eval-<model folder's name>); prints its metrics per data source."""
    if output is None:
        project = await asyncio.to_thread(load_project_config, config_path, overrides)
        output = project.trainer.output_dir / f"eval-{model.name or 'model'}"
    evaluation = [
        "trainer.mode=eval",
        f"trainer.model_path={model}",
        f"rollout.model_path={model}",
        f"trainer.output_dir={output.parent}",
        f"trainer.run_name={output.name}",
    ]
    return await run(config_path, [*overrides, *evaluation], False, final_table=eval_table)


async def run(
    config_path: Path,
    overrides: Sequence[str],
    resume: bool,
    resume_from: str | None = None,
    final_table: Callable[[trainer_pb2.Run], Table] = summary_table,
) -> int:
    """`turnrl run`: start the services the config does not point at, submit the run
    (StartRun), follow it (StreamProgress) to its end and print `final_table` of it; Ctrl-C
    stops it after the current step (StopRun, with a checkpoint). The services' output goes
    to the run's folder too: <trainer.output_dir>/<trainer.run_name>/logs/<service>.log. Once
    the services stopped, the run's report page (report.html in its folder: `turnrl report`)
    is written."""
    project, overrides = await _load(config_path, overrides)
    console = Console(stderr=True)
    stop_requested = stop_on_signals()
    logs_dir = project.trainer.output_dir / project.trainer.run_name / RUN_LOGS_FOLDER
    try:
        async with start_services(
            project, config_path, overrides, stop_requested, logs_dir
        ) as services:
            trainers = [s for s in services if s.name == "trainer" and s.replica == 0]
            trainer = trainers[0].client_config() if trainers else project.trainer_service
            # A trainer this launch restarts gets the run again, to resume.
            restarted = bool(trainers) and project.launcher.restart.trainer.mode == "on-failure"
            supervisor = asyncio.create_task(
                _supervise_run(services, project, stop_requested, console)
            )
            try:
                code = await _submit_and_follow(
                    trainer,
                    trainer_pb2.StartRunRequest(
                        config_yaml=_run_config_yaml(project, services),
                        resume=resume,
                        resume_from=resume_from or "",
                    ),
                    supervisor if restarted else None,
                    project.launcher.startup_timeout_seconds,
                    stop_requested,
                    console,
                    final_table,
                )
            finally:  # before the services stop: none is started again on the way out
                supervisor.cancel()
            gave_up = supervisor.done() and not supervisor.cancelled() and supervisor.result()
    except ServiceDiedError as e:
        console.print(f"[red]turnrl run: {escape(str(e))}[/red]", highlight=False)
        return 1
    except StartupInterruptedError:
        console.print("interrupted during start-up; stopped all services")
        return 0
    code = 1 if gave_up else code
    if code == 0:  # after the services stopped: the page's path is the launch's last line
        await _write_report(logs_dir.parent, console)
    return code


async def _write_report(run_dir: Path, console: Console) -> None:
    """Writes the run's report page (`turnrl report`) when its folder is here: a trainer
    service elsewhere keeps the run's files on its own machine."""
    try:
        page = await asyncio.to_thread(write_report, run_dir)
    except RunFolderError:
        return
    console.print(f"report: {page}", soft_wrap=True, highlight=False)


async def _load(
    config_path: Path | None, overrides: Sequence[str]
) -> tuple[ProjectConfig, list[str]]:
    """The config with its model paths (`load_with_tiny_model`), this launch's token and TLS
    certificates, when it makes them (`launch_token_overrides`, `launch_tls_overrides`), and
    the overrides that say so to the services. The token is decided first: a service given
    the launch's TLS keeps the token it needs as much."""
    project, overrides = await asyncio.to_thread(load_with_tiny_model, config_path, overrides)
    if token_overrides := launch_token_overrides(project):
        overrides = [*overrides, *token_overrides]
        project = load_project_config(config_path, overrides)
    if tls_overrides := await asyncio.to_thread(launch_tls_overrides, project):
        overrides = [*overrides, *tls_overrides]
        project = load_project_config(config_path, overrides)
    return project, overrides


async def _submit_and_follow(
    trainer: ClientConfig,
    request: trainer_pb2.StartRunRequest,
    supervisor: asyncio.Task | None,
    startup_timeout_seconds: float,
    stop_requested: asyncio.Event,
    console: Console,
    final_table: Callable[[trainer_pb2.Run], Table],
) -> int:
    """Submits the run (StartRun) and follows it to its end (`follow_run`); 1 when StartRun
    fails. With the `supervisor` of a trainer that this launch starts again when it dies
    (`launcher.restart.trainer`), a trainer lost mid-run gets the run again, with resume,
    once it is back within `startup_timeout_seconds`: the run continues from its last
    checkpoint. Without, the loss is raised."""
    while True:
        async with rpc.open_channel(trainer) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            try:
                reply = await stub.StartRun(request, timeout=60.0)
            except errors.RpcError as e:
                console.print(
                    f"[red]turnrl run: StartRun failed: {e.status}: {e.details}[/red]",
                    highlight=False,
                )
                return 1
            verb = "resumed" if request.resume else "started"
            console.print(
                f"run {reply.run.name!r} {verb} in {reply.run.output_dir}", soft_wrap=True
            )
            try:
                return await follow_run(stub, reply.run, stop_requested, console, final_table)
            except errors.UnavailableError as e:
                if supervisor is None:
                    raise
                console.print(
                    f"the trainer went away mid-run ({e.details}); the run resumes from its "
                    "last checkpoint once the trainer is back",
                    soft_wrap=True,
                )
        if not await _trainer_back(trainer, supervisor, startup_timeout_seconds, stop_requested):
            return 1
        request = trainer_pb2.StartRunRequest(config_yaml=request.config_yaml, resume=True)


async def _trainer_back(
    trainer: ClientConfig,
    supervisor: asyncio.Task,
    startup_timeout_seconds: float,
    stop_requested: asyncio.Event,
) -> bool:
    """Waits until the restarted trainer is SERVING again at its address, as long as its
    start may take (`launcher.startup_timeout_seconds`, which its supervisor allows it too);
    False when its supervisor gave up on it, or Ctrl-C came, first."""
    back = asyncio.ensure_future(
        rpc.wait_until_serving(trainer, timeout_seconds=startup_timeout_seconds)
    )
    stopped = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([back, supervisor, stopped], return_when=asyncio.FIRST_COMPLETED)
    back.cancel()
    stopped.cancel()
    return back.done() and not back.cancelled() and back.exception() is None


async def _supervise_run(
    services: list[LaunchedService],
    project: ProjectConfig,
    stop_requested: asyncio.Event,
    console: Console,
) -> int:
    """Restarts the run's services as their policies say; when one dies for good, stops the
    run after its current step, with a checkpoint (`follow_run` sends StopRun), and returns 1:
    a run never goes on without a service."""
    code = await supervise(services, project.launcher.restart, stop_requested, console)
    if code:
        stop_requested.set()
    return code


@contextlib.asynccontextmanager
async def start_services(
    project: ProjectConfig,
    config_path: Path | None,
    overrides: Sequence[str],
    stop_requested: asyncio.Event,
    logs_dir: Path,
) -> AsyncIterator[list[LaunchedService]]:
    """The services of `launcher.kind`: local processes, their output appended to
    `logs_dir/<service>.log` too, or Ray actors (their output is Ray's). This launch's TLS
    files (`launch_tls`) are removed once they stopped."""
    try:
        if project.launcher.kind == "local":
            async with local_services(
                project, config_path, overrides, stop_requested, logs_dir
            ) as started:
                yield started
            return
        try:
            from turnrl_cli.ray_services import ray_services  # only with the ray extra installed
        except ImportError as e:
            raise ConfigError(
                f"launcher.kind ray needs Ray: pip install 'turnrl[ray]' ({e})"
            ) from None
        async with ray_services(project, config_path, overrides, stop_requested) as started:
            yield started
    finally:
        remove_launch_tls_files()


def _run_config_yaml(project: ProjectConfig, services: list[LaunchedService]) -> str:
    """The config for StartRun, pointing the trainer at the rollout replicas this launcher
    started, and the replicas at the trainer's node for weight sync when it runs on Ray."""
    data = project.model_dump(mode="json")
    if rollout := replica_addresses(services, "rollout"):
        data["trainer"]["rollout_service"]["address"] = rollout
        if token_env := peer_token_env(services, "rollout"):
            data["trainer"]["rollout_service"]["auth_token_env"] = token_env
        if ca_file := peer_tls_ca_file(services, "rollout"):
            data["trainer"]["rollout_service"]["tls_ca_file"] = str(ca_file)
    trainer = [s for s in services if s.name == "trainer" and s.replica == 0]
    if trainer and trainer[0].node_address:
        data["trainer"]["weight_sync"]["master_address"] = trainer[0].node_address
    return yaml.safe_dump(data)


async def _check(services: list[LaunchedService], console: Console) -> int:
    """`turnrl up --check`: 0 when every service lists its turnrl.v1 service by reflection."""
    listed: dict[str, list[str]] = {}
    for service in services:
        if not service.address:  # a trainer rank that follows rank 0
            continue
        async with rpc.open_channel(service.client_config()) as channel:
            listed[service.label] = await rpc.list_services(channel, timeout_seconds=10.0)
    console.print(_table(services, listed))
    expected = {f"turnrl.v1.{service.name.capitalize()}Service" for service in services}
    missing = expected - {name for names in listed.values() for name in names}
    if missing:
        console.print(f"[red]turnrl up --check: not served: {escape(str(sorted(missing)))}[/red]")
        return 1
    console.print(
        f"check passed: {len(services)} services SERVING over gRPC health, each listed by "
        "reflection"
    )
    return 0


def _table(services: list[LaunchedService], listed: dict[str, list[str]]) -> Table:
    """The services' addresses and places, with the turnrl services each lists (`listed`)."""
    table = Table(title="turnrl services")
    for column in ("service", "address", "where", "health", "reflection"):
        table.add_column(column)
    for service in services:
        names = [n for n in listed.get(service.label, []) if n.startswith("turnrl.")]
        table.add_row(
            service.label,
            service.address or "-",
            service.where,
            "SERVING" if service.address else "follows rank 0",
            ", ".join(names) or "-",
        )
    return table
