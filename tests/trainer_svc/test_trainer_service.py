"""The trainer service end to end: runs through the four real services (`turnrl up` on loopback
ports, the tiny calculator model), every TrainerService RPC, and `turnrl run` killed with
kill -9 and resumed."""

import asyncio
import json
import math
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer_svc.checkpoint import checkpoint_folders
from turnrl import errors, rpc
from turnrl.config import ClientConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc

from ..conftest import (
    EXAMPLE_CONFIG,
    FREE_PORTS,
    SERVICE_NAMES,
    children,
    kill_tree,
    run_turnrl,
    scrape_metrics,
    serve_subprocess,
    spawn_turnrl,
)
from .fsdp_worker import checkpoint_tensors
from .runs import check_dumps, follow, read_dump, run_config, run_to_end

State = trainer_pb2.Run.State


async def test_a_run_trains_evaluates_pushes_checkpoints_and_exports(
    services, trainer_metrics_port, tmp_path
):
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        # 5 of each step's 8 trajectories: the best and worst of both groups, and one more.
        dumps = {"rollouts_per_step": 5, "extreme_groups": 2}
        config = run_config(services, tmp_path, run_name="short", dumps=dumps)
        started = await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
        assert started.run.name == "short" and started.run.total_steps == 2
        events = await follow(stub, "short")
        run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name="short"), timeout=10)).run
    assert run.state == State.STATE_SUCCEEDED and run.step == 2, run.error_message
    scraped = await scrape_metrics(f"http://127.0.0.1:{trainer_metrics_port}/metrics")
    assert scraped[("turnrl_trainer_step", (("run", "short"),))] == 2
    assert scraped[("turnrl_trainer_total_steps", (("run", "short"),))] == 2
    for phase in ("rollout", "train", "push", "eval"):
        assert scraped[("turnrl_trainer_phase_seconds", (("phase", phase), ("run", "short")))] > 0
    assert scraped[("process_resident_memory_bytes", ())] > 0
    stages = [(e.step, e.stage) for e in events]
    for step in (1, 2):
        for stage in ("rollout", "train", "push", "checkpoint"):
            assert (step, stage) in stages
    assert (0, "eval") in stages and (2, "eval") in stages and stages[-1][1] == "state"
    train = next(e for e in events if e.stage == "train")
    for name in ("train/loss", "train/grad_norm", "train/entropy", "mismatch/mean_abs_diff"):
        assert name in train.metrics
    # The engine samples from exactly the weights the trainer holds (pushed at start-up).
    assert train.metrics["mismatch/mean_abs_diff"] < 1e-4

    run_dir = Path(run.output_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert 0.0 <= summary["initial_eval_accuracy"] <= 1.0
    assert 0.0 <= summary["final_eval_accuracy"] <= 1.0
    assert summary["wall_seconds"] > 0
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "rollout/reward_mean" in r] == [1, 2]
    for record in [r for r in logged if "eval/accuracy" in r]:
        # Greedy, one sample a prompt (trainer.eval's default): pass@1 is the accuracy.
        assert record["eval/pass@1"] == record["eval/accuracy"]
        assert record["eval/openai/gsm8k/pass@1"] == record["eval/accuracy"]
        assert abs(record["eval/mean@1"] - record["eval/reward_mean"]) < 1e-6
    dumped = check_dumps(run_dir, steps=[1, 2], per_step=5, eval_steps=[0, 1, 2])
    for record in dumped[1] + dumped[2]:
        # Synchronous: sampled by the weights the trainer recomputed them with.
        assert record["staleness"] == 0 and record["logprob_mismatch"] < 1e-4, record
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    exported_state = exported.state_dict()
    for name, tensor in checkpoint_tensors(run_dir / "checkpoints" / "step_000002").items():
        torch.testing.assert_close(exported_state[name], tensor, rtol=0, atol=0)


async def test_a_gae_run_trains_a_critic_checkpoints_it_and_resumes_with_it(services, tmp_path):
    """Checkpoints written in the background, the newest two kept; the run resumed from the
    one it names, its step 1, trains steps 2 and 3 again from there."""
    gae = {
        "eval_every": 0,
        "algorithm": {"advantage_estimator": "gae", "gae_lambda": 0.95},
        "critic": {"optim": {"learning_rate": 0.001}, "critic_only_steps": 1},
        "checkpoint": {"every": 1, "keep_last": 2, "async_save": True},
    }
    checkpoint = tmp_path / "gae" / "checkpoints" / "step_000001"
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        for steps, resume_from in ((2, ""), (3, "1")):  # two steps, then two after step 1
            config = run_config(services, tmp_path, run_name="gae", steps=steps, **gae)
            request = trainer_pb2.StartRunRequest(
                config_yaml=config, resume=bool(resume_from), resume_from=resume_from
            )
            await stub.StartRun(request, timeout=60)
            events = await follow(stub, "gae")
            run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name="gae"), timeout=10)).run
            assert run.state == State.STATE_SUCCEEDED and run.step == steps, run.error_message
            if not resume_from:
                critic = checkpoint_tensors(checkpoint, "critic")
                critic_optimizer = checkpoint_tensors(checkpoint, "critic", "optimizer")
        assert [e.step for e in events if e.stage == "train"] == [2, 3]
        assert [f.name for f in checkpoint_folders(tmp_path / "gae")] == [
            "step_000002",
            "step_000003",
        ]
        with pytest.raises(errors.NotFoundError, match=r"no checkpoint 'step_000001'; it has"):
            request = trainer_pb2.StartRunRequest(
                config_yaml=config, resume=True, resume_from="step_000001"
            )
            await stub.StartRun(request, timeout=60)
        with pytest.raises(errors.InvalidArgumentError, match=r"set resume too"):
            request = trainer_pb2.StartRunRequest(config_yaml=config, resume_from="2")
            await stub.StartRun(request, timeout=60)

    run_dir = Path(run.output_dir)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in logged if "critic/loss" in r}
    assert sorted(train) == [1, 2, 3]
    # Step 1 trains the critic alone; from step 2 both.
    assert "train/loss" not in train[1] and "train/loss" in train[2] and "train/loss" in train[3]
    for record in train.values():
        for name in ("clip_fraction", "grad_norm", "value_mean", "return_mean"):
            assert math.isfinite(record[f"critic/{name}"]), name
    # The new head starts at zero; the resumed run's values come from the checkpointed critic.
    assert train[1]["critic/value_mean"] == 0.0 and train[3]["critic/value_mean"] != 0.0
    assert "score.weight" in critic and "score.weight.exp_avg" in critic_optimizer
    # The resumed run wrote its step's dumps beside the first run's.
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == [
        "step_000001.jsonl",
        "step_000002.jsonl",
        "step_000003.jsonl",
    ]
    assert len(read_dump(run_dir / "rollouts" / "step_000001.jsonl")) == 8
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")  # the policy only
    assert checkpoint_tensors(checkpoint).keys() <= exported.state_dict().keys()
    assert "score.weight" not in exported.state_dict()


async def test_stop_and_save_checkpoint_during_a_run(services, tmp_path):
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        config = run_config(services, tmp_path, run_name="long", steps=100, checkpoint={"every": 0})
        await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
        request = trainer_pb2.StreamProgressRequest(run_name="long")
        async for event in stub.StreamProgress(request, timeout=600):
            if event.stage == "train":
                break
        saved = await stub.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(run_name="long"), timeout=300
        )
        assert saved.step >= 1 and (Path(saved.checkpoint_dir) / "state.pt").exists()
        with pytest.raises(errors.FailedPreconditionError):  # one run at a time
            await stub.StartRun(
                trainer_pb2.StartRunRequest(config_yaml=config, run_name="other"), timeout=60
            )
        stopped = await stub.StopRun(
            trainer_pb2.StopRunRequest(run_name="long", save_checkpoint=True), timeout=300
        )
        assert stopped.run.state == State.STATE_STOPPED
        assert 1 <= stopped.run.step < 100
        assert (tmp_path / "long" / "checkpoints" / f"step_{stopped.run.step:06d}").is_dir()
        # The writer is flushed on stop: every step taken has its dump.
        assert (tmp_path / "long" / "rollouts" / f"step_{stopped.run.step:06d}.jsonl").is_file()
        again = await stub.StopRun(trainer_pb2.StopRunRequest(run_name="long"), timeout=10)
        assert again.run.state == State.STATE_STOPPED
        with pytest.raises(errors.FailedPreconditionError):
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_name="long"))


async def test_turnrl_run_submits_to_services_already_running(services, tmp_path):
    # Every service is pointed at, so `turnrl run` starts none and submits to the trainer.
    code, _, stderr = await run_turnrl(
        "run", "--config", str(EXAMPLE_CONFIG),
        f"trainer_service.address={services['trainer']}",
        f"trainer.rollout_service.address={services['rollout']}",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=elsewhere", "trainer.steps=1",
        "trainer.eval_every=0", "trainer.rollout.prompts_per_step=2",
        "trainer.rollout.samples_per_prompt=2", "trainer.data.generated_eval_size=4",
        timeout_seconds=300,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    assert not any(f"[{name}]" in stderr for name in SERVICE_NAMES)  # no child of its own
    assert "run summary" in stderr
    assert json.loads((tmp_path / "elsewhere" / "summary.json").read_text())["steps"] == 1
    # The run's page, written once the run ended, is the launch's last word.
    assert stderr.rstrip().endswith(f"report: {tmp_path / 'elsewhere' / 'report.html'}")
    assert 'id="run-data"' in (tmp_path / "elsewhere" / "report.html").read_text()


@pytest.mark.parametrize(
    ("request_fields", "status", "message"),
    [
        ({"run_name": "nope"}, "NOT_FOUND", "no run 'nope'"),
        ({"config_yaml": "trainer: {stpes: 1}"}, "INVALID_ARGUMENT", "stpes"),
        ({"config_yaml": "[1, 2"}, "INVALID_ARGUMENT", "not YAML"),
        # The client names the folder; the service writes only inside its own runs root.
        ({"config_yaml": "trainer: {output_dir: /}"}, "INVALID_ARGUMENT", "runs root"),
    ],
)
async def test_bad_requests(services, request_fields, status, message):
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(errors.RpcError) as info:
            if "config_yaml" in request_fields:
                await stub.StartRun(trainer_pb2.StartRunRequest(**request_fields), timeout=30)
            else:
                await stub.GetRun(trainer_pb2.GetRunRequest(**request_fields), timeout=30)
    assert info.value.status == status
    assert message in info.value.details


async def test_an_existing_run_is_not_overwritten(services, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("")
    async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        config = run_config(services, tmp_path, run_name="taken")
        with pytest.raises(errors.AlreadyExistsError) as info:
            await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=30)
    assert "--resume" in info.value.details


async def test_a_two_rank_trainer_service_trains_as_one_rank_does(
    services, tiny_model_dir, tmp_path
):
    # `turnrl serve trainer` with trainer.ranks=2 becomes torchrun with two ranks: rank 0 serves
    # and drives, rank 1 follows its model calls. Same run, same rollouts: the same step; and
    # the same for an SFT step and for a PPO step with its critic.
    served = serve_subprocess(
        "trainer",
        "trainer.ranks=2",
        f"trainer.model_path={tiny_model_dir}",
        f"trainer.runs_root={tmp_path}",
    )
    sft = {"mode": "sft", "sft": {"conversations_per_step": 8, "max_length": 1024}}
    gae = {
        "algorithm": {"advantage_estimator": "gae", "gae_lambda": 0.95},
        "critic": {"optim": {"learning_rate": 0.001}},
    }
    async with served as two_ranks:
        trained = {}
        for name, address, ranks, mode in (
            ("one", services["trainer"], 1, {}),
            ("two", two_ranks.address, 2, {}),
            ("sft-one", services["trainer"], 1, sft),
            ("sft-two", two_ranks.address, 2, sft),
            ("gae-one", services["trainer"], 1, gae),
            ("gae-two", two_ranks.address, 2, gae),
        ):
            config = run_config(
                services,
                tmp_path,
                run_name=name,
                steps=1,
                eval_every=0,
                ranks=ranks,
                loggers=[],  # its service process would outlive the ranks a while
                **mode,
            )
            events = await run_to_end(address, config, name)
            train = next(e for e in events if e.stage == "train").metrics
            trained[name] = (
                train,
                AutoModelForCausalLM.from_pretrained(tmp_path / name / "final_model"),
            )
        async with rpc.open_channel(ClientConfig(address=two_ranks.address)) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            config = run_config(services, tmp_path, run_name="mismatch", ranks=1)
            with pytest.raises(errors.FailedPreconditionError) as info:
                await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=30)
        assert "this trainer service runs 2" in info.value.details
        ranks = children(two_ranks.process.pid)
        assert len(ranks) == 2
        # torchrun passes SIGTERM on; rank 0 stops serving and ends rank 1's loop. (torchrun
        # itself then exits with 1, as it does on any signal.)
        two_ranks.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(two_ranks.process.wait(), timeout=60)
        assert not alive(ranks)

    assert trained["one"][0]["rollout/reward_mean"] == trained["two"][0]["rollout/reward_mean"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    critic = ["critic/loss", "critic/grad_norm", "critic/value_mean"]
    for run, metrics in (("", ["mismatch/mean_abs_diff"]), ("sft-", []), ("gae-", critic)):
        (one_metrics, one_model), (two_metrics, two_model) = (
            trained[f"{run}one"],
            trained[f"{run}two"],
        )
        for metric in ("train/loss", "train/grad_norm", *metrics):
            assert two_metrics[metric] == pytest.approx(one_metrics[metric], abs=1e-5), metric
        one_state, two_state = one_model.state_dict(), two_model.state_dict()
        moved = max(float((t - initial[n]).abs().max()) for n, t in one_state.items())
        # Adam's first step moves weights by about lr (1e-3) times the gradient's sign, so where
        # a gradient is near zero, float noise between one rank and two moves a weight by a few
        # % of lr.
        apart = max(float((t - two_state[n]).abs().max()) for n, t in one_state.items())
        assert moved > 5e-4 and apart <= 1e-4, (run, moved, apart)


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def step_record(run_dir: Path, step: int) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] == step and "train/loss" in r][-1]


async def test_turnrl_run_killed_and_resumed_reproduces_the_next_step(
    example_on_tiny_model, tmp_path
):
    overrides = [
        *FREE_PORTS,
        *example_on_tiny_model,
        f"trainer.output_dir={tmp_path}",
        "trainer.steps=3",
        "trainer.eval_every=0",
        "trainer.checkpoint.every=1",
        "trainer.loggers=[]",
        "trainer.data.generated_eval_size=4",
        "trainer.rollout.prompts_per_step=2",
        "trainer.rollout.samples_per_prompt=4",
        "trainer.optim.learning_rate=0.001",
    ]
    run = ["run", "--config", str(EXAMPLE_CONFIG), *overrides]
    # The uninterrupted run uses tool and reward services of its own, which `turnrl run` then
    # does not start; the crashed one starts all four.
    async with serve_subprocess("tool") as tool, serve_subprocess("reward") as reward:
        reference = await spawn_turnrl(
            *run,
            "trainer.run_name=whole",
            f"rollout.tool_service.address={tool.address}",
            f"rollout.reward_service.address={reward.address}",
        )
        _, stderr = await reference.communicate()
    assert reference.returncode == 0, stderr.decode()[-3000:]
    assert "[rollout]" in stderr.decode() and "[tool]" not in stderr.decode()

    crashed = await spawn_turnrl(*run, "trainer.run_name=crashed")
    checkpoint = tmp_path / "crashed" / "checkpoints" / "step_000002"
    async with asyncio.timeout(300):
        while not checkpoint.is_dir():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    kill_tree(crashed.pid)
    await crashed.wait()
    resumed = await spawn_turnrl(*run, "trainer.run_name=crashed", "--resume")
    _, stderr = await resumed.communicate()
    assert resumed.returncode == 0, stderr.decode()[-3000:]

    summary = json.loads((tmp_path / "crashed" / "summary.json").read_text())
    assert summary["steps"] == 3
    expected, got = step_record(tmp_path / "whole", 3), step_record(tmp_path / "crashed", 3)
    assert got["rollout/reward_mean"] == expected["rollout/reward_mean"]
    assert got["rollout/response_length"] == expected["rollout/response_length"]
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-5)
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
