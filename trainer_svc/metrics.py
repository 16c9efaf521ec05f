"""Prometheus metrics of the trainer service, made from its runs at each scrape: each run's
step and the latest time of each phase of a step (the `time/...` values the run logs)."""

from collections.abc import Iterator

from prometheus_client.core import Metric

from trainer_svc.service import TrainerService
from turnrl.metrics import metric

PHASE_PREFIX = "time/"


def trainer_metrics(service: TrainerService) -> Iterator[Metric]:
    """The metrics of the runs `service` holds, labelled with each run's name."""
    runs = service.runs()
    yield metric(
        "turnrl_trainer_step",
        "Steps the run finished.",
        False,
        [({"run": run.name}, run.step) for run in runs],
    )
    yield metric(
        "turnrl_trainer_total_steps",
        "Steps the run takes unless stopped.",
        False,
        [({"run": run.name}, run.total_steps) for run in runs],
    )
    yield metric(
        "turnrl_trainer_phase_seconds",
        "Seconds the latest step spent in a phase: rollout, train, push, push_stall, eval.",
        False,
        [
            ({"run": run.name, "phase": name.removeprefix(PHASE_PREFIX)}, value)
            for run in runs
            for name, value in sorted(run.metrics.items())
            if name.startswith(PHASE_PREFIX)
        ],
    )
