"""`turnrl report RUN`: one self-contained HTML page of a run (report.html in its folder): the
curves of metrics.jsonl as inline SVG, summary.json as a table, and a browser of the dumped
trajectories by step and reward, each token as the model saw it, coloured by what the loss did
with it and by the engine/trainer logprob gap. No server, no network: the page (CSS, script and
the dumps as JSON) is one file that opens from disk; report_page.html is its template."""

import html
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from turnrl_cli.run_folder import (
    DUMP_FOLDERS,
    check_run_folder,
    dump_steps,
    read_dump,
    read_metrics,
    read_summary,
    token_view,
)

REPORT_FILE = "report.html"
CHART_WIDTH, CHART_HEIGHT, CHART_MARGIN = 420, 210, 40
SERIES_COLOURS = ("#2563eb", "#dc2626", "#059669", "#d97706")


@dataclass(frozen=True)
class Chart:
    """One SVG chart: (metric, label) per line, on one y axis."""

    title: str
    series: tuple[tuple[str, str], ...]


CHARTS = (
    Chart(
        "reward",
        (("rollout/reward_mean", "train reward (mean)"), ("eval/accuracy", "held-out accuracy")),
    ),
    Chart("engine/trainer logprob gap", (("mismatch/mean_abs_diff", "mean |rollout - trainer|"),)),
    Chart("loss", (("train/loss", "train loss"), ("eval/loss", "held-out loss"))),
    Chart("staleness", (("staleness/mean", "mean"), ("staleness/max", "max"))),
    Chart(
        "tokens per second",
        (("rollout/tokens_per_s", "rollout"), ("train/tokens_per_s", "train")),
    ),
)


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Writes the run's page to `output` (default: report.html in the run folder); its path."""
    check_run_folder(run_dir)
    output = output or run_dir / REPORT_FILE
    output.write_text(render_page(run_dir))
    return output


def render_page(run_dir: Path) -> str:
    metrics = read_metrics(run_dir)
    dumps = {
        folder: {
            step: [_page_record(r) for r in read_dump(run_dir, folder, step)] for step in steps
        }
        for folder in DUMP_FOLDERS
        if (steps := dump_steps(run_dir, folder))
    }
    slots = {
        "TITLE": html.escape(run_dir.resolve().name),
        "SUMMARY": summary_table(read_summary(run_dir)),
        "CHARTS": "".join(svg_chart(c, metrics) for c in CHARTS) or "<p>no metrics logged yet</p>",
        "DATA": script_json({"run": run_dir.resolve().name, "dumps": dumps}),
    }
    template = resources.files("turnrl_cli").joinpath("report_page.html").read_text()
    # One pass: text filled into a slot is never searched for slots again.
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda match: slots[match[1]], template)


def script_json(value: Any) -> str:
    """`value` as JSON that is safe inside a <script> element: no '<', '>' or '&' appears raw
    (model text holding "</script>" or "<!--" cannot end or bend the element)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(raw, escaped)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _page_record(record: dict[str, Any]) -> dict[str, Any]:
    """A dump record as the page reads it: the per-token arrays replaced by its token view,
    logprobs rounded, the flags, sources and versions that run on for many tokens as
    [value, count] runs, the gap left to the page."""
    view = token_view(record)
    per_token = ("token_ids", "tokens", "loss_mask", "rollout_logprobs", "trainer_logprobs")
    kept = {key: value for key, value in record.items() if key not in (*per_token, "segments")}
    return {
        **kept,
        "view": {
            "pieces": view.pieces,
            "ids": view.token_ids,
            "trained": runs([int(flag) for flag in view.trained]),
            "sources": runs(view.sources),
            "versions": runs(view.versions),
            "rollout": [_rounded(lp) for lp in view.rollout_logprobs],
            "trainer": [_rounded(lp) for lp in view.trainer_logprobs],
        },
    }


def runs(values: list[Any]) -> list[list[Any]]:
    """`values` as [value, count] runs of equal values (the page's `expand` undoes it)."""
    encoded: list[list[Any]] = []
    for value in values:
        if encoded and encoded[-1][0] == value:
            encoded[-1][1] += 1
        else:
            encoded.append([value, 1])
    return encoded


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def summary_table(summary: dict[str, Any]) -> str:
    if not summary:
        return "<p>no summary.json yet (the run has not ended)</p>"
    rows = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(_summary_value(value))}</td></tr>"
        for key, value in summary.items()
    )
    return f'<table class="summary">{rows}</table>'


def _summary_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def svg_chart(chart: Chart, metrics: list[dict[str, Any]]) -> str:
    """The chart of `metrics` (metrics.jsonl's records) as an inline SVG; '' when none of its
    metrics was logged."""
    lines = [
        (label, [(r["step"], r[name]) for r in metrics if isinstance(r.get(name), int | float)])
        for name, label in chart.series
    ]
    lines = [(label, points) for label, points in lines if points]
    if not lines:
        return ""
    steps = [step for _, points in lines for step, _ in points]
    values = [value for _, points in lines for _, value in points]
    low_step, high_step = min(steps), max(max(steps), min(steps) + 1)
    low, high = min(values), max(values)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    plot_w, plot_h = CHART_WIDTH - 2 * CHART_MARGIN, CHART_HEIGHT - 2 * CHART_MARGIN

    def x(step: float) -> float:
        return CHART_MARGIN + (step - low_step) / (high_step - low_step) * plot_w

    def y(value: float) -> float:
        return CHART_MARGIN + (high - value) / (high - low) * plot_h

    parts = [
        f'<svg class="chart" width="{CHART_WIDTH}" height="{CHART_HEIGHT}" role="img">',
        f'<text x="{CHART_MARGIN}" y="16" class="chart-title">{html.escape(chart.title)}</text>',
        f'<rect x="{CHART_MARGIN}" y="{CHART_MARGIN}" width="{plot_w}" height="{plot_h}" class="frame"/>',
        f'<text x="4" y="{CHART_MARGIN + 4}" class="tick">{high:.3g}</text>',
        f'<text x="4" y="{CHART_MARGIN + plot_h}" class="tick">{low:.3g}</text>',
        f'<text x="{CHART_MARGIN}" y="{CHART_HEIGHT - 22}" class="tick">step {low_step}</text>',
        f'<text x="{CHART_WIDTH - CHART_MARGIN}" y="{CHART_HEIGHT - 22}" class="tick" '
        f'text-anchor="end">{high_step}</text>',
    ]
    for index, (label, points) in enumerate(lines):
        colour = SERIES_COLOURS[index % len(SERIES_COLOURS)]
        xy = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        parts.append(f'<polyline points="{xy}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if len(points) <= 30:
            parts += [
                f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}"/>'
                for s, v in points
            ]
        legend_x = CHART_MARGIN + index * (plot_w // len(lines))
        parts.append(
            f'<text x="{legend_x}" y="{CHART_HEIGHT - 6}" fill="{colour}" class="legend">'
            f"{html.escape(label)} ({points[-1][1]:.3g})</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
