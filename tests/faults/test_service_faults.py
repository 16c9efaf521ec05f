"""Fault injection: a real `turnrl run` of the calculator task through the four services, in
which one service is killed with SIGKILL in the middle of a step. Its launcher starts it again
at its address, its callers ride the restart out (a restarted trainer is given the run again,
to resume), and the run reaches its planned step count with every prompt trained exactly
once."""

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLE_CONFIG, FREE_PORTS, children, ledger_keys, spawn_turnrl
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc

STEPS = 4
PROMPTS_PER_STEP = 4
SAMPLES_PER_PROMPT = 4


def _service_pid(launcher_pid: int, name: str) -> int:
    """The pid of the launcher's child that serves `name`."""
    for pid in children(launcher_pid):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"serve" in command and name.encode() in command:
            return pid
    raise AssertionError(f"no {name} service among the children of {launcher_pid}")


async def _kill_mid_step(launcher_pid: int, run_dir: Path, name: str) -> None:
    """Kills service `name` (kill -9) once step 2's trajectories run on the rollout service,
    while at least half of them still run: a kill as the last ones end could let the service
    come back before any call reached it (under load, the next step's calls start late)."""
    while not (run_dir / "metrics.jsonl").exists() or _steps_logged(run_dir) < 1:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    address = config["trainer"]["rollout_service"]["address"]
    async with rpc.open_channel(ClientConfig(address=address)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_pb2.GetStatsRequest()
        half = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // 2
        while (await stub.GetStats(request, timeout=10)).running_trajectories < half:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    os.kill(_service_pid(launcher_pid, name), signal.SIGKILL)


def _metric_lines(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"router/live_replicas"' in line]


def _steps_logged(run_dir: Path) -> int:
    return len(_metric_lines(run_dir))


# The trainer is restarted when its policy says so, and resumes from its last checkpoint.
RESTARTED_TRAINER = ["launcher.restart.trainer.mode=on-failure", "trainer.checkpoint.every=1"]


@pytest.mark.parametrize("victim", ["tool", "reward", "rollout", "trainer"])
async def test_a_service_killed_mid_step_is_restarted_and_the_run_loses_nothing(
    victim, tmp_path, example_on_tiny_model
):
    run_dir = tmp_path / "faults"
    process = await spawn_turnrl(
        "run", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *example_on_tiny_model,
        f"trainer.output_dir={tmp_path}", "trainer.run_name=faults",
        f"trainer.steps={STEPS}", "trainer.eval_every=0", "trainer.checkpoint.every=0",
        *(RESTARTED_TRAINER if victim == "trainer" else []),
        f"trainer.rollout.prompts_per_step={PROMPTS_PER_STEP}",
        f"trainer.rollout.samples_per_prompt={SAMPLES_PER_PROMPT}", "trainer.loggers=[]",
        "trainer.data.generated_train_size=64", "trainer.data.generated_eval_size=4",
    )  # fmt: skip
    output = asyncio.gather(process.stdout.read(), process.stderr.read())
    try:
        async with asyncio.timeout(600):
            await _kill_mid_step(process.pid, run_dir, victim)
            _, stderr = await output
            await process.wait()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            await process.wait()
    log = stderr.decode()
    assert process.returncode == 0, log[-4000:]
    assert f"{victim} service (pid" in log and "restarting it in" in log, log[-4000:]

    # Every planned step trained, on every prompt drawn, each exactly once.
    lines = _metric_lines(run_dir)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    trained = ledger_keys(run_dir, "trained")
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS_PER_STEP
    assert not ledger_keys(run_dir, "filtered")
    # No trajectory was scored 0 for the fault: the calls were tried again, or the lost
    # rollout service's groups rolled out again on its restart.
    assert all(line["rollout/infra_failed_trajectories"] == 0 for line in lines)
    if victim == "rollout":
        assert lines[1]["router/redispatched_groups"] >= 1
    if victim == "reward":  # the trajectories running at the kill scored during the restart
        assert lines[-1]["engine/reward_unavailable_answers"] >= 1
    if victim == "trainer":  # killed in step 2: resumed from step 1's checkpoint
        assert "the run resumes from its last checkpoint" in log, log[-4000:]
        assert "run 'faults' resumed in" in log, log[-4000:]
