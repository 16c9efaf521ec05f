"""Trajectory dumps: which trajectories a step writes, what a line holds (a trajectory in parts
included), and the writer that writes them off the loop. The files a run writes are checked in
the runs of test_trainer_service.py and test_async_loop.py."""

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from trainer_svc.dumps import DumpWriter, rollout_records, select_for_dump, trajectory_record
from trainer_svc.rl_step import rollout_batch
from turnrl.messages import openai_tool_call
from turnrl.trajectory import FinishReason, Segment, Trajectory, TurnReward, TurnRewardSource
from turnrl.trajectory import SegmentSource as Source
from turnrl.v1 import common_pb2

# 4 groups of 4: group g's rewards are g, g + 1, g + 2, g + 3 in a shuffled order.
GROUPS = [f"g{index // 4}" for index in range(16)]
REWARDS = [float(index // 4 + (index * 3) % 4) for index in range(16)]


def extremes_of(group: str) -> set[int]:
    members = [i for i, g in enumerate(GROUPS) if g == group]
    return {max(members, key=REWARDS.__getitem__), min(members, key=REWARDS.__getitem__)}


def test_a_dump_holds_the_best_and_worst_of_random_groups_and_a_seeded_sample():
    chosen = select_for_dump(REWARDS, GROUPS, 7, 2, random.Random(5))
    assert len(chosen) == len(set(chosen)) == 7 and chosen == sorted(chosen)
    whole_extremes = [g for g in sorted(set(GROUPS)) if extremes_of(g) <= set(chosen)]
    assert len(whole_extremes) >= 2
    assert chosen == select_for_dump(REWARDS, GROUPS, 7, 2, random.Random(5))
    samples = {tuple(select_for_dump(REWARDS, GROUPS, 7, 2, random.Random(s))) for s in range(20)}
    assert len(samples) > 1  # the groups and the rest are drawn at random


def test_a_dump_smaller_than_its_extremes_keeps_the_first_groups_best_then_worst():
    rng_groups = random.Random(3).sample(sorted(set(GROUPS), key=GROUPS.index), 2)
    chosen = select_for_dump(REWARDS, GROUPS, 3, 2, random.Random(3))
    assert extremes_of(rng_groups[0]) <= set(chosen) and len(chosen) == 3


@pytest.mark.parametrize(("count", "extreme_groups"), [(16, 2), (40, 0), (5, 0), (6, 9)])
def test_a_dump_takes_every_trajectory_it_has_room_for(count, extreme_groups):
    chosen = select_for_dump(REWARDS, GROUPS, count, extreme_groups, random.Random(0))
    assert len(chosen) == len(set(chosen)) == min(count, 16)


def agent_trajectory(reward: float) -> Trajectory:
    """An agent's trajectory in two parts (it rewrote its history), with a tool call answered
    and one the model wrote that could not be parsed."""
    trajectory = Trajectory(
        trajectory_id="a/0",
        group_id="a",
        sample_index=0,
        segments=[
            Segment(Source.PROMPT, [1, 2, 3]),
            Segment(Source.MODEL, [4, 5], [-0.5, -0.25], policy_version=3),
            Segment(Source.TOOL, [6]),
            Segment(Source.PROMPT, [1, 9]),
            Segment(Source.MODEL, [7], [-1.5], policy_version=4),
        ],
        messages=[
            {"role": "user", "content": "2+2?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [openai_tool_call("c1", "calculator", '{"expression": "2+2"}')],
            },
            {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "calculator"},
            {"role": "tool", "content": "Error: no closing tag"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [openai_tool_call("c1", "calculator", '{"expression": "2*3"}')],
            },
            {"role": "tool", "content": "6", "tool_call_id": "c1", "name": "calculator"},
            {"role": "assistant", "content": "4"},
        ],
        finish_reason=FinishReason.STOP,
        metrics={"tool_calls": 2.0},
        reward=common_pb2.Reward(score=reward),
        turn_rewards=[
            TurnReward(0, -0.05, TurnRewardSource.TOOL, "gsm8k_answer"),
            TurnReward(1, 0.5, TurnRewardSource.SCORER, "plugin:per_turn"),
        ],
    )
    trajectory.reward.extras.update({"acc": True})
    return trajectory


def test_a_trained_trajectory_in_parts_is_one_line_with_aligned_per_token_arrays():
    trajectory = agent_trajectory(1.0)
    rollouts = rollout_batch([agent_trajectory(0.0), trajectory], pad_token_id=0)
    # The trainer's logprobs 0.1 above the engine's; advantage 2 on every token.
    extras = rollouts.batch.extras
    extras["old_logprobs"] = extras["rollout_logprobs"] + 0.1 * rollouts.batch.loss_mask
    extras["advantages"] = torch.full_like(extras["rollout_logprobs"], 2.0)
    (record,) = rollout_records(rollouts, [1], step=7, policy_version=5)

    assert record["token_ids"] == trajectory.token_ids
    length = len(trajectory.token_ids)
    for name in ("loss_mask", "rollout_logprobs", "trainer_logprobs"):
        assert len(record[name]) == length, name
    assert record["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert record["trainer_logprobs"][3:5] == pytest.approx([-0.4, -0.15])
    assert record["logprob_mismatch"] == pytest.approx(0.1)
    assert record["advantage"] == pytest.approx(2.0)
    assert record["parts"] == [[0, 6], [6, 9]]
    assert [(s["source"], s["tokens"], s["policy_version"]) for s in record["segments"]] == [
        ("prompt", 3, 0),
        ("model", 2, 3),
        ("tool", 1, 0),
        ("prompt", 2, 0),
        ("model", 1, 4),
    ]
    assert (record["prompt_tokens"], record["response_tokens"], record["total_tokens"]) == (5, 4, 9)
    assert record["policy_versions"] == [3, 4] and record["staleness"] == 2
    assert record["reward"] == 1.0 and record["reward_extras"] == {"acc": True}
    assert record["reward_error"] is None and record["finish_reason"] == "stop"
    assert record["turn_rewards"] == [
        {"turn": 0, "value": -0.05, "source": "tool", "name": "gsm8k_answer"},
        {"turn": 1, "value": 0.5, "source": "scorer", "name": "plugin:per_turn"},
    ]
    assert record["tool_calls"] == [
        {"id": "c1", "name": "calculator", "arguments": '{"expression": "2+2"}', "result": "4"},
        {"error": "Error: no closing tag"},
        # The next turn's call, under the same id.
        {"id": "c1", "name": "calculator", "arguments": '{"expression": "2*3"}', "result": "6"},
    ]
    json.dumps(record)  # a JSON line as it is


def test_an_evaluated_trajectory_has_no_trainer_figures():
    record = trajectory_record(agent_trajectory(0.0), step=0, policy_version=4)
    assert record["trainer_logprobs"] is None and record["logprob_mismatch"] is None
    assert record["advantage"] is None and record["staleness"] == 1


def failing() -> list:
    raise OSError("disk full")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_writer_adds_each_tokens_text_special_tokens_as_themselves(tmp_path, tokenizer):
    text = "2+2? é </script>"
    token_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, return_dict=False
    )
    writer = DumpWriter(tokenizer)
    path = tmp_path / "step_000001.jsonl"
    writer.write(path, lambda: [{"token_ids": token_ids}])
    writer.close()
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    pieces = record["tokens"]
    assert len(pieces) == len(token_ids)
    assert pieces[0] == "<|im_start|>" and "<|im_end|>" in pieces
    # Whole characters read back as the text; "é" is split over two byte tokens.
    assert "".join(pieces).replace("\ufffd\ufffd", "é") == tokenizer.decode(token_ids)
    assert text in "".join(pieces).replace("\ufffd\ufffd", "é")


def test_the_writer_replaces_a_steps_file_and_logs_a_failed_write(tmp_path, caplog, tokenizer):
    writer = DumpWriter(tokenizer)
    path = tmp_path / "rollouts" / "step_000001.jsonl"
    writer.write(path, lambda: [{"token_ids": [1]}, {"token_ids": [2]}])
    writer.write(path, lambda: [{"token_ids": [3]}])  # a resumed run's step again
    writer.write(tmp_path / "eval" / "step_000001.jsonl", failing)
    writer.close()
    assert [json.loads(line)["token_ids"] for line in path.read_text().splitlines()] == [[3]]
    assert [p.name for p in tmp_path.rglob("*.jsonl*")] == ["step_000001.jsonl"]
    assert "disk full" in caplog.text


def test_a_failed_write_fails_the_next_one(tmp_path, tokenizer):
    writer = DumpWriter(tokenizer)
    path = tmp_path / "step_000001.jsonl"
    assert isinstance(writer.write(path, failing).exception(), OSError)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.write(path, lambda: [])
    writer.close()


def test_the_writer_counts_its_cpu_time_once(tmp_path, tokenizer):
    writer = DumpWriter(tokenizer)
    records = [{"token_ids": list(range(600)), "n": n} for n in range(20)]
    writer.write(tmp_path / "step_000001.jsonl", lambda: records).result()
    spent = writer.take_cpu_seconds()
    assert spent > 0
    assert writer.take_cpu_seconds() == 0.0
    writer.close()
