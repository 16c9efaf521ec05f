"""The services as Ray actors (`launcher.kind: ray`, `turnrl up|run --launcher ray`).

`ray_services` starts what `local_services` starts, on a Ray cluster's nodes: each replica of a
service (each rank of the trainer) is a `ServiceActor` with the resources its section of
`launcher.ray` declares, and the replicas of one service sit in one placement group, packed
onto few nodes or spread over many. The actor runs on its node exactly the server the local
launcher runs, `python -m turnrl_cli serve NAME` with the same config file and overrides, bound
to the node's address (other nodes must reach it) on a free port, and reports the address it
serves at. Services learn each other's addresses from the actors, never by assuming loopback:
the rollout replicas get every tool and reward replica's, the trainer every rollout replica's
(StartRun). The actors are named SERVICE:REPLICA in the launch's namespace.

A trainer of several ranks is one actor per rank, each running the same command with the
env:// rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT at rank 0's node);
rank 0 serves. Ray gives each actor only its own GPUs (CUDA_VISIBLE_DEVICES), so every rank's
LOCAL_RANK is 0.

Every node runs the same turnrl install at the same path as this one (a shared file system or
the same image): the actor starts its server in this process's working directory, with the
config file at its path here.
"""

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from turnrl.config import ClientConfig, HttpJsonServerConfig, ServerConfig
from turnrl.errors import ConfigError
from turnrl_cli.launch_tls import (
    LAUNCH_TLS_DIR_ENV,
    LOOPBACK_NAMES,
    launch_tls_dir,
    node_files,
    remove_launch_tls_files,
    write_node_files,
)
from turnrl_cli.launch_token import LAUNCH_TOKEN_ENV
from turnrl_cli.processes import (
    START_STAGES,
    STOP_SLACK_SECONDS,
    ServiceDiedError,
    ServiceProcess,
    exit_description,
    launcher_client_config,
    peer_addresses,
    ready_unless_stopped,
    spawn,
    stop_processes,
    wait_ready,
)
from turnrl_cli.project_config import (
    SERVICE_NAMES,
    ProjectConfig,
    RayLauncherConfig,
    ServiceResources,
)
from turnrl_cli.ray_plan import ServiceDemand, check_fits, launch_demands

log = logging.getLogger(__name__)


class ServiceActor:
    """One service process on a Ray node: starts `turnrl serve` there, reports its end."""

    def __init__(self, working_dir: str) -> None:
        if not Path(working_dir).is_dir():
            raise FileNotFoundError(
                f"{working_dir} is not on node {ray.util.get_node_ip_address()}: every node "
                "needs the turnrl checkout at the same path (docs/multi-node.md)"
            )
        os.chdir(working_dir)
        self._process: ServiceProcess | None = None

    def node(self) -> tuple[str, str]:
        """This actor's Ray node id and address."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (for the trainer's rendezvous)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    async def start(
        self,
        name: str,
        replica: int,
        server: ServerConfig,
        config_path: str | None,
        overrides: list[str],
        env: dict[str, str],
        serves: bool,
        startup_timeout_seconds: float,
        tls_files: dict[str, bytes],
    ) -> str:
        """Starts the service; when it `serves` (all but the trainer's ranks > 0), waits for
        its SERVING and returns its address. `tls_files` are this node's certificates of the
        launch (`launch_tls.node_files`), written to the launch's TLS directory first. Raises
        ServiceDiedError when it fails to start."""
        path = None if config_path is None else Path(config_path)
        # This actor calls the service too: with its token, verifying its TLS.
        for variable in (LAUNCH_TOKEN_ENV, LAUNCH_TLS_DIR_ENV):
            if variable in env:
                os.environ[variable] = env[variable]
        if tls_files:
            await asyncio.to_thread(write_node_files, Path(env[LAUNCH_TLS_DIR_ENV]), tls_files)
        self._process = await spawn(
            name, replica, server, path, overrides, env, startup_timeout_seconds
        )
        if serves:
            await wait_ready(self._process)
        return self._process.address

    def pid(self) -> int:
        """The service process's id on this actor's node."""
        return self._process.process.pid

    async def wait(self) -> tuple[int, list[str]]:
        """Returns when the service's process exits: its exit status and last output."""
        await self._process.wait()
        return self._process.process.returncode, list(self._process.log_tail)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL past the service's shutdown grace; then this node's TLS files
        of the launch go (the services' are ended first: none reads them any more)."""
        if self._process is not None:
            await stop_processes([self._process])
        await asyncio.to_thread(remove_launch_tls_files)


@dataclass
class RayService:
    """One service replica (or trainer rank) started by `ray_services`, as the launcher sees it."""

    name: str
    replica: int
    server: ServerConfig
    actor: ray.actor.ActorHandle
    node_id: str
    node_address: str
    address: str = ""
    gateway_url: str = ""  # not read back from the actor: its node's log has it
    http_json_url: str = ""  # the same
    ended: tuple[int, list[str]] | None = None  # exit status and last output, once it ended
    restarts: int = 0
    start_args: tuple = ()  # ServiceActor.start's, from `_start`

    @property
    def label(self) -> str:
        if self.name == "trainer" and self.replica:
            return f"trainer rank {self.replica}"
        return f"{self.name}#{self.replica}" if self.replica else self.name

    @property
    def where(self) -> str:
        return f"node {self.node_address}"

    def client_config(self) -> ClientConfig:
        return launcher_client_config(self.server, self.address)

    @property
    def returncode(self) -> int | None:
        return None if self.ended is None else self.ended[0]

    async def restart(self) -> None:
        """Starts the service again in its actor, on its node at its address (its callers
        reconnect there); raises ServiceDiedError when it fails to start, or when its actor
        died with its node (a service elsewhere would have another address)."""
        name, replica, server, config_path, overrides, *rest = self.start_args
        if self.address:
            overrides = [*overrides, f"{name}.server.port={self.address.rpartition(':')[2]}"]
        self.restarts += 1
        self.ended = None
        try:
            await self.actor.start.remote(name, replica, server, config_path, overrides, *rest)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            self.ended = (-9, [f"restart failed: {e}"])
            raise ServiceDiedError(f"{self.label} service ({self.where}): {e}") from None

    async def wait(self) -> None:
        """Returns when the service's process exits, or its actor (or node) dies."""
        try:
            self.ended = await self.actor.wait.remote()
        except ray.exceptions.RayActorError as e:
            self.ended = (-9, [f"its Ray actor died: {e}"])

    def exit_description(self) -> str:
        code, tail = self.ended or (-9, [])
        return exit_description(f"{self.label} service ({self.where})", code, tail)


@contextlib.asynccontextmanager
async def ray_services(
    project: ProjectConfig,
    config_path: Path | None,
    overrides: Sequence[str],
    stop_requested: asyncio.Event,
) -> AsyncIterator[list[RayService]]:
    """Starts the services the config does not point at as Ray actors, yields them once all
    are SERVING, stops them on exit. Raises ServiceDiedError, naming the service, its node and
    its last output, when one fails to start or cannot be placed; StartupInterruptedError
    when `stop_requested` is set first."""
    settings = project.launcher.ray
    timeout_seconds = project.launcher.startup_timeout_seconds
    await asyncio.to_thread(connect, settings)
    demands = {demand.name: demand for demand in launch_demands(project)}
    check_fits(list(demands.values()), await asyncio.to_thread(_node_resources))
    services: list[RayService] = []
    groups: list[PlacementGroup] = []
    # By node address: one certificate per machine, whose nodes share the files' path.
    tls_files: dict[str, dict[str, bytes]] = {}
    # A relative path holds: the actors work in this process's working directory.
    config = None if config_path is None else str(config_path)
    try:
        for stage in START_STAGES:
            stage_services: list[list[RayService]] = []
            for name in (name for name in stage if name in demands):
                resources: ServiceResources = getattr(settings, name)
                group = await _placement_group(demands[name], timeout_seconds)
                groups.append(group)
                placed = await _place(demands[name], resources, group, project, settings)
                await _issue_node_certificates(placed, tls_files)
                services += placed
                stage_services.append(placed)
            # Each service's start is made only now that all of the stage are placed: one that
            # cannot be placed leaves no start behind never awaited.
            starts = [
                _start(
                    placed,
                    config,
                    [*overrides, *peer_addresses(placed[0].name, services)],
                    timeout_seconds,
                    tls_files,
                )
                for placed in stage_services
            ]
            await ready_unless_stopped(asyncio.gather(*starts), stop_requested)
        yield services
    finally:
        await _stop(services)
        for group in groups:
            remove_placement_group(group)


def connect(settings: RayLauncherConfig) -> None:
    """Joins the configured Ray cluster (or starts a local one), in the launch's namespace."""
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=settings.address,
            namespace=settings.namespace,
            include_dashboard=False,
            log_to_driver=True,
        )
    except ConnectionError as e:
        raise ConfigError(f"launcher.ray.address {settings.address!r}: {e}") from None


def _node_resources() -> list[dict[str, float]]:
    """The total resources of each live node of the cluster."""
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


async def _placement_group(demand: ServiceDemand, timeout_seconds: float) -> PlacementGroup:
    """A placement group of one bundle per replica; raises ServiceDiedError when the cluster
    cannot hold it within `timeout_seconds` (launcher.startup_timeout_seconds): other jobs
    hold what it needs, or its placement cannot be met."""
    group = placement_group([demand.bundle] * demand.count, strategy=demand.placement.upper())
    try:
        async with asyncio.timeout(timeout_seconds):
            await group.ready()
    except TimeoutError:
        remove_placement_group(group)
        raise ServiceDiedError(
            f"Ray could not place {demand.count} x {demand.bundle} ({demand.placement}) for the "
            f"{demand.name} service within {timeout_seconds:g}s "
            f"(launcher.startup_timeout_seconds); the cluster has "
            f"{ray.available_resources()} free (launcher.ray.{demand.name})"
        ) from None
    return group


async def _place(
    demand: ServiceDemand,
    resources: ServiceResources,
    group: PlacementGroup,
    project: ProjectConfig,
    settings: RayLauncherConfig,
) -> list[RayService]:
    """One actor per bundle of `group`, each on the node Ray placed its bundle on."""
    actor_class = ray.remote(ServiceActor)
    name = demand.name
    services = []
    for replica in range(demand.count):
        try:
            actor = actor_class.options(
                name=f"{name}:{replica}",
                namespace=settings.namespace,
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                resources=resources.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, replica),
            ).remote(os.getcwd())
        except ValueError as e:  # the name is taken
            raise ServiceDiedError(
                f"{e}: another turnrl launch runs in Ray namespace {settings.namespace!r}; stop "
                "it or set launcher.ray.namespace"
            ) from None
        node_id, node_address = await actor.node.remote()
        server = project.server(name)
        services.append(RayService(name, replica, server, actor, node_id, node_address))
    return services


async def _issue_node_certificates(
    placed: list[RayService], tls_files: dict[str, dict[str, bytes]]
) -> None:
    """With this launch's TLS, issues the files of each node address in `placed` that has
    none yet into `tls_files`, one after another: every actor on a machine (Ray nodes on one
    machine share its address) must write the same certificate and key to the same path, or
    a service could read one's certificate with another's key."""
    if launch_tls_dir() is None:
        return
    for service in placed:
        if service.node_address not in tls_files:
            hosts = [service.node_address, *LOOPBACK_NAMES]
            tls_files[service.node_address] = await asyncio.to_thread(node_files, hosts)


async def _start(
    placed: list[RayService],
    config_path: str | None,
    overrides: list[str],
    startup_timeout_seconds: float,
    tls_files: dict[str, dict[str, bytes]],
) -> None:
    """Starts the processes of one service's actors: each bound to its node's address, and
    for the trainer's ranks with the rendezvous at rank 0's node. With this launch's TLS,
    each gets its node's files from `tls_files` (`_issue_node_certificates`)."""
    name = placed[0].name
    rendezvous: dict[str, str] = {}
    if name == "trainer" and len(placed) > 1:
        rendezvous = {
            "WORLD_SIZE": str(len(placed)),
            "MASTER_ADDR": placed[0].node_address,
            "MASTER_PORT": str(await placed[0].actor.free_port.remote()),
            "LOCAL_RANK": "0",
        }

    async def start(service: RayService) -> None:
        own = [f"{name}.server.host={service.node_address}", f"{name}.server.port=0"]
        if service.server.metrics_port:
            own.append(f"{name}.server.metrics_port=0")
        if isinstance(service.server, HttpJsonServerConfig) and service.server.http_port:
            own.append(f"{name}.server.http_port=0")
        env = {**rendezvous, "RANK": str(service.replica)} if rendezvous else {}
        if token := os.environ.get(LAUNCH_TOKEN_ENV):
            env[LAUNCH_TOKEN_ENV] = token
        if (tls_dir := launch_tls_dir()) is not None:
            env[LAUNCH_TLS_DIR_ENV] = str(tls_dir)
        serves = name != "trainer" or service.replica == 0
        service.start_args = (
            name, service.replica, service.server, config_path, [*overrides, *own], env, serves,
            startup_timeout_seconds, tls_files.get(service.node_address, {}),
        )  # fmt: skip
        try:
            service.address = await service.actor.start.remote(*service.start_args)
        except ray.exceptions.RayTaskError as e:
            raise ServiceDiedError(
                f"{service.label} service ({service.where}) failed to start: {e.cause}"
            ) from None

    await asyncio.gather(*(start(service) for service in placed))


async def _stop(services: list[RayService]) -> None:
    """Stops each service in reverse start order (callers first; the trainer's rank 0 before
    the ranks that follow it), then ends its actor."""
    order = sorted(services, key=lambda s: (-SERVICE_NAMES.index(s.name), s.replica))
    for service in order:
        # The actor's own stop kills the process past its grace and slack; this is the
        # deadline of an actor that does not answer.
        deadline = 2 * (service.server.shutdown_grace_seconds + STOP_SLACK_SECONDS)
        try:
            async with asyncio.timeout(deadline):
                await service.actor.stop.remote()
        except (TimeoutError, ray.exceptions.RayActorError) as e:
            log.warning("%s service did not stop cleanly: %s", service.label, e)
        ray.kill(service.actor)
