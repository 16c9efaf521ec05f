"""The trackers a run's metrics go to besides metrics.jsonl (`trainer.loggers`): wandb,
TensorBoard and MLflow, each a class with `log` and `finish`, in TRACKERS; `Trackers` holds a
run's and is what trainer_svc.report.RunReport calls.

Identity: a fresh run makes its tracker run ids (wandb's from a uuid, MLflow's from its store)
and writes them to <run folder>/trackers.json; a resumed run reads them back and continues
those tracker runs. So two runs that share a name (in two output folders, or one started
again after its folder was removed) never write into one tracker run.

Steps logged again: a resumed run logs again the steps after its checkpoint that it had
logged before it was killed (metrics.jsonl drops the first values). TensorBoard hides the
first values too (the writer's `purge_step`); wandb and MLflow keep both, the later value
last in the step's history (MLflow has no way to delete a metric value, and wandb's
history is append-only).

Failures: a tracker that cannot start fails the run at its setup, with the tracker named.
One that fails mid-run is closed and dropped with its error logged; the run goes on
(metrics.jsonl holds every step) and summary.json's `tracker_errors` names it and the step,
so a tracker's run that stops early never reads as a complete one.

Cost: wandb and TensorBoard queue each step to a writer of their own; MLflow's `log_batch`
writes its store (a few ms for the SQLite store, a request for a server) on the loop's
thread. The packages are imported when a tracker starts, so a trainer without them runs
with the trackers it has (`require_packages` checks at StartRun), as the GPU machine does,
whose wheels travel within 64 MiB (scripts/gpu_wheels.sh) without any tracker's.
"""

import importlib.util
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from trainer_svc.config import TrainerConfig
from turnrl.errors import FailedPreconditionError

logger = logging.getLogger(__name__)

IDS_FILE = "trackers.json"  # {tracker name: its run id} of the run in this folder
TENSORBOARD_FOLDER = "tensorboard"
MLFLOW_STORE = "mlflow.db"  # the default MLflow store, in the run folder
MLFLOW_ARTIFACTS = "mlflow_artifacts"  # the default store's artifact root
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit on the params of one log_batch
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a param's value; longer ones are cut, marked


class Tracker(Protocol):
    """One tracker's run: `run_id` (None for a tracker without one) is kept across resumes."""

    run_id: str | None

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


class WandbTracker:
    """A wandb run (trainer.wandb) with files in <run folder>/wandb/; each step is logged with
    its `step`, the x axis of every chart, so that steps logged again stay on their step."""

    def __init__(
        self, config: TrainerConfig, run_dir: Path, resumed_step: int | None, run_id: str | None
    ) -> None:
        import wandb

        settings = config.wandb
        self.run_id = run_id or uuid.uuid4().hex
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            tags=settings.tags,
            name=run_dir.name,
            id=self.run_id,
            # A fresh run's id is new; "allow" rather than "must" lets a run resume whose
            # earlier wandb run never reached the server (offline, or a mode changed since).
            resume="never" if run_id is None else "allow",
            dir=run_dir,
            mode=settings.mode,
            config=config.model_dump(mode="json"),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({**metrics, "step": step})

    def finish(self, summary: dict[str, Any]) -> None:
        self._run.summary.update(summary)
        self._run.finish()


class TensorboardTracker:
    """Event files in <run folder>/tensorboard/, one per start of the run."""

    run_id = None

    def __init__(
        self, config: TrainerConfig, run_dir: Path, resumed_step: int | None, run_id: str | None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # The readers hide what earlier starts logged from this step on: a fresh start (a
        # --resume before the first checkpoint) hides everything.
        purge_step = 0 if resumed_step is None else resumed_step + 1
        self._writer = SummaryWriter(run_dir / TENSORBOARD_FOLDER, purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        # Written now rather than every flush_secs: a killed run's file then holds the steps
        # metrics.jsonl holds.
        self._writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self._writer.close()


class MlflowTracker:
    """An MLflow run (trainer.mlflow) named for the run, the config flattened into its params."""

    def __init__(
        self, config: TrainerConfig, run_dir: Path, resumed_step: int | None, run_id: str | None
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        settings = config.mlflow
        local_store = f"sqlite:///{(run_dir / MLFLOW_STORE).resolve()}"
        self._client = MlflowClient(tracking_uri=settings.tracking_uri or local_store)
        if run_id is not None:
            self._client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        experiment = self._client.get_experiment_by_name(settings.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # The local store's artifacts stay in the run folder (MLflow's default is ./mlruns).
            artifacts = (run_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
            experiment_id = self._client.create_experiment(
                settings.experiment, artifacts if settings.tracking_uri is None else None
            )
        self.run_id = self._client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        params = [
            Param(k, v if len(v) <= MLFLOW_PARAM_CHARS else v[: MLFLOW_PARAM_CHARS - 5] + "[...]")
            for k, v in _flatten(config.model_dump(mode="json")).items()
        ]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            chunk = params[start : start + MLFLOW_PARAMS_PER_CALL]
            self._client.log_batch(self.run_id, params=chunk)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        milliseconds = int(time.time() * 1000)
        batch = [Metric(name, value, milliseconds, step) for name, value in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def finish(self, summary: dict[str, Any]) -> None:
        self._client.set_terminated(self.run_id)


TRACKERS: dict[str, type[WandbTracker | TensorboardTracker | MlflowTracker]] = {
    "wandb": WandbTracker,
    "tensorboard": TensorboardTracker,
    "mlflow": MlflowTracker,
}
# The package each tracker imports; tensorboard and mlflow come with turnrl[trackers].
TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def require_packages(config: TrainerConfig) -> None:
    """Raises FailedPreconditionError when a tracker of `trainer.loggers` is not installed."""
    for name in config.loggers:
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise FailedPreconditionError(
                f"trainer.loggers names {name!r}, but the trainer service's environment lacks "
                f"the {package!r} package; install turnrl[trackers] there, or remove {name!r} "
                "from trainer.loggers"
            )


class Trackers:
    """The trackers of one run, opened in order; `resumed_step` as in RunReport."""

    def __init__(self, config: TrainerConfig, run_dir: Path, resumed_step: int | None) -> None:
        ids_path = run_dir / IDS_FILE
        known_ids = (
            json.loads(ids_path.read_text())
            if resumed_step is not None and ids_path.exists()
            else {}
        )
        self.trackers: dict[str, Tracker] = {}
        self.errors: dict[str, str] = {}  # a tracker dropped mid-run: what stopped it, when
        for name in config.loggers:
            try:
                tracker = TRACKERS[name](config, run_dir, resumed_step, known_ids.get(name))
            except Exception as e:
                self._close_all()
                raise FailedPreconditionError(
                    f"trainer.loggers: {name} failed to start: {type(e).__name__}: {e}"
                ) from e
            self.trackers[name] = tracker
        run_ids = {name: t.run_id for name, t in self.trackers.items() if t.run_id is not None}
        ids_path.write_text(json.dumps(known_ids | run_ids, indent=2) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(step, metrics)
            except Exception as e:
                logger.exception("tracker %s failed at step %d; dropped for the run", name, step)
                self.errors[name] = f"step {step}: {type(e).__name__}: {e}"
                del self.trackers[name]
                self._close(name, tracker)

    def finish(self, summary: dict[str, Any]) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.finish(summary)
            except Exception as e:
                logger.exception("tracker %s failed to finish", name)
                self.errors[name] = f"finish: {type(e).__name__}: {e}"
        self.trackers.clear()

    def _close_all(self) -> None:
        for name, tracker in self.trackers.items():
            self._close(name, tracker)
        self.trackers.clear()

    @staticmethod
    def _close(name: str, tracker: Tracker) -> None:
        """Ends a tracker that failed, or whose run failed to start; an error it raises in
        closing is logged only: the first error is the one reported."""
        try:
            tracker.finish({})
        except Exception:
            logger.warning("tracker %s also failed to close", name, exc_info=True)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`config` as {dotted key: value as text}, MLflow's params."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return flat
