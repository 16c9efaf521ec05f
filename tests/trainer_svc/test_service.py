"""TrainerService as a plain class (plain types in and out) over a scripted run loop that
trains nothing, and its gRPC skin's conversions on an in-process server. The real loops run in
test_trainer_service.py (RL, all four services) and test_sft.py."""

import asyncio
from pathlib import Path

import pytest
import yaml

from trainer_svc import service as service_module
from trainer_svc.ranks import Models, Ranks
from trainer_svc.run_loop import ProgressEvent, RunLoop
from trainer_svc.server import TrainerServicer
from trainer_svc.service import RunEvent, RunState, TrainerService
from turnrl import errors, rpc
from turnrl.config import ClientConfig, ServerConfig
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc

from ..conftest import serve_in_process


class ScriptedLoop(RunLoop):
    """`config.steps` steps that train nothing, each taken when the test calls `allow()`; a
    step serves the checkpoint requests waiting; the run named 'fails' fails in its step 1."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.allowed = asyncio.Semaphore(0)

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.allowed.release()

    def request_stop(self) -> None:
        super().request_stop()
        self.allowed.release()  # a stop ends the wait for the next step

    async def run(self, resume: bool, resume_from: str | None = None) -> dict:
        await self.ranks.build(Models, None)  # no model: a checkpoint holds the loop's state
        self.emit(ProgressEvent(0, "setup", message="scripted"))
        while self.step < self.total_steps:
            await self.allowed.acquire()
            if self.stop_requested:
                break
            await self._train_step()
        if self.checkpoint_requests:
            await self._checkpoint()
        return {}

    async def _train_step(self) -> None:
        self.step += 1
        if self.run_dir.name == "fails":
            raise RuntimeError("step 1 went wrong")
        self.emit(ProgressEvent(self.step, "train", {"train/loss": 1.0 / self.step}))
        await self._finish_step()

    async def _evaluate(self) -> None:
        pass

    async def _checkpoint(self) -> None:
        await self._save_checkpoint({}, {})

    def _summary(self, wall_seconds: float) -> dict:
        return {}


@pytest.fixture
def service(monkeypatch, tmp_path) -> TrainerService:
    monkeypatch.setitem(service_module.LOOPS, "sync", ScriptedLoop)
    return TrainerService(Ranks(), model_path="unused-model", runs_root=tmp_path)


def config_yaml(output_dir: Path, **trainer) -> str:
    section = {
        "steps": 2,
        "eval_every": 0,
        "checkpoint": {"every": 0},
        "output_dir": str(output_dir),
    }
    return yaml.safe_dump({"trainer": {**section, **trainer}})


async def events_until(service: TrainerService, name: str, stage: str, step: int) -> list:
    seen = []
    async for event in service.stream_progress(name):
        seen.append(event)
        if (event.stage, event.step) == (stage, step):
            return seen
    raise AssertionError(f"the run ended without {stage} at step {step}: {seen}")


async def test_a_run_reports_plain_state_and_events(service, tmp_path):
    record = await service.start_run(config_yaml(tmp_path), "short", resume=False)
    assert (record.name, record.output_dir) == ("short", (tmp_path / "short").resolve())
    assert (record.state, record.step, record.total_steps) == (RunState.STARTING, 0, 2)
    assert (tmp_path / "short" / "config.yaml").read_text() == config_yaml(tmp_path)
    record.controller.allow(2)
    events = [event async for event in service.stream_progress("short")]
    assert all(isinstance(event, RunEvent) for event in events)
    assert [(e.state, e.step, e.stage) for e in events] == [
        (RunState.RUNNING, 0, "setup"),
        (RunState.RUNNING, 1, "train"),
        (RunState.RUNNING, 2, "train"),
        (RunState.SUCCEEDED, 2, "state"),
    ]
    assert events[-1].message == "STATE_SUCCEEDED"
    assert events[1].metrics == {"train/loss": 1.0}
    run = service.get_run("short")
    assert run.state == RunState.SUCCEEDED and run.step == 2
    assert run.metrics == {"train/loss": 0.5}  # the latest value of each
    assert run.started <= events[0].time <= events[-1].time <= run.ended
    # A run that ended replays its events to a late reader, then ends the stream.
    assert [e async for e in service.stream_progress("short")] == events


async def test_one_run_at_a_time_checkpoint_and_stop(service, tmp_path):
    record = await service.start_run(config_yaml(tmp_path, steps=100), "long", resume=False)
    with pytest.raises(errors.FailedPreconditionError, match="'long' is still running"):
        await service.start_run(config_yaml(tmp_path), "other", resume=False)
    await events_until(service, "long", "setup", 0)
    saving = asyncio.ensure_future(service.save_checkpoint("long"))
    record.controller.allow()
    folder, step = await saving
    assert step == 1 and folder == tmp_path.resolve() / "long" / "checkpoints" / "step_000001"
    stopped = await service.stop_run("long", save_checkpoint=True)
    assert stopped.state == RunState.STOPPED and stopped.step == 1
    assert (await service.stop_run("long", save_checkpoint=False)).state == RunState.STOPPED
    with pytest.raises(errors.FailedPreconditionError, match="'long' is STATE_STOPPED"):
        await service.save_checkpoint("long")
    states = [e.state for e in service.get_run("long").events if e.stage == "state"]
    assert states == [RunState.STOPPING, RunState.STOPPED]


async def test_a_failed_run_says_why(service, tmp_path):
    record = await service.start_run(config_yaml(tmp_path), "fails", resume=False)
    record.controller.allow()
    events = [event async for event in service.stream_progress("fails")]
    assert events[-1].state == RunState.FAILED
    assert events[-1].message == "RuntimeError: step 1 went wrong"
    assert service.get_run("fails").error_message == "RuntimeError: step 1 went wrong"


@pytest.mark.parametrize(
    ("config", "error_type", "message"),
    [
        ("trainer: {stpes: 1}", errors.InvalidArgumentError, "stpes"),
        ("[1, 2", errors.InvalidArgumentError, "not YAML"),
        ("[1, 2]", errors.InvalidArgumentError, "mapping of sections"),
        ("trainer: {ranks: 2}", errors.FailedPreconditionError, "this trainer service runs 1"),
    ],
)
async def test_bad_configs_are_refused(service, config, error_type, message):
    with pytest.raises(error_type, match=message):
        await service.start_run(config, "bad", resume=False)


async def test_unknown_and_existing_runs(service, tmp_path):
    with pytest.raises(errors.NotFoundError, match=r"no run 'nope'; known: \[\]"):
        service.get_run("nope")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("")
    with pytest.raises(errors.AlreadyExistsError, match="--resume"):
        await service.start_run(config_yaml(tmp_path), "taken", resume=False)
    record = await service.start_run(config_yaml(tmp_path), "taken", resume=True)
    record.controller.allow(2)
    assert [e async for e in service.stream_progress("taken")][-1].state == RunState.SUCCEEDED


async def test_a_run_is_confined_to_the_runs_root_the_service_was_started_with(
    service, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    confined = TrainerService(Ranks(), model_path="unused-model", runs_root=Path("runs"))
    outside = tmp_path / "elsewhere"
    with pytest.raises(errors.InvalidArgumentError) as info:
        await confined.start_run(config_yaml(outside), "escape", resume=False)
    assert str(outside / "escape") in str(info.value) and str(tmp_path / "runs") in str(info.value)
    # A link inside the root that leads out of it is outside too.
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(errors.InvalidArgumentError, match="runs root"):
        await confined.start_run(config_yaml(tmp_path / "runs" / "link"), "escape", resume=False)
    with pytest.raises(errors.InvalidArgumentError, match="runs root"):
        await confined.start_run(config_yaml(Path("runs/..")), "escape", resume=False)
    assert not outside.exists() and not (tmp_path / "escape").exists()
    # The default trainer.output_dir, runs/, relative to the service's folder, is inside.
    record = await confined.start_run(config_yaml(Path("runs")), "inside", resume=False)
    assert record.output_dir == tmp_path / "runs" / "inside"
    record.controller.allow(2)
    assert [e async for e in confined.stream_progress("inside")][-1].state == RunState.SUCCEEDED


async def test_the_servicer_converts_runs_and_events(service, tmp_path):
    descriptor = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]

    def add_servicer(server):
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(service), server)

    async with (
        serve_in_process(ServerConfig(port=0), descriptor, add_servicer) as address,
        rpc.open_channel(ClientConfig(address=address)) as channel,
    ):
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        request = trainer_pb2.StartRunRequest(config_yaml=config_yaml(tmp_path), run_name="wire")
        started = (await stub.StartRun(request, timeout=10)).run
        assert (started.name, started.total_steps) == ("wire", 2)
        assert started.state == trainer_pb2.Run.STATE_STARTING
        assert started.output_dir == str((tmp_path / "wire").resolve())
        assert started.HasField("start_time") and not started.HasField("end_time")
        service.get_run("wire").controller.allow(2)
        progress = trainer_pb2.StreamProgressRequest(run_name="wire")
        events = [e async for e in stub.StreamProgress(progress, timeout=10)]
        run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name="wire"), timeout=10)).run
        with pytest.raises(errors.RpcNotFoundError, match="no run 'nope'"):
            await stub.StopRun(trainer_pb2.StopRunRequest(run_name="nope"), timeout=10)
    plain = service.get_run("wire")
    assert [(e.state, e.step, e.stage, e.message) for e in events] == [
        (trainer_pb2.Run.State.Value(p.state.value), p.step, p.stage, p.message)
        for p in plain.events
    ]
    assert events[1].metrics == {"train/loss": 1.0}
    assert events[0].time.ToNanoseconds() == int(plain.events[0].time * 1e9)
    assert run.state == trainer_pb2.Run.STATE_SUCCEEDED and run.step == 2
    assert dict(run.metrics) == {"train/loss": 0.5}
    assert run.end_time.ToNanoseconds() == int(plain.ended * 1e9)
