"""Checkpoints of a run: the policy's (and, with gae, the critic's) model, optimizer and scheduler
state, data position, RNG state, step.

Each checkpoint is one folder `checkpoints/step_<N>/` holding `state.pt` (the tensors and the
plain containers around them: model, optimizer and scheduler state, torch RNG states) and
`state.json` (the rest: step, data position, prompts in flight, Python's RNG state), written
into a temporary folder and renamed into place, so a folder that exists is complete: a run
killed mid-save (kill -9) resumes from the checkpoint before.

`state.pt` is loaded with `torch.load(weights_only=True)`, which builds tensors and plain
containers only: a file planted in a run folder that would run code when unpickled is refused.
"""

import json
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from turnrl.errors import ConfigError

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"
JSON_STATE_FILE = "state.json"


def save_checkpoint(
    run_dir: Path, step: int, tensors: dict[str, Any], loop_state: dict[str, Any]
) -> Path:
    """Writes `tensors` (tensors in dicts and lists) and `loop_state` (JSON values), plus the
    RNG states, as the checkpoint of `step`; returns its folder."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step_{step:06d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        torch.save({**tensors, "torch_rng": torch.get_rng_state()}, staging / STATE_FILE)
        plain = {**loop_state, "step": step, "python_rng": random.getstate()}
        (staging / JSON_STATE_FILE).write_text(json.dumps(plain))
        if target.exists():  # SaveCheckpoint on demand, then the periodic one, at one step
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The state of the newest complete checkpoint (its tensors and its JSON state in one
    dict), RNG states restored; None when there is none. Raises ConfigError for a file that is
    not a checkpoint this module wrote."""
    root = run_dir / CHECKPOINTS
    folders = sorted(root.glob("step_*")) if root.is_dir() else []
    if not folders:
        return None
    tensors_file, json_file = folders[-1] / STATE_FILE, folders[-1] / JSON_STATE_FILE
    try:
        tensors = torch.load(tensors_file, weights_only=True)
        plain = json.loads(json_file.read_text())
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConfigError(
            f"{tensors_file} with {json_file.name} is not a turnrl checkpoint (tensors and plain "
            f"containers only, beside JSON); it is not loaded: {e}"
        ) from None
    version, internal_state, gauss_next = plain["python_rng"]
    random.setstate((version, tuple(internal_state), gauss_next))
    torch.set_rng_state(tensors["torch_rng"])
    return {**tensors, **plain}
