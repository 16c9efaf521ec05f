"""`turnrl show RUN [--step N] [--eval] [-n K] [--tokens]`: a step's dumped trajectories in the
terminal, as report.html shows them (turnrl_cli/run_report.py): a header per trajectory, its
messages, and with --tokens each token as the model saw it. Colours only on a terminal; the
trained tokens are also marked «like this», so a pipe or a file keeps the distinction."""

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from turnrl_cli.run_folder import (
    RunFolderError,
    check_run_folder,
    dump_steps,
    read_dump,
    token_view,
)

GAP_FULL = 0.5  # nats: the gap that gets the strongest tint, as on the page
ROLE_STYLES = {"system": "dim", "user": "yellow", "assistant": "blue", "tool": "green"}


def show(
    run_dir: Path, step: int | None, evaluation: bool, count: int, tokens: bool, console: Console
) -> None:
    """Prints up to `count` trajectories of `step` (default: the last dumped), rewards high to
    low, from the eval dumps when `evaluation`, else from the rollouts'."""
    check_run_folder(run_dir)
    folder = "eval" if evaluation else "rollouts"
    steps = dump_steps(run_dir, folder)
    if not steps:
        raise RunFolderError(f"no {folder} dumps in {run_dir}")
    records = read_dump(run_dir, folder, steps[-1] if step is None else step)
    records.sort(key=lambda r: -r["reward"] if r["reward"] is not None else float("inf"))
    shown = records[:count]
    console.print(
        f"{run_dir.resolve().name}: {folder} step {shown[0]['step'] if shown else step}, "
        f"{len(shown)} of {len(records)} trajectories, reward high to low",
        highlight=False,
        soft_wrap=True,
    )
    for record in shown:
        console.print()
        console.print(header(record), soft_wrap=True)
        for message in record["messages"]:
            console.print(message_text(message), soft_wrap=True)
        if tokens:
            console.print(Text("tokens («trained», the rest masked):", style="bold"))
            console.print(token_text(record), soft_wrap=True)


def header(record: dict[str, Any]) -> Text:
    reward = "none" if record["reward"] is None else f"{record['reward']:.3f}"
    facts = [
        f"step {record['step']}",
        f"reward {reward}",
        f"finish {record['finish_reason']}",
        f"{record['total_tokens']} tokens ({record['response_tokens']} response)",
        f"policy versions {record['policy_versions']}",
    ]
    if record["logprob_mismatch"] is not None:
        facts.append(f"logprob gap {record['logprob_mismatch']:.4f}")
    facts.append(f"id {record['trajectory_id']}")
    text = Text("── " + " · ".join(facts), style="bold")
    for problem in (record["error_message"], record["reward_error"]):
        if problem:
            text.append(f"\n   error: {problem}", style="red")
    return text


def message_text(message: dict[str, Any]) -> Text:
    role = message["role"]
    text = Text(f"[{role}] ", style=f"bold {ROLE_STYLES.get(role, '')}".strip())
    content = message.get("content")
    text.append(content if isinstance(content, str) else str(content))
    for call in message.get("tool_calls", []):
        function = call["function"]
        text.append(f"\n  → {function['name']}({function['arguments']})", style="green")
    return text


def token_text(record: dict[str, Any]) -> Text:
    """Each token's text; trained ones inside «», tinted red by their logprob gap on a terminal,
    masked ones dim."""
    view = token_view(record)
    text = Text()
    for index, piece in enumerate(view.pieces):
        trained = view.trained[index]
        opens = trained and (index == 0 or not view.trained[index - 1])
        closes = trained and (index + 1 == len(view.pieces) or not view.trained[index + 1])
        if opens:
            text.append("«", style="bold blue")
        gap = view.gaps[index]
        style = "dim" if not trained else "blue" if not gap else f"blue on {_tint(gap)}"
        text.append(piece.replace("\n", "↵\n"), style=style)
        if closes:
            text.append("»", style="bold blue")
    return text


def _tint(gap: float) -> str:
    """A dark red that brightens with the gap, up to GAP_FULL."""
    strength = min(gap / GAP_FULL, 1.0)
    return f"rgb({int(60 + 180 * strength)},30,30)"
