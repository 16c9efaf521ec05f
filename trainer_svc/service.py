"""TrainerService: accepts runs, runs one at a time in a background task, keeps each run's
state and progress events for GetRun and StreamProgress. Plain types in and out; trainer_svc/
server.py converts them to and from the wire."""

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from trainer_svc.async_controller import AsyncController
from trainer_svc.checkpoint import find_checkpoint
from trainer_svc.config import RUN_LOGS_FOLDER, RUNS_FOLDER, TrainerConfig
from trainer_svc.controller import Controller
from trainer_svc.eval_run import EvalRun
from trainer_svc.ranks import Ranks
from trainer_svc.run_loop import CheckpointRequest, ProgressEvent, RunLoop
from trainer_svc.sft import SftController
from trainer_svc.trackers import require_packages
from turnrl.config import read_secret_env, validate_config
from turnrl.errors import (
    AlreadyExistsError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)

logger = logging.getLogger(__name__)
# The loop of each `trainer.mode`, and of `trainer.loop` in mode rl.
LOOPS: dict[str, type[RunLoop]] = {
    "sync": Controller,
    "async": AsyncController,
    "sft": SftController,
    "eval": EvalRun,
}


class RunState(enum.Enum):
    """Where a run is. Each value is the name of its `turnrl.v1.Run.State`."""

    STARTING = "STATE_STARTING"
    RUNNING = "STATE_RUNNING"
    STOPPING = "STATE_STOPPING"
    SUCCEEDED = "STATE_SUCCEEDED"
    STOPPED = "STATE_STOPPED"
    FAILED = "STATE_FAILED"


ENDED = (RunState.SUCCEEDED, RunState.STOPPED, RunState.FAILED)


@dataclass(frozen=True)
class RunEvent:
    """One entry of a run's progress: a finished stage, or a change of state (stage "state")."""

    state: RunState  # the run's state when the entry was made
    step: int
    stage: str  # setup, rollout, train, push, eval, checkpoint, upload, done; or state
    metrics: dict[str, float]
    message: str
    time: float  # seconds since the epoch


@dataclass
class RunRecord:
    """A run this service accepted: its state, its events so far, and its controller."""

    name: str
    output_dir: Path
    controller: RunLoop = field(init=False)
    state: RunState = RunState.STARTING
    started: float = field(default_factory=time.time)  # seconds since the epoch
    ended: float | None = None  # seconds since the epoch; None while the run runs
    error_message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # the latest value of each
    events: list[RunEvent] = field(default_factory=list)
    # Set when an event is added, then replaced: a waiter holds the one it saw.
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def step(self) -> int:
        """Steps finished so far."""
        return self.controller.step

    @property
    def total_steps(self) -> int:
        """Steps the run will take unless stopped."""
        return self.controller.total_steps


class TrainerService:
    """The runs of one trainer service; at most one runs at a time, on all of `ranks`.

    `model_path` is the model this service was started with (`turnrl serve trainer` sets it to
    the config's tiny model when the file leaves it null): a run whose `trainer.model_path` is
    null trains it, so that a client that cannot see this service's files (a trainer in a
    container) still trains the model the rollout service beside it serves.

    `runs_root` confines the runs: the service writes and resumes (loads checkpoints from)
    nothing outside it, whatever folder a client's StartRun names."""

    def __init__(
        self, ranks: Ranks, model_path: str | None = None, runs_root: Path = RUNS_FOLDER
    ) -> None:
        self._ranks = ranks
        self._model_path = model_path
        self._runs_root = runs_root.resolve()
        self._runs: dict[str, RunRecord] = {}

    async def start_run(
        self, config_yaml: str, run_name: str, resume: bool, resume_from: str | None = None
    ) -> RunRecord:
        """Starts a run (StartRun); with `resume` from its checkpoint named `resume_from`, or
        its newest."""
        config = _trainer_config(config_yaml)
        if resume_from is not None and not resume:
            raise InvalidArgumentError(
                f"resume_from={resume_from!r} names a checkpoint to resume from; set resume too"
            )
        if config.model_path is None:
            if self._model_path is None:
                raise InvalidArgumentError(
                    "trainer.model_path is null and this trainer service was started without a "
                    "model: set trainer.model_path to a Hugging Face folder (`turnrl serve`, "
                    "`up` and `run` set a null one to the config's tiny_model)"
                )
            config = config.model_copy(update={"model_path": self._model_path})
        if config.push_to_hub is not None:
            try:
                read_secret_env(config.push_to_hub.token_env)
            except ConfigError as e:
                raise InvalidArgumentError(
                    f"trainer.push_to_hub.token_env: {e} (in the trainer service's environment)"
                ) from None
        name = run_name or config.run_name
        if name in (".", "..") or "/" in name:
            raise InvalidArgumentError(
                f"run name {name!r} is not a folder name; a run is written to "
                "<trainer.output_dir>/<run name>/"
            )
        running = [r.name for r in self._runs.values() if r.state not in ENDED]
        if running:
            raise FailedPreconditionError(f"run {running[0]!r} is still running; stop it first")
        require_packages(config)
        if config.ranks != self._ranks.world_size:
            raise FailedPreconditionError(
                f"the run asks for trainer.ranks={config.ranks}; this trainer service runs "
                f"{self._ranks.world_size} (start it with trainer.ranks={config.ranks})"
            )
        try:
            output_dir = (config.output_dir / name).resolve()
            if not output_dir.is_relative_to(self._runs_root):
                raise InvalidArgumentError(
                    f"run {name!r} would be written to {str(output_dir)!r}, outside this trainer "
                    f"service's runs root {str(self._runs_root)!r}; set trainer.output_dir to "
                    "a folder inside it (the service's trainer.runs_root sets the root)"
                )
            existing = output_dir.iterdir() if output_dir.exists() else ()
            if any(p.name != RUN_LOGS_FOLDER for p in existing) and not resume:
                raise AlreadyExistsError(
                    f"run {name!r} exists in {output_dir}; resume it (--resume) or pick another "
                    "name (trainer.run_name=...)"
                )
            if resume_from is not None:
                try:
                    find_checkpoint(output_dir, resume_from)
                except ConfigError as e:
                    raise NotFoundError(str(e)) from None
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "config.yaml").write_text(config_yaml)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise InvalidArgumentError(
                f"cannot write run {name!r} in trainer.output_dir {str(config.output_dir)!r}: {e}"
            ) from e
        record = RunRecord(name, output_dir)
        record.controller = LOOPS[config.loop if config.mode == "rl" else config.mode](
            config, output_dir, partial(self._on_event, record), self._ranks
        )
        self._runs[name] = record
        record.task = asyncio.create_task(self._run(record, resume, resume_from))
        return record

    def runs(self) -> list[RunRecord]:
        """Every run this service accepted, in the order they started."""
        return list(self._runs.values())

    def get_run(self, name: str) -> RunRecord:
        record = self._runs.get(name)
        if record is None:
            raise NotFoundError(f"no run {name!r}; known: {sorted(self._runs)}")
        return record

    async def stream_progress(self, name: str) -> AsyncIterator[RunEvent]:
        """Every event of the run from its start, then new ones until it ends."""
        record = self.get_run(name)
        sent = 0
        while True:
            wakeup = record.wakeup
            pending = record.events[sent:]
            ended = record.state in ENDED
            for event in pending:
                yield event
            sent += len(pending)
            if ended and sent == len(record.events):
                return
            if not pending:
                await wakeup.wait()

    async def stop_run(self, name: str, save_checkpoint: bool) -> RunRecord:
        record = self.get_run(name)
        if record.state in ENDED:
            return record
        if save_checkpoint:
            self._request_checkpoint(record)
        record.controller.request_stop()
        self._set_state(record, RunState.STOPPING)
        assert record.task is not None
        await asyncio.shield(record.task)
        return record

    async def save_checkpoint(self, name: str) -> tuple[Path, int]:
        record = self.get_run(name)
        if record.state not in (RunState.RUNNING, RunState.STOPPING):
            raise FailedPreconditionError(
                f"run {name!r} is {record.state.value}; only a running run checkpoints"
            )
        return await self._request_checkpoint(record)

    async def close(self) -> None:
        """Stops the running run after its current step."""
        for record in self._runs.values():
            if record.task is not None and not record.task.done():
                record.controller.request_stop()
                with contextlib.suppress(Exception):
                    await record.task

    def _request_checkpoint(self, record: RunRecord) -> asyncio.Future:
        request = CheckpointRequest(done=asyncio.get_running_loop().create_future())
        record.controller.checkpoint_requests.append(request)
        return request.done

    async def _run(self, record: RunRecord, resume: bool, resume_from: str | None) -> None:
        try:
            await record.controller.run(resume, resume_from)
            stopped = record.controller.step < record.controller.total_steps
            self._set_state(record, RunState.STOPPED if stopped else RunState.SUCCEEDED)
        except Exception as e:  # a failed run is reported to its callers, not raised here
            logger.exception("run %s failed", record.name)
            record.error_message = f"{type(e).__name__}: {e}"
            self._set_state(record, RunState.FAILED, record.error_message)
        finally:
            record.controller.close()
            for request in record.controller.checkpoint_requests:
                if not request.done.done():
                    request.done.set_exception(
                        FailedPreconditionError(f"run {record.name!r} ended before a checkpoint")
                    )

    def _on_event(self, record: RunRecord, event: ProgressEvent) -> None:
        record.metrics.update(event.metrics)
        if record.state == RunState.STARTING and event.stage == "setup":
            record.state = RunState.RUNNING
        _publish(
            record,
            RunEvent(
                record.state,
                event.step,
                event.stage,
                dict(event.metrics),
                event.message,
                time.time(),
            ),
        )

    def _set_state(self, record: RunRecord, state: RunState, message: str = "") -> None:
        if record.state in ENDED:
            return
        record.state = state
        now = time.time()
        if state in ENDED:
            record.ended = now
        _publish(record, RunEvent(state, record.step, "state", {}, message or state.value, now))


def _publish(record: RunRecord, event: RunEvent) -> None:
    record.events.append(event)
    record.wakeup.set()
    record.wakeup = asyncio.Event()


def _trainer_config(config_yaml: str) -> TrainerConfig:
    """The `trainer:` section of a whole turnrl config in YAML."""
    try:
        data: Any = yaml.safe_load(config_yaml) or {}
    except yaml.YAMLError as e:
        raise InvalidArgumentError(f"config_yaml is not YAML: {e}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError("config_yaml must be a mapping of sections")
    try:
        return validate_config(TrainerConfig, data.get("trainer") or {}, path=None, overrides={})
    except ConfigError as e:
        raise InvalidArgumentError(f"trainer config: {e}") from None
