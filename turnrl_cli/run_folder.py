"""Reading a run's folder, as the trainer service leaves it (trainer_svc/report.py: metrics.jsonl,
summary.json; trainer_svc/dumps.py: rollouts/ and eval/ step_<N>.jsonl): what `turnrl report`
and `turnrl show` present. Needs no service and no tokenizer: each dumped token carries its text.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The names trainer_svc/report.py and trainer_svc/dumps.py write, repeated: importing those
# would load matplotlib and torch into every `turnrl` command. tests/test_run_report.py checks
# that they agree.
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
DUMP_FOLDERS = ("rollouts", "eval")
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


class RunFolderError(Exception):
    """A path that is not a run folder, or a file in it that cannot be read."""


@dataclass(frozen=True)
class TokenView:
    """A trajectory's tokens, one entry per token in each list: its text as the model saw it,
    its id, whether the loss trained on it, its source (prompt, model, tool, user, template),
    the policy version that sampled it (None unless sampled), the engine's and the trainer's
    logprobs (None where there is none) and their absolute gap."""

    pieces: list[str]
    token_ids: list[int]
    trained: list[bool]
    sources: list[str]
    versions: list[int | None]
    rollout_logprobs: list[float | None]
    trainer_logprobs: list[float | None]
    gaps: list[float | None]


def check_run_folder(run_dir: Path) -> None:
    """Raises RunFolderError unless `run_dir` holds metrics or trajectory dumps."""
    if not run_dir.is_dir():
        raise RunFolderError(f"no run folder at {str(run_dir)!r}")
    if not (run_dir / METRICS_FILE).exists() and not any(
        dump_steps(run_dir, f) for f in DUMP_FOLDERS
    ):
        raise RunFolderError(
            f"{str(run_dir)!r} is not a run folder: it has no {METRICS_FILE} and no dumps in "
            f"{' or '.join(f + '/' for f in DUMP_FOLDERS)}"
        )


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metric records, one per logged step; a line cut short by a kill is skipped."""
    path = run_dir / METRICS_FILE
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json, written when the run ended; empty while it runs."""
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunFolderError(f"{path}: not JSON: {e}") from e


def dump_steps(run_dir: Path, folder: str) -> list[int]:
    """The steps, ascending, with a dump file in `folder` (rollouts or eval)."""
    directory = run_dir / folder
    names = (p.name for p in directory.iterdir()) if directory.is_dir() else ()
    return sorted(int(match[1]) for name in names if (match := _STEP_FILE.fullmatch(name)))


def read_dump(run_dir: Path, folder: str, step: int) -> list[dict[str, Any]]:
    """The trajectory records of `step` in `folder`."""
    path = run_dir / folder / f"step_{step:06d}.jsonl"
    if not path.exists():
        known = dump_steps(run_dir, folder)
        raise RunFolderError(f"no {folder} dump of step {step} in {run_dir}; steps dumped: {known}")
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except json.JSONDecodeError as e:
        raise RunFolderError(f"{path}: a line is not JSON: {e}") from e


def token_view(record: dict[str, Any]) -> TokenView:
    """The per-token view of a dumped trajectory (`trajectory_record` plus `tokens`)."""
    missing = [key for key in ("tokens", "segments") if key not in record]
    if missing:
        raise RunFolderError(
            f"trajectory {record['trajectory_id']!r} of step {record['step']} has no {missing}: "
            "it was dumped by a turnrl that did not write them"
        )
    sources: list[str] = []
    versions: list[int | None] = []
    for segment in record["segments"]:
        sampled = segment["source"] == "model"
        sources += [segment["source"]] * segment["tokens"]
        versions += [segment["policy_version"] if sampled else None] * segment["tokens"]
    trained = [bool(flag) for flag in record["loss_mask"]]
    rollout = [
        lp if sampled else None
        for lp, sampled in zip(record["rollout_logprobs"], trained, strict=True)
    ]
    trainer = record["trainer_logprobs"] or [None] * len(trained)
    trainer = [lp if sampled else None for lp, sampled in zip(trainer, trained, strict=True)]
    gaps = [
        abs(r - t) if r is not None and t is not None else None
        for r, t in zip(rollout, trainer, strict=True)
    ]
    return TokenView(
        pieces=record["tokens"],
        token_ids=record["token_ids"],
        trained=trained,
        sources=sources,
        versions=versions,
        rollout_logprobs=rollout,
        trainer_logprobs=trainer,
        gaps=gaps,
    )
