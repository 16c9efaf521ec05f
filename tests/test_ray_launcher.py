"""`turnrl run --launcher ray` on a real two-node Ray cluster on this machine (`ray start --head`
and a second `ray start` joining it, each node with a resource of its own): 2 rollout replicas
and 2 tool replicas, the trainer's 2 ranks on different nodes, one rollout replica killed in
the middle of a step."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from tests.conftest import EXAMPLE_CONFIG, free_port, ledger_keys, spawn_turnrl
from turnrl import errors, rpc
from turnrl.config import ClientConfig
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc

RAY = str(Path(sys.executable).parent / "ray")
NAMESPACE = "turnrl-test"
STEPS = 6
PROMPTS_PER_STEP = 4


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node with resource node_a and a second node with node_b; yields the address."""
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(
        [RAY, "start", "--head", f"--port={port}", *common, '--resources={"node_a": 8}'],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        subprocess.run(
            [RAY, "start", f"--address={address}", "--num-cpus=4", '--resources={"node_b": 8}'],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True)


def _metric_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _kill_rollout_replica_mid_step(address: str, run_dir: Path, token: str) -> str:
    """Kills the server of rollout replica 1 (kill -9, as a crash) once trajectories run
    there; returns its address."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    replica = config["trainer"]["rollout_service"]["address"].split(",")[1]
    async with rpc.open_channel(ClientConfig(address=replica), token=token) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_pb2.GetStatsRequest()
        while not (await stub.GetStats(request, timeout=10)).running_trajectories:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    await asyncio.to_thread(_on_cluster, address, _kill_rollout_replica_1)
    return replica


def _launch_token() -> str:
    """The bearer token the launcher made (its services bind their nodes' addresses), from
    the environment of rollout replica 1's process."""
    pid = ray.get(ray.get_actor("rollout:1").pid.remote())
    variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (token,) = [v.split(b"=", 1)[1] for v in variables if v.startswith(b"TURNRL_LAUNCH_TOKEN=")]
    return token.decode()


async def _refused_without_token(replica: str) -> str:
    async with rpc.open_channel(ClientConfig(address=replica)) as channel:
        try:
            await rollout_pb2_grpc.RolloutServiceStub(channel).GetStats(
                rollout_pb2.GetStatsRequest(), timeout=10
            )
        except errors.RpcError as e:
            return e.status
    return "OK"


async def _answers_again(replica: str, token: str) -> None:
    """Returns once the rollout replica at `replica` answers again: its launcher restarted it
    where it was."""
    async with rpc.open_channel(ClientConfig(address=replica), token=token) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        while True:
            try:
                await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=5)
                return
            except errors.UnavailableError:
                await asyncio.sleep(0.2)


def _on_cluster(address: str, function):
    """`function()` as a driver of the Ray cluster at `address`."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        return function()
    finally:
        ray.shutdown()


def _kill_rollout_replica_1() -> None:
    os.kill(ray.get(ray.get_actor("rollout:1").pid.remote()), signal.SIGKILL)


def _service_nodes() -> dict[str, str]:
    """Each service actor's node (node_a or node_b, by the node's own resource), by name."""
    nodes = {
        node["NodeID"]: next(r for r in node["Resources"] if r.startswith("node_"))
        for node in ray.nodes()
        if node["Alive"]
    }
    names = ["tool:0", "tool:1", "reward:0", "rollout:0", "rollout:1", "trainer:0", "trainer:1"]
    return {name: nodes[ray.get(ray.get_actor(name).node.remote())[0]] for name in names}


async def test_a_run_on_two_ray_nodes_survives_a_lost_rollout_replica(
    ray_cluster, tmp_path, example_on_tiny_model
):
    run_dir = tmp_path / "ray-run"
    process = await spawn_turnrl(
        "run", "--config", str(EXAMPLE_CONFIG), "--launcher", "ray", *example_on_tiny_model,
        f"launcher.ray.address={ray_cluster}", f"launcher.ray.namespace={NAMESPACE}",
        "rollout.replicas=2", "tool.replicas=2", "launcher.restart.rollout.backoff_seconds=0",
        "launcher.ray.rollout.resources.node_b=1", "launcher.ray.tool.resources.node_a=1",
        "launcher.ray.tool.placement=strict_pack",
        "trainer.ranks=2", "launcher.ray.trainer.placement=strict_spread",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=ray-run",
        f"trainer.steps={STEPS}", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        f"trainer.rollout.prompts_per_step={PROMPTS_PER_STEP}",
        "trainer.rollout.samples_per_prompt=4",
        "trainer.data.generated_train_size=64", "trainer.data.generated_eval_size=4",
    )  # fmt: skip
    output = asyncio.gather(process.stdout.read(), process.stderr.read())
    try:
        async with asyncio.timeout(900):
            while not (run_dir / "config.yaml").exists():  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            token = await asyncio.to_thread(_on_cluster, ray_cluster, _launch_token)
            killed = await _kill_rollout_replica_mid_step(ray_cluster, run_dir, token)
            placed = await asyncio.to_thread(_on_cluster, ray_cluster, _service_nodes)
            await _answers_again(killed, token)
            refused = await _refused_without_token(killed)
            _, stderr = await output
            await process.wait()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            await process.wait()
    assert process.returncode == 0, stderr.decode()[-4000:]
    # Bound to its node's address, a service takes the token its launcher made, only.
    assert refused == "UNAUTHENTICATED"

    # Resources put each service where it asked to be; the trainer's ranks on both nodes.
    assert placed["rollout:0"] == placed["rollout:1"] == "node_b"
    assert placed["tool:0"] == placed["tool:1"] == "node_a"
    assert {placed["trainer:0"], placed["trainer:1"]} == {"node_a", "node_b"}

    # The run trained every step; the lost replica's groups went to the other one, and its
    # actor started its server again, on its node at its address.
    lines = [line for line in _metric_lines(run_dir) if "router/live_replicas" in line]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert lines[0]["router/live_replicas"] == 1
    assert lines[0]["router/redispatched_groups"] >= 1
    log = stderr.decode()
    assert "rollout#1 service (node" in log and "restarting it in 0.0s" in log, log[-4000:]

    # Every prompt drawn was trained exactly once.
    trained = ledger_keys(run_dir, "trained")
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS_PER_STEP


async def test_up_check_on_ray_starts_checks_and_ends_every_actor(
    ray_cluster, example_on_tiny_model
):
    process = await spawn_turnrl(
        "up", "--config", str(EXAMPLE_CONFIG), "--launcher", "ray", "--check",
        *example_on_tiny_model, f"launcher.ray.address={ray_cluster}",
        f"launcher.ray.namespace={NAMESPACE}", "reward.replicas=2",
    )  # fmt: skip
    async with asyncio.timeout(300):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()[-4000:]
    table = stdout.decode()
    assert "check passed" in table
    for label in ("tool", "reward", "reward#1", "rollout", "trainer"):
        assert re.search(rf"{re.escape(label)}\s*│\s*\S+:\d+\s*│\s*node ", table), table
    assert await asyncio.to_thread(_on_cluster, ray_cluster, _named_actors) == []


def _named_actors() -> list[str]:
    """The service actors still alive in the test's namespace."""
    alive = []
    for name in ("tool:0", "reward:0", "reward:1", "rollout:0", "trainer:0"):
        try:
            ray.get_actor(name)
        except ValueError:  # no such actor (any more)
            continue
        alive.append(name)
    return alive
