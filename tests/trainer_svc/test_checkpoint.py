"""Checkpoint files: each rank's shards in safetensors files, the small rest in state.pt (loaded
with torch.load(weights_only=True)) and state.json; a checkpoint planted in a run folder that
would run code when unpickled is refused, and the code never runs; a run resumes only from a
checkpoint that holds each of its models; keep_last retention; a checkpoint found by name or
step; a save in the background completes the same checkpoint as one in the foreground."""

import os
import pickle
import random
from pathlib import Path

import pytest
import torch

from tests.trainer_svc.fsdp_worker import (
    SETTINGS,
    checkpoint_tensors,
    fixed_batch,
    token_mean_loss,
    write_checkpoint,
)
from trainer_svc.checkpoint import (
    CheckpointState,
    checkpoint_folders,
    find_checkpoint,
    finish_checkpoint,
    new_staging_folder,
    read_checkpoint_state,
)
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, restore, save_checkpoint_shards
from turnrl.errors import ConfigError


class RunsACommand:
    """Unpickled, it runs `touch <marker>` as whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def empty_checkpoint(run_dir: Path, step: int, tensors: dict, loop_state: dict) -> Path:
    """A checkpoint of `step` without models: its state.pt and state.json only."""
    staging = new_staging_folder(run_dir, step)
    return finish_checkpoint(staging, run_dir, CheckpointState.now(step, tensors, loop_state))


def test_a_checkpoint_round_trips_its_tensors_json_state_and_rng(tmp_path):
    random.seed(7)
    torch.manual_seed(7)
    tensors = {"policy": {"scheduler": {"last_epoch": 3}}, "generator": torch.ones(3)}
    folder = empty_checkpoint(tmp_path, 3, tensors, {"data_position": 12, "pending": [1, 5]})
    assert sorted(p.name for p in folder.iterdir()) == ["state.json", "state.pt"]
    expected = (random.random(), torch.rand(2))
    random.seed(0)
    torch.manual_seed(0)

    state = read_checkpoint_state(find_checkpoint(tmp_path))
    assert state["step"] == 3 and state["data_position"] == 12 and state["pending"] == [1, 5]
    assert state["policy"] == {"scheduler": {"last_epoch": 3}}
    torch.testing.assert_close(state["generator"], torch.ones(3))
    # The RNG states are restored exactly: the same draws as after the save.
    assert random.random() == expected[0]
    torch.testing.assert_close(torch.rand(2), expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_planted_checkpoint_that_would_run_a_command_is_refused(tmp_path, writer):
    marker = tmp_path / "pwned"
    folder = empty_checkpoint(tmp_path / "run", 1, {}, {"data_position": 0})
    planted = {"policy": RunsACommand(marker)}
    if writer == "pickle":
        (folder / "state.pt").write_bytes(pickle.dumps(planted, protocol=2))
    else:
        torch.save(planted, folder / "state.pt")

    with pytest.raises(ConfigError, match=r"step_000001/state\.pt.*not a turnrl checkpoint"):
        read_checkpoint_state(find_checkpoint(tmp_path / "run"))
    assert not marker.exists()


def test_a_checkpoint_whose_shards_are_not_the_runs_models_is_refused(model_dir, tmp_path):
    policy = FsdpPolicy(model_dir, SETTINGS)
    folder = write_checkpoint(Models(policy), tmp_path, 1)
    for shard in (folder / "shards").iterdir():
        shard.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match=r"step_000001 does not hold the run's models"):
        restore(Models(policy), folder)


def test_a_run_with_a_critic_or_a_judge_of_its_own_resumes_only_from_a_checkpoint_with_it(
    model_dir, tmp_path
):
    policy, judge = FsdpPolicy(model_dir, SETTINGS), FsdpPolicy(model_dir, SETTINGS)
    policy_only = write_checkpoint(Models(policy), tmp_path / "policy", 3)
    with pytest.raises(ConfigError, match=r"step_000003 holds no judge model"):
        restore(Models(policy, judge=judge), policy_only)
    with pytest.raises(ConfigError, match=r"step_000003 holds no critic"):
        restore(Models(policy, critic=FsdpCritic(model_dir, SETTINGS)), policy_only)
    assert restore(Models(policy), policy_only)["step"] == 3

    judge.train_step(fixed_batch(), token_mean_loss)
    both = write_checkpoint(Models(policy, judge=judge), tmp_path / "both", 4)
    resumed = Models(FsdpPolicy(model_dir, SETTINGS), judge=FsdpPolicy(model_dir, SETTINGS))
    assert restore(resumed, both)["step"] == 4
    trained, untrained = judge.full_state_dict(), policy.full_state_dict()
    judged, resumed_policy = resumed.judge.full_state_dict(), resumed.policy.full_state_dict()
    assert all(torch.equal(judged[name], tensor) for name, tensor in trained.items())
    assert all(torch.equal(resumed_policy[name], tensor) for name, tensor in untrained.items())
    assert not all(torch.equal(untrained[name], tensor) for name, tensor in trained.items())


def test_keep_last_deletes_all_but_the_newest_checkpoints(tmp_path):
    for step in range(1, 5):
        staging = new_staging_folder(tmp_path, step)
        state = CheckpointState.now(step, {}, {"data_position": step})
        finish_checkpoint(staging, tmp_path, state, keep_last=2)
    assert [f.name for f in checkpoint_folders(tmp_path)] == ["step_000003", "step_000004"]
    # No staging folder is left behind either.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000003",
        "step_000004",
    ]


def test_a_checkpoint_is_found_by_its_name_or_its_step_and_a_missing_one_is_named(tmp_path):
    assert find_checkpoint(tmp_path) is None
    for step in (10, 20):
        empty_checkpoint(tmp_path, step, {}, {"data_position": step})
    assert find_checkpoint(tmp_path).name == "step_000020"
    assert find_checkpoint(tmp_path, "step_000010").name == "step_000010"
    assert find_checkpoint(tmp_path, "10").name == "step_000010"
    with pytest.raises(ConfigError, match=r"no checkpoint '15'; it has \['step_000010', 'step_"):
        find_checkpoint(tmp_path, "15")


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(model_dir, tmp_path):
    policy = FsdpPolicy(model_dir, SETTINGS)
    policy.train_step(fixed_batch(), token_mean_loss)
    at_step_1 = policy.full_state_dict()
    staging = new_staging_folder(tmp_path, 1)
    models = Models(policy)
    plain, writing = save_checkpoint_shards(models, staging, in_background=True)
    policy.train_step(fixed_batch(), token_mean_loss)  # changes the weights as they are written
    writing.result()
    folder = finish_checkpoint(staging, tmp_path, CheckpointState.now(1, plain, {}))

    saved = checkpoint_tensors(folder)
    assert saved and all(torch.equal(saved[name], at_step_1[name]) for name in saved)
    resumed = FsdpPolicy(model_dir, SETTINGS)
    restore(Models(resumed), folder)
    assert all(torch.equal(resumed.full_state_dict()[n], t) for n, t in at_step_1.items())
