"""Checkpoint files: tensors in state.pt, loaded with torch.load(weights_only=True), the rest as
JSON in state.json; a checkpoint planted in a run folder that would run code when unpickled is
refused, and the code never runs."""

import os
import pickle
import random
from pathlib import Path

import pytest
import torch

from trainer_svc.checkpoint import load_latest_checkpoint, save_checkpoint
from turnrl.errors import ConfigError


class RunsACommand:
    """Unpickled, it runs `touch <marker>` as whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_round_trips_its_tensors_json_state_and_rng(tmp_path):
    random.seed(7)
    torch.manual_seed(7)
    tensors = {"policy": {"model": {"w": torch.arange(4.0)}}, "generator": torch.ones(3)}
    folder = save_checkpoint(tmp_path, 3, tensors, {"data_position": 12, "pending": [1, 5]})
    assert sorted(p.name for p in folder.iterdir()) == ["state.json", "state.pt"]
    expected = (random.random(), torch.rand(2))
    random.seed(0)
    torch.manual_seed(0)

    state = load_latest_checkpoint(tmp_path)
    assert state["step"] == 3 and state["data_position"] == 12 and state["pending"] == [1, 5]
    torch.testing.assert_close(state["policy"]["model"]["w"], torch.arange(4.0))
    torch.testing.assert_close(state["generator"], torch.ones(3))
    # The RNG states are restored exactly: the same draws as after the save.
    assert random.random() == expected[0]
    torch.testing.assert_close(torch.rand(2), expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_planted_checkpoint_that_would_run_a_command_is_refused(tmp_path, writer):
    marker = tmp_path / "pwned"
    folder = save_checkpoint(tmp_path / "run", 1, {}, {"data_position": 0})
    planted = {"policy": RunsACommand(marker)}
    if writer == "pickle":
        (folder / "state.pt").write_bytes(pickle.dumps(planted, protocol=2))
    else:
        torch.save(planted, folder / "state.pt")

    with pytest.raises(ConfigError, match=r"step_000001/state\.pt.*not a turnrl checkpoint"):
        load_latest_checkpoint(tmp_path / "run")
    assert not marker.exists()
