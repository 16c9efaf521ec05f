"""The async loop end to end: runs through the four real services with `trainer.loop: async`,
the staleness bound and the version each token carries, and `turnrl run` of
examples/calculator/async.yaml killed with kill -9 mid-run and resumed, with the prompt ledger
showing every prompt of the epoch trained once."""

import asyncio
import json
from pathlib import Path

import pytest

from trainer_svc.ledger import PromptLedger
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc

from ..conftest import EXAMPLE_CONFIG, FREE_PORTS, kill_tree, spawn_turnrl
from .runs import check_dumps, follow, run_config, run_to_end

ASYNC_EXAMPLE = EXAMPLE_CONFIG.parent / "async.yaml"


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training records, one per step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def trained_positions(run_dir: Path) -> list[int]:
    return [int(key.split(":")[0]) for key in PromptLedger(run_dir).settled()["trained"]]


async def test_async_runs_keep_within_the_staleness_bound(services, tmp_path):
    records = {}
    for eta in (0, 1):
        name = f"async-eta{eta}"
        config = run_config(
            services,
            tmp_path,
            run_name=name,
            steps=3,
            eval_every=0,
            loop="async",
            # η = 1 pauses the engine while the trainer trains, as on a CPU it should.
            async_loop={"max_staleness": eta, "generate_while_training": eta == 0},
        )
        events = await run_to_end(services["trainer"], config, name)
        assert [e.step for e in events if e.stage == "push"] == [1, 2, 3]
        records[eta] = step_records(tmp_path / name)
        assert [r["step"] for r in records[eta]] == [1, 2, 3]
        ledger = PromptLedger(tmp_path / name).settled()
        assert len(ledger["trained"]) == len(set(ledger["trained"])) == 3 * 2
        # Every trajectory of each step (2 prompts x 4 samples): the default 8 a step.
        dumped = check_dumps(tmp_path / name, steps=[1, 2, 3], per_step=8, eval_steps=[0, 3])
        for step, record in zip([1, 2, 3], records[eta], strict=True):
            rewards = [r["reward"] for r in dumped[step]]
            assert abs(sum(rewards) / len(rewards) - record["rollout/reward_mean"]) < 1e-6
            assert all(r["staleness"] <= eta for r in dumped[step])
    for record in records[0]:
        # η = 0: no rollout starts before the push of the step before, so nothing goes stale.
        assert record["staleness/max"] == 0
        assert record["async/regenerated_stale_groups"] == 0
    assert all(record["staleness/max"] <= 1 for record in records[1])
    # η = 1: the next batch is generated while a step trains, so a later step trains on
    # trajectories one version behind.
    assert max(record["staleness/max"] for record in records[1]) == 1
    for record in records[0] + records[1]:
        # Tokens tagged with the version being trained were sampled from exactly those weights;
        # a wrong tag would show here as the distance between two policies.
        if "mismatch/staleness_0/mean_abs_diff" in record:
            assert record["mismatch/staleness_0/mean_abs_diff"] < 1e-4, record
    assert any("mismatch/staleness_1/mean_abs_diff" in r for r in records[1])


async def test_an_async_run_killed_mid_step_and_resumed_trains_every_prompt_once(
    example_on_tiny_model, tmp_path
):
    run = [
        "run",
        "--config",
        str(ASYNC_EXAMPLE),  # η = 1, the engine paused while the trainer trains
        *FREE_PORTS,
        *example_on_tiny_model,
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=ledger",
        "trainer.steps=4",
        "trainer.eval_every=0",
        "trainer.checkpoint.every=1",
        "trainer.loggers=[]",
        "trainer.data.generated_train_size=8",  # one epoch: 4 steps x 2 prompts
        "trainer.data.generated_eval_size=4",
        "trainer.rollout.prompts_per_step=2",
        "trainer.rollout.samples_per_prompt=4",
        "trainer.optim.learning_rate=0.001",
    ]
    crashed = await spawn_turnrl(*run)
    run_dir = tmp_path / "ledger"
    checkpoint = run_dir / "checkpoints" / "step_000002"
    async with asyncio.timeout(300):
        while not checkpoint.is_dir():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    # The next step is under way: its groups are in flight or buffered, some already rolled
    # out by step 2's policy.
    kill_tree(crashed.pid)
    await crashed.wait()
    resumed = await spawn_turnrl(*run, "--resume")
    _, stderr = await resumed.communicate()
    assert resumed.returncode == 0, stderr.decode()[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert sorted(trained_positions(run_dir)) == list(range(8))
    assert [r["step"] for r in step_records(run_dir)][-2:] == [3, 4]


@pytest.mark.parametrize(
    ("bound", "async_loop", "message"),
    [
        ("share", {}, "were unusable, more than async_loop.max_unusable_share=0.5"),
        (
            "attempts",
            {"max_unusable_share": 1.0},
            "came back unusable 3 times (async_loop.max_group_attempts=3)",
        ),
    ],
)
async def test_an_async_run_whose_groups_are_all_unusable_stops_naming_the_cause(
    services, tmp_path, bound, async_loop, message
):
    # A data_source no scorer serves: every trajectory's scoring fails, so no group is usable.
    rows = [
        {
            "data_source": "no_such_scorer",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"ground_truth": str(i + 1)},
        }
        for i in range(8)
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = f"unusable-{bound}"
    config = run_config(
        services,
        tmp_path,
        run_name=name,
        loop="async",
        eval_every=0,
        data={"train_files": [str(data)]},
        async_loop=async_loop,
    )
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
        async with asyncio.timeout(300):  # it rolled the groups out again forever
            await follow(stub, name)
        run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name=name), timeout=10)).run
    assert run.state == trainer_pb2.Run.State.STATE_FAILED
    assert message in run.error_message
    assert "unknown data_source 'no_such_scorer'" in run.error_message
