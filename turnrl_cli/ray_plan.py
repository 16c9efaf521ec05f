"""What a Ray launch asks of the cluster, checked against what the cluster has before anything
is placed (`check_fits`): a launch that cannot fit fails at once, naming the settings to
change, instead of waiting for a placement group that never comes.

Ray itself is not imported here: `ray_services` hands in the nodes' resources.
"""

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from turnrl.errors import ConfigError
from turnrl_cli.project_config import ProjectConfig, ServiceResources

# Ray's own bookkeeping resources, which no bundle asks for.
_IGNORED_RESOURCES = ("memory", "object_store_memory")


@dataclass(frozen=True)
class ServiceDemand:
    """One service's placement group: `count` bundles (replicas, or trainer ranks) alike."""

    name: str
    count: int
    bundle: dict[str, float]
    placement: str


def bundle_of(resources: ServiceResources) -> dict[str, float]:
    """The Ray bundle of one replica: its CPUs, GPUs and custom resources, zeros left out."""
    bundle = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.resources}
    return {key: amount for key, amount in bundle.items() if amount > 0}


def launch_demands(project: ProjectConfig) -> list[ServiceDemand]:
    """The placement group of each service this launch starts, in start order."""
    demands = []
    for name in project.services_to_start():
        resources: ServiceResources = getattr(project.launcher.ray, name)
        count = project.trainer.ranks if name == "trainer" else project.replicas(name)
        demands.append(ServiceDemand(name, count, bundle_of(resources), resources.placement))
    return demands


def check_fits(demands: Sequence[ServiceDemand], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raises ConfigError when the cluster, whose live nodes have the total resources `nodes`,
    cannot hold `demands` however Ray places them: a bundle no node can hold, more
    strict_spread replicas than nodes that can hold one, or more of a resource in all than
    the cluster has. The message names the launcher.ray settings to change.

    What other jobs hold now is not counted: a launch that fits an idle cluster waits for
    its placement (launcher.startup_timeout_seconds)."""
    for demand in demands:
        fitting = [node for node in nodes if _holds(node, demand.bundle)]
        if not fitting:
            largest = max(nodes, key=lambda node: node.get("CPU", 0.0), default={})
            raise ConfigError(
                f"no node of the Ray cluster can hold one {demand.name} replica "
                f"{demand.bundle}; its largest node has {_shown(largest)}: lower "
                f"launcher.ray.{demand.name} (num_cpus, num_gpus, resources) or add a node "
                "that has them"
            )
        if demand.placement == "strict_spread" and demand.count > len(fitting):
            raise ConfigError(
                f"launcher.ray.{demand.name}.placement strict_spread needs {demand.count} nodes "
                f"that can each hold {demand.bundle}; the Ray cluster has {len(fitting)}: "
                "use spread, fewer replicas, or more nodes"
            )
    needed: dict[str, float] = defaultdict(float)
    for demand in demands:
        for key, amount in demand.bundle.items():
            needed[key] += demand.count * amount
    total = {key: sum(node.get(key, 0.0) for node in nodes) for key in needed}
    short = [key for key in needed if needed[key] > total[key] + 1e-9]
    if short:
        key = short[0]
        shares = ", ".join(
            f"{d.name} {d.count} x {d.bundle[key]:g} (launcher.ray.{d.name})"
            for d in demands
            if key in d.bundle
        )
        setting = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(key, f"resources.{key}")
        raise ConfigError(
            f"the Ray cluster has {total[key]:g} {key} in all, and this launch needs "
            f"{needed[key]:g}: {shares}. Lower launcher.ray.<service>.{setting} (an I/O-bound "
            "service needs a fraction of a CPU), start fewer replicas, or add nodes"
        )


def _holds(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
    return all(node.get(key, 0.0) + 1e-9 >= amount for key, amount in bundle.items())


def _shown(node: Mapping[str, float]) -> dict[str, float]:
    return {key: amount for key, amount in node.items() if key not in _IGNORED_RESOURCES}
