"""The trackers of trainer.loggers (trainer_svc/trackers.py), each writing locally and read
back with its own reader: TensorBoard's event files with EventAccumulator, the MLflow store in
the run folder with MlflowClient, wandb's offline run files. A real SFT run stopped and resumed,
steps logged again after a kill, tracker ids across resumes and between runs of one name,
failures at start and mid-run, and the config's checks. wandb runs offline only."""

import json
import re
import struct
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from trainer_svc import trackers
from trainer_svc.config import TrainerConfig
from trainer_svc.ranks import Ranks
from trainer_svc.report import LOSS_PLOT, METRICS_FILE, SUMMARY_FILE, RunReport
from trainer_svc.service import TrainerService
from trainer_svc.sft import SftController
from trainer_svc.trackers import IDS_FILE, MLFLOW_STORE, TENSORBOARD_FOLDER
from turnrl.config import validate_config
from turnrl.errors import ConfigError, FailedPreconditionError

from .test_sft import SMALL_SFT_RUN

ALL_LOGGERS = ["wandb", "tensorboard", "mlflow"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """wandb never reaches the network here, whatever the config says; nor does MLflow's
    usage telemetry."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def metrics_jsonl(run_dir: Path, name: str) -> dict[int, float]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return {r["step"]: r[name] for r in map(json.loads, lines) if name in r}


def tensorboard_scalars(run_dir: Path, name: str) -> dict[int, float]:
    """What TensorBoard shows of `name`: the steps an earlier start logged after the step a
    later one resumed from are purged."""
    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(name)}


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """One SQLite store for the tests that name theirs: a new store takes seconds (MLflow
    builds its tables), each run folder's own store included."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / MLFLOW_STORE}"


def mlflow_client(run_dir: Path, tracking_uri: str | None = None) -> MlflowClient:
    """A client of the run's store: `tracking_uri`, or the one in its folder."""
    local_store = f"sqlite:///{(run_dir / MLFLOW_STORE).resolve()}"
    return MlflowClient(tracking_uri=tracking_uri or local_store)


def mlflow_history(
    run_dir: Path, name: str, tracking_uri: str | None = None
) -> list[tuple[int, float]]:
    """Every (step, value) the run's MLflow run holds of `name`, in the order logged."""
    client = mlflow_client(run_dir, tracking_uri)
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    history = client.get_metric_history(run_id, name)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp)]


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks of chunks, each with
    a 7-byte header: CRC, length, type) after wandb's 7-byte file header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record ends here
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_offline_runs(run_dir: Path) -> list[list[wandb_internal_pb2.Record]]:
    """The records of each offline wandb run in the run folder, one per start, oldest first."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [wandb_records(path) for path in files]


def of_kind(records: list[wandb_internal_pb2.Record], kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def wandb_history(records: list[wandb_internal_pb2.Record], name: str) -> dict[int, float]:
    steps = {}
    for history in of_kind(records, "history"):
        items = {item.key or "/".join(item.nested_key): item.value_json for item in history.item}
        if name in items:
            steps[int(items["step"])] = json.loads(items[name])
    return steps


def sft_config(tiny_model_dir: Path, **trainer) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {**SMALL_SFT_RUN, "model_path": str(tiny_model_dir), "loggers": ALL_LOGGERS, **trainer}
    )


async def test_a_real_run_stopped_and_resumed_writes_every_tracker_with_one_run_id(
    tiny_model_dir, tmp_path
):
    config = sft_config(
        tiny_model_dir,
        steps=3,
        wandb={"project": "turnrl-tests", "group": "trackers", "tags": ["sft", "test"]},
        mlflow={"experiment": "trackers"},
        data={**SMALL_SFT_RUN["data"], "chat_template_kwargs": {"note": "x" * 7000}},
    )
    run_dir = tmp_path / "calc"
    run_dir.mkdir()  # as StartRun makes it

    def stop_after_step_2(event):
        if event.stage == "train" and event.step == 2:
            stopped.request_stop()

    stopped = SftController(config, run_dir, stop_after_step_2, Ranks())
    assert (await stopped.run(resume=False))["steps"] == 2
    ids = json.loads((run_dir / IDS_FILE).read_text())
    resumed = SftController(config, run_dir, lambda event: None, Ranks())
    summary = await resumed.run(resume=True)
    assert summary["steps"] == 3 and summary["tracker_errors"] == {}
    assert json.loads((run_dir / IDS_FILE).read_text()) == ids  # kept across the resume

    losses = metrics_jsonl(run_dir, "train/loss")
    assert sorted(losses) == [1, 2, 3]
    assert tensorboard_scalars(run_dir, "train/loss") == pytest.approx(losses)
    assert dict(mlflow_history(run_dir, "train/loss")) == pytest.approx(losses)
    assert dict(mlflow_history(run_dir, "eval/loss")) == pytest.approx(
        metrics_jsonl(run_dir, "eval/loss")
    )
    mlflow_run = mlflow_client(run_dir).get_run(ids["mlflow"])
    assert mlflow_run.info.run_name == "calc" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["sft.conversations_per_step"] == "4"
    long_param = mlflow_run.data.params["data.chat_template_kwargs.note"]  # cut at MLflow's limit
    assert len(long_param) == 6000 and long_param.endswith("x[...]")
    experiment = mlflow_client(run_dir).get_experiment(mlflow_run.info.experiment_id)
    assert experiment.name == "trackers"

    first, second = wandb_offline_runs(run_dir)  # one offline run a start, one wandb id
    for records in (first, second):
        (run,) = of_kind(records, "run")
        assert run.run_id == ids["wandb"] and run.display_name == "calc"
        assert run.project == "turnrl-tests" and run.run_group == "trackers"
        assert list(run.tags) == ["sft", "test"]
        config_items = {item.key: item.value_json for item in run.config.update}
        assert json.loads(config_items["model_path"]) == str(tiny_model_dir)
    assert wandb_history(first, "train/loss") | wandb_history(second, "train/loss") == (
        pytest.approx(losses)
    )
    summaries = {
        item.key or "/".join(item.nested_key): item.value_json
        for summary_record in of_kind(second, "summary")
        for item in summary_record.update
    }
    assert json.loads(summaries["steps"]) == 3

    # A second run of the same name, in another folder: trackers of its own.
    elsewhere = tmp_path / "elsewhere" / "calc"
    elsewhere.mkdir(parents=True)
    config = sft_config(tiny_model_dir, steps=1, loggers=["wandb"])
    await SftController(config, elsewhere, lambda event: None, Ranks()).run(resume=False)
    other_ids = json.loads((elsewhere / IDS_FILE).read_text())
    assert other_ids.keys() == {"wandb"} and other_ids["wandb"] != ids["wandb"]
    (run,) = of_kind(wandb_offline_runs(elsewhere)[0], "run")
    assert run.run_id == other_ids["wandb"] and run.display_name == "calc"


def report(run_dir: Path, mlflow_store: str, resumed_step: int | None = None) -> RunReport:
    """The report of a run in `run_dir` to TensorBoard and MLflow (the store `mlflow_store`)."""
    config = TrainerConfig.model_validate(
        {"loggers": ["tensorboard", "mlflow"], "mlflow": {"tracking_uri": mlflow_store}}
    )
    return RunReport(run_dir, config, LOSS_PLOT, resumed_step)


def test_steps_logged_again_after_a_kill_and_metrics_that_are_no_numbers(tmp_path, mlflow_store):
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    killed = report(run_dir, mlflow_store)
    for step in (1, 2, 3):
        killed.log(step, {"train/loss": float(step), "train/note": "text", "eval/none": None})
    # Killed after step 3 with a checkpoint of step 1: no finish. The resume logs 2 and 3 again.
    resumed = report(run_dir, mlflow_store, resumed_step=1)
    for step in (2, 3, 4):
        resumed.log(step, {"train/loss": 10.0 * step})
    resumed.finish({})

    assert metrics_jsonl(run_dir, "train/loss") == {1: 1.0, 2: 20.0, 3: 30.0, 4: 40.0}
    assert metrics_jsonl(run_dir, "train/note") == {1: "text"}
    assert tensorboard_scalars(run_dir, "train/loss") == {1: 1.0, 2: 20.0, 3: 30.0, 4: 40.0}
    # MLflow keeps both values of a step logged again, the later one last.
    assert mlflow_history(run_dir, "train/loss", mlflow_store) == [
        (1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 40.0)
    ]  # fmt: skip
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    assert set(mlflow_client(run_dir, mlflow_store).get_run(run_id).data.metrics) == {"train/loss"}
    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER))
    events.Reload()
    assert events.Tags()["scalars"] == ["train/loss"]


def test_a_fresh_run_in_a_folder_with_trackers_makes_new_ones(tmp_path, mlflow_store):
    """A --resume before the first checkpoint starts the run again: new tracker runs, and
    TensorBoard hides what the first start logged."""
    run_dir = tmp_path / "again"
    run_dir.mkdir()
    first = report(run_dir, mlflow_store)
    first.log(1, {"train/loss": 1.0})
    first_ids = json.loads((run_dir / IDS_FILE).read_text())
    again = report(run_dir, mlflow_store)
    again.log(1, {"train/loss": 5.0})
    again.finish({})
    assert json.loads((run_dir / IDS_FILE).read_text())["mlflow"] != first_ids["mlflow"]
    assert mlflow_history(run_dir, "train/loss", mlflow_store) == [(1, 5.0)]
    assert tensorboard_scalars(run_dir, "train/loss") == {1: 5.0}


def test_a_tracker_that_fails_mid_run_is_dropped_and_named_in_the_summary(tmp_path, mlflow_store):
    run_dir = tmp_path / "broken"
    run_dir.mkdir()
    run = report(run_dir, mlflow_store)
    run.log(1, {"train/loss": 1.0})
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    mlflow_client(run_dir, mlflow_store).delete_run(
        run_id
    )  # its store now refuses the run's metrics
    run.log(2, {"train/loss": 2.0})
    run.log(3, {"train/loss": 3.0})
    assert list(run.trackers.trackers) == ["tensorboard"]
    summary = run.finish({"steps": 3})

    assert summary["tracker_errors"].keys() == {"mlflow"}
    assert summary["tracker_errors"]["mlflow"].startswith("step 2: MlflowException")
    written = json.loads((run_dir / SUMMARY_FILE).read_text())
    assert written["tracker_errors"] == summary["tracker_errors"]
    assert metrics_jsonl(run_dir, "train/loss") == {1: 1.0, 2: 2.0, 3: 3.0}
    assert tensorboard_scalars(run_dir, "train/loss") == {1: 1.0, 2: 2.0, 3: 3.0}


def test_a_tracker_that_cannot_start_fails_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "no-store"
    run_dir.mkdir()
    (tmp_path / "a-file").write_text("")
    config = TrainerConfig.model_validate(
        {
            "loggers": ["tensorboard", "mlflow"],
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"},
        }
    )
    with pytest.raises(FailedPreconditionError, match=r"trainer\.loggers: mlflow failed to start"):
        RunReport(run_dir, config, LOSS_PLOT)


async def test_start_run_refuses_a_tracker_whose_package_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "mlflow", "mlflow_not_installed")
    service = TrainerService(Ranks(), "model", runs_root=tmp_path)
    config_yaml = "trainer: {loggers: [tensorboard, mlflow]}"
    with pytest.raises(FailedPreconditionError, match="lacks the 'mlflow_not_installed' package"):
        await service.start_run(config_yaml, "missing", resume=False)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "trainer, message",
    [
        ({"loggers": ["wandb", "comet"]}, "loggers.1"),
        ({"loggers": ["mlflow", "mlflow"]}, "loggers names a tracker twice"),
        ({"loggers": [], "wandb": {"project": "p"}}, "wandb is set but loggers is []"),
        ({"loggers": ["wandb"], "mlflow": {"experiment": "e"}}, "add 'mlflow' to loggers"),
        ({"wandb": {"mode": "disabled"}}, "wandb.mode"),
        ({"wandb_mode": "offline"}, "wandb_mode"),
    ],
)
def test_bad_tracker_settings_name_the_key(trainer, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        validate_config(TrainerConfig, trainer, path=None, overrides={})
    if "comet" in str(trainer):
        assert "'comet'" in str(raised.value)
