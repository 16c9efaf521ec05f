"""What a Ray launch asks of the cluster, checked before anything is placed
(turnrl_cli.ray_plan); `test_ray_small_cluster.py` runs the demo on a 2-CPU cluster."""

import pytest

from turnrl.errors import ConfigError
from turnrl_cli.project_config import load_project_config
from turnrl_cli.ray_plan import check_fits, launch_demands

TWO_CPUS = [{"CPU": 2.0, "memory": 8e9, "node:127.0.0.1": 1.0}]


def demands(*overrides: str):
    return launch_demands(load_project_config(None, ["launcher.kind=ray", *overrides]))


@pytest.mark.parametrize(
    "overrides", [[], ["rollout.replicas=2", "tool.replicas=2"], ["reward.replicas=2"]]
)
def test_the_demo_fits_two_cpus_with_default_resources(overrides):
    check_fits(demands(*overrides), TWO_CPUS)


def test_more_cpus_in_all_than_the_cluster_has_names_each_share_and_the_setting():
    every_service_one_cpu = [f"launcher.ray.{n}.num_cpus=1" for n in ("tool", "reward")]
    with pytest.raises(ConfigError) as info:
        check_fits(demands(*every_service_one_cpu, "rollout.replicas=2"), TWO_CPUS)
    message = str(info.value)
    assert "the Ray cluster has 2 CPU in all, and this launch needs 3.5" in message
    assert "tool 1 x 1 (launcher.ray.tool), reward 1 x 1 (launcher.ray.reward), " in message
    assert "rollout 2 x 0.5 (launcher.ray.rollout), trainer 1 x 0.5" in message
    assert "Lower launcher.ray.<service>.num_cpus" in message


def test_a_bundle_no_node_holds_is_named():
    with pytest.raises(ConfigError, match=r"no node of the Ray cluster can hold one rollout "):
        check_fits(demands("launcher.ray.rollout.num_gpus=1"), TWO_CPUS)
    with pytest.raises(ConfigError, match=r"largest node has \{'CPU': 2\.0, 'node:"):
        check_fits(demands("launcher.ray.trainer.num_cpus=4"), TWO_CPUS)


def test_strict_spread_needs_as_many_nodes_as_replicas():
    spread = ["tool.replicas=2", "launcher.ray.tool.placement=strict_spread"]
    with pytest.raises(ConfigError, match=r"strict_spread needs 2 nodes .* the Ray cluster has 1"):
        check_fits(demands(*spread), TWO_CPUS)
    check_fits(demands(*spread), TWO_CPUS * 2)
