"""`trainer.push_to_hub`: runs through the TrainerService RPCs (an in-process server) on the
tiny model, SFT and an RL run with a real rollout service, uploading to a local server that
speaks the Hub's upload API (hub_server.py): the final model byte for byte, the models of every
n steps, a Hub that refuses, bad settings."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from trainer_svc.config import PushToHubSettings
from trainer_svc.hub import HubPublisher
from turnrl.errors import InvalidArgumentError
from turnrl.v1 import trainer_pb2

from ..conftest import serve_subprocess
from .fsdp_worker import checkpoint_tensors
from .hub_server import HubServer
from .runs import follow, run_config
from .test_rollout_router import rollout_settings
from .test_sft import run_to_end, sft_config_yaml, trainer_stub

State = trainer_pb2.Run.State
TOKEN_ENV = "TURNRL_TEST_HUB_TOKEN"


@pytest.fixture
def hub(monkeypatch):
    """A local Hub whose token the trainer service finds in TOKEN_ENV."""
    monkeypatch.setenv(TOKEN_ENV, "hf_test_token")
    server = HubServer(token="hf_test_token")
    server.start()
    yield server
    server.stop()


def push_to_hub(hub: HubServer, **settings) -> dict:
    return {"repo_id": "turnrl/tiny", "token_env": TOKEN_ENV, "endpoint": hub.url, **settings}


def files_under(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


async def test_a_run_uploads_the_model_of_every_n_steps_and_its_final_model(
    hub, tiny_model_dir, tmp_path
):
    config = sft_config_yaml(
        tmp_path,
        run_name="pushed",
        steps=4,
        eval_every=0,
        checkpoint={"every": 2},
        push_to_hub=push_to_hub(hub, every_n_steps=2),
    )
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, events = await run_to_end(stub, config)
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    run_dir = Path(run.output_dir)

    repo = hub.repos["turnrl/tiny"]
    assert repo.private  # the default
    # Step 2's model, then the final one (step 4's, uploaded once, as the final model).
    assert [c.message for c in repo.commits] == [
        "turnrl run pushed: step 2",
        "turnrl run pushed: final model, step 4",
    ]
    step_2, final = repo.commits
    assert final.files == files_under(run_dir / "final_model")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(final.files)
    # Step 2's upload holds step 2's weights, those of its checkpoint.
    assert set(step_2.files) == set(final.files)
    checkpoint = checkpoint_tensors(run_dir / "checkpoints" / "step_000002")
    uploaded = load(step_2.files["model.safetensors"])
    assert uploaded.keys() == checkpoint.keys()
    for name, tensor in uploaded.items():
        torch.testing.assert_close(tensor, checkpoint[name], rtol=0, atol=0)
    final_weights = load(final.files["model.safetensors"])
    assert uploaded["model.norm.weight"].ne(final_weights["model.norm.weight"]).any()
    # The step's export was a temporary folder, gone once uploaded.
    assert not [name for name in os.listdir(run_dir) if name.startswith(".upload-")]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hub"] == {
        "repo_id": "turnrl/tiny",
        "revision": "main",
        "commit_url": f"{hub.url}/turnrl/tiny/commit/{final.oid}",
        "commit_oid": final.oid,
        "uploads": 2,
        "skipped_uploads": 0,
        "failed_uploads": [],
        "final_upload_error": None,
    }
    uploads = [e for e in events if e.stage == "upload"]
    assert [e.metrics["hub/uploads"] for e in uploads] == [1, 2]
    assert uploads[0].message.startswith("step 2 uploaded: ")
    done = next(e for e in events if e.stage == "done")
    assert done.message.endswith(f"uploaded to {summary['hub']['commit_url']}")


async def test_an_rl_run_through_the_services_uploads_its_models(hub, tiny_model_dir, tmp_path):
    async with (
        rollout_settings(tiny_model_dir) as settings,
        serve_subprocess("rollout", *settings) as rollout,
        trainer_stub(tmp_path, str(tiny_model_dir)) as stub,
    ):
        config = run_config(
            {"rollout": rollout.address}, tmp_path, run_name="rl", eval_every=0,
            checkpoint={"every": 0}, loggers=[], push_to_hub=push_to_hub(hub, every_n_steps=1),
            # Smaller than SMALL_RUN: one prompt of 2 samples a step, 2 held-out prompts.
            data={"generated_train_size": 8, "generated_eval_size": 2},
            rollout={"prompts_per_step": 1, "samples_per_prompt": 2, "max_turns": 2},
        )  # fmt: skip
        await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=60)
        events = await follow(stub, "rl")
        run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name="rl"), timeout=10)).run
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    uploads = [e.message for e in events if e.stage == "upload"]
    assert len(uploads) == 2 and uploads[0].startswith("step 1 uploaded: ")
    commits = hub.repos["turnrl/tiny"].commits
    assert [c.message for c in commits] == [
        "turnrl run rl: step 1",
        "turnrl run rl: final model, step 2",
    ]
    assert commits[-1].files == files_under(Path(run.output_dir) / "final_model")


async def test_a_run_uploads_to_a_branch_of_a_public_repo_with_its_checkpoints(
    hub, tiny_model_dir, tmp_path
):
    settings = push_to_hub(hub, private=False, revision="sft", include_checkpoints=True)
    config = sft_config_yaml(tmp_path, run_name="branch", steps=1, push_to_hub=settings)
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, _ = await run_to_end(stub, config)
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    run_dir = Path(run.output_dir)
    repo = hub.repos["turnrl/tiny"]
    assert not repo.private and repo.branches == {"main", "sft"}
    assert [c.branch for c in repo.commits] == ["sft", "sft"]  # the model, then checkpoints/
    assert repo.tree("main") == {}
    checkpoints = {
        f"checkpoints/{path}": content
        for path, content in files_under(run_dir / "checkpoints").items()
    }
    assert repo.tree("sft") == {**files_under(run_dir / "final_model"), **checkpoints}
    assert "checkpoints/step_000001/state.pt" in checkpoints


async def test_a_hub_refusing_the_commits_fails_the_run_and_leaves_its_files(
    hub, tiny_model_dir, tmp_path
):
    hub.reject_commits = True
    config = sft_config_yaml(
        tmp_path, run_name="refused", steps=2, push_to_hub=push_to_hub(hub, every_n_steps=1)
    )
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, events = await run_to_end(stub, config)
    assert run.state == State.STATE_FAILED
    run_dir = Path(run.output_dir)
    assert "the final model was not uploaded to 'turnrl/tiny'" in run.error_message
    assert "403 Forbidden" in run.error_message
    assert f"it is in {run_dir / 'final_model'}" in run.error_message
    assert hub.repos["turnrl/tiny"].commits == []
    # Trained to its end, the model written where it belongs.
    assert (run_dir / "final_model" / "model.safetensors").stat().st_size > 0
    assert [e.step for e in events if e.stage == "train"] == [1, 2]
    failed = [e for e in events if e.stage == "upload"]
    assert [e.metrics["hub/failed_uploads"] for e in failed] == [1, 2]
    assert "step 1: HfHubHTTPError: 403 Forbidden" in failed[0].message
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hub"]["commit_url"] is None
    assert summary["hub"]["final_upload_error"].startswith("step 2: HfHubHTTPError: 403")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["hub/failed_uploads"] for r in logged if "hub/failed_uploads" in r] == [1, 2]


async def test_a_rejected_token_fails_the_run_before_its_first_step(hub, tiny_model_dir, tmp_path):
    hub.token = "another token"
    config = sft_config_yaml(tmp_path, run_name="rejected", push_to_hub=push_to_hub(hub))
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, events = await run_to_end(stub, config)
    assert run.state == State.STATE_FAILED
    assert "cannot create or reach repo 'turnrl/tiny'" in run.error_message
    assert "401 Unauthorized" in run.error_message
    assert not [e for e in events if e.stage == "train"] and hub.repos == {}


async def test_a_due_upload_is_skipped_while_the_previous_one_runs(hub, tiny_model_dir, tmp_path):
    reports = []
    settings = PushToHubSettings(**push_to_hub(hub, every_n_steps=2))
    publisher = HubPublisher(settings, "slow", lambda metrics, message: reports.append(message))
    await publisher.open_repo()
    hub.hold_commits = threading.Event()
    assert not publisher.ready_for(1)  # not due
    assert publisher.ready_for(2)
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / "model.txt").write_text("step 2")
    publisher.start_step_upload(2, folder)
    assert not publisher.ready_for(4)  # step 2's commit is held
    assert publisher.skipped == 1
    assert reports == ["upload of step 4 skipped: the previous upload is still running"]
    hub.hold_commits.set()
    final = tmp_path / "final_model"
    final.mkdir()
    (final / "model.txt").write_text("step 5")
    summary = await publisher.finish(5, final, tmp_path / "checkpoints")
    assert (summary["uploads"], summary["skipped_uploads"]) == (2, 1)
    assert [c.files for c in hub.repos["turnrl/tiny"].commits] == [
        {"model.txt": b"step 2"},
        {"model.txt": b"step 5"},
    ]
    assert not folder.exists()  # removed once uploaded


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"repo_id": "tiny"}, "repo_id 'tiny' is not 'owner/name'"),
        ({"repo_id": "turnrl/tiny/extra"}, "is not 'owner/name'"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"privat": False}, "privat"),
        ({"token_env": "TURNRL_TEST_NO_SUCH_TOKEN"}, "'TURNRL_TEST_NO_SUCH_TOKEN' is unset"),
    ],
)
async def test_bad_settings_are_refused_at_start_run(hub, tmp_path, settings, message):
    config = sft_config_yaml(tmp_path, run_name="bad", push_to_hub=push_to_hub(hub, **settings))
    async with trainer_stub(tmp_path, "unused-model") as stub:
        with pytest.raises(InvalidArgumentError) as info:
            await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=30)
    assert message in info.value.details
    assert not (tmp_path / "bad").exists()
