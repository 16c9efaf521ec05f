"""What a run leaves behind: metrics per step (metrics.jsonl and the trackers of
trainer.loggers, trainer_svc.trackers), and at the end curves.png (RL: reward and held-out
accuracy against step; SFT: training and held-out loss) and summary.json."""

import json
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; the service has no display

import matplotlib.pyplot as plt

from trainer_svc.config import TrainerConfig
from trainer_svc.trackers import Trackers

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"


@dataclass(frozen=True)
class Plot:
    """What curves.png shows: (metric, label, line style) per curve, on one y axis."""

    curves: tuple[tuple[str, str, str], ...]
    y_limits: tuple[float, float] | None  # None: fitted to the values


REWARD_PLOT = Plot(
    curves=(
        ("rollout/reward_mean", "train reward (mean)", "-"),
        ("eval/accuracy", "held-out accuracy", "o-"),
    ),
    y_limits=(-0.02, 1.02),
)
LOSS_PLOT = Plot(
    curves=(("train/loss", "train loss", "-"), ("eval/loss", "held-out loss", "o-")),
    y_limits=None,
)


class RunReport:
    """The metric history of one run, written as it grows; resumed runs append to it."""

    def __init__(
        self,
        run_dir: Path,
        config: TrainerConfig,
        plot: Plot,
        resumed_step: int | None = None,
    ) -> None:
        """`resumed_step`: the checkpoint's step a resumed run continues from; what the run
        logged after it (before it was killed) is dropped, as it will be logged again. Opens
        the trackers of `config.loggers`, which can take seconds (wandb starts a process)."""
        self.run_dir = run_dir
        self.plot = plot
        path = run_dir / METRICS_FILE
        self.history = _read_history(path, resumed_step) if resumed_step is not None else []
        path.write_text("".join(json.dumps(record) + "\n" for record in self.history))
        self.trackers = Trackers(config, run_dir, resumed_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Appends a step's metrics to metrics.jsonl, and its numbers to the trackers (which
        plot numbers only)."""
        record = {"step": step, "time": time.time(), **metrics}
        self.history.append(record)
        with (self.run_dir / METRICS_FILE).open("a") as file:
            file.write(json.dumps(record) + "\n")
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}
        self.trackers.log(step, scalars)

    def last(self, name: str) -> float | None:
        """The latest logged value of `name`."""
        return next((r[name] for r in reversed(self.history) if name in r), None)

    def first(self, name: str) -> float | None:
        return next((r[name] for r in self.history if name in r), None)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Writes curves.png and summary.json (with their paths added, and `tracker_errors`:
        the trackers that failed, each with its error); closes the trackers."""
        summary = {
            **summary,
            "curves": str(self.run_dir / CURVES_FILE),
            "tracker_errors": self.trackers.errors,  # a tracker failing to finish adds to it
        }
        self._plot(self.run_dir / CURVES_FILE)
        self.trackers.finish(summary)
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _plot(self, path: Path) -> None:
        figure, axes = plt.subplots(figsize=(7, 4))
        for name, label, style in self.plot.curves:
            points = [(r["step"], r[name]) for r in self.history if name in r]
            if points:
                steps, values = zip(*points, strict=True)
                axes.plot(steps, values, style, label=label)
        axes.set_xlabel("step")
        if self.plot.y_limits is not None:
            axes.set_ylim(*self.plot.y_limits)
        axes.grid(alpha=0.3)
        axes.legend()
        axes.set_title(self.run_dir.name)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)


def _read_history(path: Path, through_step: int) -> list[dict[str, Any]]:
    """The records of steps up to `through_step`; a line cut short by a kill is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= through_step:
            records.append(record)
    return records
