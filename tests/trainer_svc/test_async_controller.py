"""The async loop's bookkeeping, without services: a failure in a producer task stops the run
with its error, and a checkpoint and the prompt ledger agree on every prompt group, however a
group's return interleaves with the checkpoint. The loop end to end is test_async_loop.py."""

import asyncio

import pytest
import torch

from trainer_svc.async_controller import AsyncController
from trainer_svc.checkpoint import find_checkpoint, read_checkpoint_state
from trainer_svc.config import DataConfig, TrainerConfig, WeightSyncConfig
from trainer_svc.data import EpochSampler, PromptRecord, load_datasets
from trainer_svc.ledger import PromptLedger, prompt_key
from trainer_svc.ranks import Ranks
from trainer_svc.replay_buffer import Group
from trainer_svc.rl_step import rl_models
from trainer_svc.served_model import ServedModel
from turnrl.config import ClientConfig
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory
from turnrl.v1 import common_pb2


def async_controller(tmp_path, records: list[PromptRecord], **trainer) -> AsyncController:
    """An async loop on `records` as `run` sets it up, up to its models and services."""
    config = TrainerConfig.model_validate(
        {"loop": "async", "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2}, **trainer}
    )
    controller = AsyncController(config, tmp_path, lambda event: None, Ranks())
    controller.sampler = EpochSampler(records, config.seed, shuffle=False)
    controller.ledger = PromptLedger(tmp_path)
    return controller


def scored(group: Group, scores: list[float]) -> list[Trajectory]:
    """A finished trajectory of `group` per score, each with one model token."""
    return [
        Trajectory(
            trajectory_id=f"{group.key}/{index}",
            group_id=group.key,
            sample_index=index,
            segments=[
                Segment(SegmentSource.PROMPT, [1, 2]),
                Segment(SegmentSource.MODEL, [3], [-0.5]),
            ],
            finish_reason=FinishReason.STOP,
            metrics={"model_tokens": 1.0},
            reward=common_pb2.Reward(score=score),
        )
        for index, score in enumerate(scores)
    ]


async def test_a_prompt_group_whose_request_cannot_be_built_stops_the_run_naming_why(tmp_path):
    # Loading refuses such a row (test_data.py); one that slips past fails the group's task.
    bad = PromptRecord("p0", [{"role": "developer", "content": "hi"}], "openai/gsm8k", "1")
    controller = async_controller(tmp_path, [bad])
    controller.served_policy = ServedModel(
        "policy", controller.ranks, ClientConfig(address="127.0.0.1:1"), WeightSyncConfig(), "-"
    )  # never called: the group fails before its Generate call
    try:
        async with asyncio.timeout(30):  # it waited for the group forever
            with pytest.raises(RuntimeError, match=r"prompt group 0:p0.*unknown role 'developer'"):
                await controller._rollout()
    finally:
        controller._producer.cancel()


@pytest.mark.parametrize("returns", ["while the models' state is gathered", "after the write"])
async def test_a_checkpoint_and_the_ledger_settle_a_filtered_group_once(
    tmp_path, model_dir, returns
):
    """A group comes back filtered (dynamic sampling) during step 1, while or after step 1's
    checkpoint is written; a run resumed from that checkpoint, its ledger rewound to step 1,
    must count the group either settled or pending, never both (it would be rolled out, and
    trained, again) and never neither (it would be lost)."""
    records, _ = load_datasets(DataConfig(generated_train_size=4), seed=0)
    controller = async_controller(tmp_path, records, algorithm={"dynamic_sampling": True})
    await controller.ranks.build(rl_models, controller.config, str(model_dir))
    controller.generator = torch.Generator().manual_seed(0)
    controller.step = 1
    [position] = controller.sampler.next_positions(1)
    group = Group(position, controller.sampler.record_at(position))
    controller._in_flight[position] = asyncio.get_running_loop().create_future()  # its call

    def comes_back_filtered() -> None:  # as _roll_out does when the call ends
        group.trajectories = scored(group, [1.0, 1.0])
        del controller._in_flight[position]
        controller._admit(group)

    checkpoint = asyncio.create_task(controller._checkpoint())
    if returns == "after the write":
        await checkpoint
        comes_back_filtered()
    else:
        await asyncio.sleep(0)  # the checkpoint task runs to its first await
        comes_back_filtered()
        await checkpoint

    state = read_checkpoint_state(find_checkpoint(tmp_path))
    assert state["step"] == 1
    ledger = PromptLedger(tmp_path)
    ledger.rewind(state["step"])
    settled = [key for keys in ledger.settled().values() for key in keys]
    pending = [prompt_key(p, records[p].prompt_id) for p in state["pending_positions"]]
    assert (settled + pending).count(group.key) == 1, (settled, pending)
