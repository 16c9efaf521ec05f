"""Checkpoint files: tensors in state.pt, loaded with torch.load(weights_only=True), the rest as
JSON in state.json; a checkpoint planted in a run folder that would run code when unpickled is
refused, and the code never runs; a run resumes only from a checkpoint that holds each of its
models."""

import os
import pickle
import random
from pathlib import Path

import pytest
import torch

from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch, token_mean_loss
from trainer_svc.checkpoint import load_latest_checkpoint, save_checkpoint
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, checkpoint_state, restore
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


def test_a_run_with_a_critic_or_a_judge_of_its_own_resumes_only_from_a_checkpoint_with_it(
    model_dir, tmp_path
):
    policy, judge = FsdpPolicy(model_dir, SETTINGS), FsdpPolicy(model_dir, SETTINGS)
    save_checkpoint(tmp_path / "policy", 3, checkpoint_state(Models(policy)), {})
    with pytest.raises(ConfigError, match=r"step 3 in .* holds no judge model"):
        restore(Models(policy, judge=judge), tmp_path / "policy")
    with pytest.raises(ConfigError, match=r"step 3 in .* holds no critic"):
        restore(Models(policy, critic=FsdpCritic(model_dir, SETTINGS)), tmp_path / "policy")
    assert restore(Models(policy), tmp_path / "policy")["step"] == 3

    judge.train_step(fixed_batch(), token_mean_loss)
    save_checkpoint(tmp_path / "both", 4, checkpoint_state(Models(policy, judge=judge)), {})
    resumed = Models(FsdpPolicy(model_dir, SETTINGS), judge=FsdpPolicy(model_dir, SETTINGS))
    assert restore(resumed, tmp_path / "both")["step"] == 4
    trained, untrained = judge.full_state_dict(), policy.full_state_dict()
    judged, resumed_policy = resumed.judge.full_state_dict(), resumed.policy.full_state_dict()
    assert all(torch.equal(judged[name], tensor) for name, tensor in trained.items())
    assert all(torch.equal(resumed_policy[name], tensor) for name, tensor in untrained.items())
    assert not all(torch.equal(untrained[name], tensor) for name, tensor in trained.items())
