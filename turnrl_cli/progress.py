"""A run's progress on the terminal (`turnrl run`, `turnrl eval`): a bar with the latest
metrics while the trainer streams the run's events (StreamProgress), evaluations printed as they
come, StopRun on Ctrl-C, and at the end the run's summary, or an evaluation's metrics per data
source, as a table."""

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from turnrl.v1 import trainer_pb2, trainer_pb2_grpc


async def follow_run(
    stub: trainer_pb2_grpc.TrainerServiceStub,
    run: trainer_pb2.Run,
    stop_requested: asyncio.Event,
    console: Console,
    final_table: Callable[[trainer_pb2.Run], Table],
) -> int:
    """Shows a run's progress until it ends, then `final_table` of the run; 0 when it succeeded
    or was stopped, 1 when it failed."""
    stopper = asyncio.create_task(_stop_run_on_request(stub, run.name, stop_requested, console))
    State = trainer_pb2.Run.State
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
    ) as progress:
        bar = progress.add_task(run.name, total=run.total_steps, status="starting")
        request = trainer_pb2.StreamProgressRequest(run_name=run.name)
        try:
            async for event in stub.StreamProgress(request):
                if event.stage == "setup":  # an SFT run counted in epochs knows its length here
                    get = trainer_pb2.GetRunRequest(run_name=run.name)
                    progress.update(bar, total=(await stub.GetRun(get, timeout=30)).run.total_steps)
                progress.update(bar, completed=event.step, status=_status_line(event))
                if event.stage in ("eval", "setup", "upload", "state") and event.message:
                    progress.console.print(
                        f"step {event.step}: {event.stage}: {escape(event.message)}"
                    )
        finally:  # the trainer may be gone: a later Ctrl-C is not this follower's to forward
            stopper.cancel()
    final = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name=run.name), timeout=30)).run
    if final.state == State.STATE_FAILED:
        console.print(
            f"[red]turnrl run: run failed: {escape(final.error_message)}[/red]", highlight=False
        )
        return 1
    console.print(final_table(final))
    return 0


def _status_line(event: trainer_pb2.StreamProgressResponse) -> str:
    shown = {
        "rollout/reward_mean": "reward",
        "eval/accuracy": "eval acc",
        "train/loss": "loss",
        "eval/loss": "eval loss",
        "train/grad_norm": "grad",
        "mismatch/mean_abs_diff": "mismatch",
    }
    return (
        "  ".join(
            f"{label} {event.metrics[name]:.3f}"
            for name, label in shown.items()
            if name in event.metrics
        )
        or event.stage
    )


async def _stop_run_on_request(
    stub: trainer_pb2_grpc.TrainerServiceStub,
    run_name: str,
    stop_requested: asyncio.Event,
    console: Console,
) -> None:
    await stop_requested.wait()
    console.print("stopping the run after its current step (with a checkpoint)")
    await stub.StopRun(trainer_pb2.StopRunRequest(run_name=run_name, save_checkpoint=True))


def summary_table(run: trainer_pb2.Run) -> Table:
    """The run's summary.json; the last value of each metric, from GetRun, when the trainer
    runs on another machine and the file is there."""
    summary_file = Path(run.output_dir) / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        table = Table(title=f"run summary ({summary_file})")
    else:
        summary = dict(sorted(run.metrics.items()))
        table = Table(title=f"last metrics of run {run.name!r} ({summary_file} is on the trainer)")
    table.add_column("metric")
    table.add_column("value")
    for name, value in summary.items():
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
    return table


# The metrics `trainer_svc.eval_metrics` reports per data source: eval/<source>/mean@n, ...
SAMPLED_METRIC = re.compile(r"(mean|pass)@\d+")


def eval_table(run: trainer_pb2.Run) -> Table:
    """An evaluation's mean@n and pass@k, overall and per data source, from GetRun's metrics;
    the run's folder (summary.json, eval/) is named in the title."""
    by_source: dict[str, dict[str, float]] = {}
    for name, value in run.metrics.items():
        source, _, metric = name.removeprefix("eval/").rpartition("/")
        if name.startswith("eval/") and SAMPLED_METRIC.fullmatch(metric):
            by_source.setdefault(source or "all", {})[metric] = value
    columns = sorted({m for metrics in by_source.values() for m in metrics})
    table = Table(
        title=f"evaluation of run {run.name!r} (metrics and generations in {run.output_dir})"
    )
    table.add_column("data source")
    for column in columns:
        table.add_column(column)
    for source in sorted(by_source, key=lambda s: (s != "all", s)):
        metrics = by_source[source]
        table.add_row(source, *(f"{metrics[c]:.3f}" if c in metrics else "-" for c in columns))
    return table
