"""What a run leaves behind: metrics per step (metrics.jsonl and wandb), and at the end
curves.png (RL: reward and held-out accuracy against step; SFT: training and held-out loss) and
summary.json."""

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; the service has no display

import matplotlib.pyplot as plt

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
        run_name: str,
        wandb_mode: str,
        config: dict[str, Any],
        plot: Plot,
        resumed_step: int | None = None,
    ) -> None:
        """`resumed_step`: the checkpoint's step a resumed run continues from; what the run
        logged after it (before it was killed) is dropped, as it will be logged again."""
        self.run_dir = run_dir
        self.plot = plot
        path = run_dir / METRICS_FILE
        self.history = _read_history(path, resumed_step) if resumed_step is not None else []
        path.write_text("".join(json.dumps(record) + "\n" for record in self.history))
        # Imported here, not at the top: modules that only name the plots (the SFT warm start,
        # the tiny model's build) then run without wandb, as on the GPU machine, which gets
        # turnrl's dependencies as wheels within 64 MiB (scripts/gpu_wheels.sh).
        import wandb

        self._wandb = wandb.init(
            project="turnrl",
            name=run_name,
            id=run_name,
            resume="allow",
            dir=run_dir,
            mode=wandb_mode,
            config=config,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.history.append(record)
        with (self.run_dir / METRICS_FILE).open("a") as file:
            file.write(json.dumps(record) + "\n")
        self._wandb.log(metrics, step=step)

    def last(self, name: str) -> float | None:
        """The latest logged value of `name`."""
        return next((r[name] for r in reversed(self.history) if name in r), None)

    def first(self, name: str) -> float | None:
        return next((r[name] for r in self.history if name in r), None)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Writes curves.png and summary.json (with their paths added); closes wandb."""
        summary = {**summary, "curves": str(self.run_dir / CURVES_FILE)}
        self._plot(self.run_dir / CURVES_FILE)
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        self._wandb.summary.update(summary)
        self._wandb.finish()
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
