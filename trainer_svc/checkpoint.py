"""Checkpoints of a run: the policy's (and, with gae, the critic's) model, optimizer and scheduler
state, data position, RNG state, step.

Each checkpoint is one folder `checkpoints/step_<N>/` holding `state.pt`, written into a
temporary folder and renamed into place, so a folder that exists is complete: a run killed
mid-save (kill -9) resumes from the checkpoint before.
"""

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Writes `state` plus the RNG states as the checkpoint of `step`; returns its folder."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{step:06d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        torch.save({**state, "step": step, "rng": rng}, staging / STATE_FILE)
        if target.exists():  # SaveCheckpoint on demand, then the periodic one, at one step
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The state of the newest complete checkpoint, RNG states restored; None when there is none."""
    root = run_dir / CHECKPOINTS
    folders = sorted(root.glob("step_*")) if root.is_dir() else []
    if not folders:
        return None
    # weights_only=False: the file holds Python RNG state; it is this run's own file.
    state = torch.load(folders[-1] / STATE_FILE, weights_only=False)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state
