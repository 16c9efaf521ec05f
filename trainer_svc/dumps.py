"""Trajectory dumps: what the agent did, as JSON lines in the run folder. Each RL step writes a
sample of its trajectories to rollouts/step_<N>.jsonl (`select_for_dump`; `trainer.dumps`), each
held-out evaluation all of its generations to eval/step_<N>.jsonl, one `trajectory_record` a line,
with `tokens`: each token id decoded alone, as the model saw it (special tokens as themselves), so
that a report (`turnrl report`, `turnrl show`) needs no tokenizer.

The loop hands `DumpWriter` the trajectories and the tensors the step computed anyway; the
writer's thread decodes the tokens, turns them into JSON and writes, so a step never waits on the
tokenizer or the disk. A step's
file is written whole (a temporary file renamed): a resumed run that takes a step again replaces
the file the killed run left of it and keeps the earlier steps' files.
"""

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from torch import Tensor

from trainer_svc.rl_step import RolloutBatch
from turnrl.trajectory import Trajectory

logger = logging.getLogger(__name__)
ROLLOUTS_FOLDER = "rollouts"
EVAL_FOLDER = "eval"


def dump_path(run_dir: Path, folder: str, step: int) -> Path:
    """The dump file of `step` in `folder` (ROLLOUTS_FOLDER or EVAL_FOLDER) of the run."""
    return run_dir / folder / f"step_{step:06d}.jsonl"


def select_for_dump(
    rewards: list[float], group_ids: list[str], count: int, extreme_groups: int, rng: random.Random
) -> list[int]:
    """The indices, ascending, of `count` of the trajectories (all of them when there are no
    more): the best and the worst of `extreme_groups` groups picked at random (first best, then
    worst, group by group, as far as `count` goes), then a random sample of the others."""
    if count >= len(rewards):
        return list(range(len(rewards)))
    members: dict[str, list[int]] = {}
    for index, group_id in enumerate(group_ids):
        members.setdefault(group_id, []).append(index)
    extremes: dict[int, None] = {}  # ordered, without repeats: a group of one is its own best
    for group_id in rng.sample(list(members), min(extreme_groups, len(members))):
        indices = members[group_id]
        extremes[max(indices, key=rewards.__getitem__)] = None
        extremes[min(indices, key=rewards.__getitem__)] = None
    chosen = list(extremes)[:count]
    others = [index for index in range(len(rewards)) if index not in chosen]
    return sorted(chosen + rng.sample(others, count - len(chosen)))


def rollout_records(
    rollouts: RolloutBatch, chosen: list[int], step: int, policy_version: int
) -> list[dict[str, Any]]:
    """The records of the trajectories `chosen` (indices) of a trained step's batch, with the
    trainer's logprobs and advantages that `prepare_update` added to its extras."""
    extras = rollouts.batch.extras
    records = []
    for index in chosen:
        trajectory = rollouts.trajectories[index]
        rows = (rollouts.sequence_index == index).nonzero().flatten().tolist()
        records.append(
            trajectory_record(
                trajectory,
                step,
                policy_version,
                trainer_logprobs=_per_token(extras["old_logprobs"], rows, trajectory.parts),
                advantages=_per_token(extras["advantages"], rows, trajectory.parts),
            )
        )
    return records


def _per_token(tensor: Tensor, rows: list[int], parts: list[tuple[int, int]]) -> list[float]:
    """A trajectory's values of a per-token batch tensor: its parts' rows, unpadded, joined."""
    return [
        value
        for row, (start, end) in zip(rows, parts, strict=True)
        for value in tensor[row, : end - start].tolist()
    ]


def trajectory_record(
    trajectory: Trajectory,
    step: int,
    policy_version: int,
    trainer_logprobs: list[float] | None = None,
    advantages: list[float] | None = None,
) -> dict[str, Any]:
    """One dump line. Per-token arrays (token_ids, loss_mask, rollout_logprobs, trainer_logprobs)
    are equally long; `segments` splits them into runs of one source (each model segment's
    policy version: the one that sampled it); `policy_version` is the trainer's, the one
    staleness is counted from.
    Without the trainer's logprobs (an evaluation) trainer_logprobs, logprob_mismatch and
    advantage are null."""
    loss_mask = trajectory.loss_mask
    rollout_logprobs = trajectory.rollout_logprobs
    versions = trajectory.policy_versions
    reward = trajectory.reward
    model_tokens = max(sum(loss_mask), 1)
    mismatch = advantage = None
    if trainer_logprobs is not None:
        gaps = zip(rollout_logprobs, trainer_logprobs, loss_mask, strict=True)
        mismatch = sum(abs(r - t) for r, t, trained in gaps if trained) / model_tokens
    if advantages is not None:
        trained = zip(advantages, loss_mask, strict=True)
        advantage = sum(a for a, in_loss in trained if in_loss) / model_tokens
    return {
        "step": step,
        "trajectory_id": trajectory.trajectory_id,
        "group_id": trajectory.group_id,
        "sample_index": trajectory.sample_index,
        "data_source": trajectory.data_source,
        "finish_reason": trajectory.finish_reason.name.lower(),
        "error_message": trajectory.error_message,
        "reward": reward.score if reward is not None else None,
        "reward_extras": json_format.MessageToDict(reward.extras) if reward is not None else {},
        "reward_error": reward.error_message if reward is not None and reward.error else None,
        "turn_rewards": [
            {"turn": r.turn, "value": r.value, "source": r.source.name.lower(), "name": r.name}
            for r in trajectory.turn_rewards
        ],
        "messages": trajectory.messages,
        "images": [vars(image) for image in trajectory.images],
        "tool_calls": tool_calls(trajectory.messages),
        "turns": [vars(turn) for turn in trajectory.turns],
        "metrics": trajectory.metrics,
        "prompt_tokens": trajectory.prompt_length,
        "response_tokens": trajectory.response_length,
        "total_tokens": len(loss_mask),
        "parts": [list(part) for part in trajectory.parts],
        "segments": [
            {
                "source": segment.source.name.lower(),
                "tokens": len(segment.token_ids),
                "policy_version": segment.policy_version,
            }
            for segment in trajectory.segments
        ],
        "token_ids": trajectory.token_ids,
        "loss_mask": [int(flag) for flag in loss_mask],
        "rollout_logprobs": rollout_logprobs,
        "trainer_logprobs": trainer_logprobs,
        "logprob_mismatch": mismatch,
        "advantage": advantage,
        "policy_versions": versions,
        "trainer_policy_version": policy_version,
        "staleness": policy_version - min(versions) if versions else None,
    }


def tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool call of the assistant's messages, in order, with the result of the tool message
    after it that answers its id (ids repeat from turn to turn: "call_0" each time); a call the
    model wrote that could not be parsed is its error message alone."""
    calls: list[dict[str, Any]] = []
    answering: dict[str, dict[str, Any]] = {}  # the last assistant message's calls, by id
    for message in messages:
        if message["role"] == "assistant":
            answering = {}
            for call in message.get("tool_calls", []):
                function = call["function"]
                entry = {
                    "id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                    "result": None,
                }
                answering[call["id"]] = entry
                calls.append(entry)
        elif message["role"] == "tool" and message.get("tool_call_id") in answering:
            answering[message["tool_call_id"]]["result"] = message["content"]
        elif message["role"] == "tool":
            calls.append({"error": message["content"]})
    return calls


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's text, decoded alone: a piece of a character split over tokens shows as the
    replacement character."""
    return tokenizer.batch_decode([[token_id] for token_id in token_ids])


class DumpWriter:
    """Writes dump files on a thread of its own, in the order they are handed over, adding each
    record's `tokens` (`token_pieces` of its token_ids) decoded with `tokenizer`. A write that
    failed fails the next `write` (the run stops naming it); `close` waits for the rest.
    The thread's CPU time is counted (`take_cpu_seconds`): encoding and decoding hold the GIL,
    so it bounds what the writing can take from the loop's thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumps")
        self._pending: list[Future] = []
        self._cpu_lock = threading.Lock()
        self._cpu_seconds = 0.0

    def write(self, path: Path, records: Callable[[], list[dict[str, Any]]]) -> Future:
        """Writes the lines `records()` gives to `path`, replacing it, on the writer's thread;
        the write's future."""
        for done in [future for future in self._pending if future.done()]:
            if (error := done.exception()) is not None:
                raise RuntimeError(f"writing a trajectory dump failed: {error!r}") from error
            self._pending.remove(done)
        written = self._thread.submit(self._write_lines, path, records)
        self._pending.append(written)
        return written

    def take_cpu_seconds(self) -> float:
        """The writer thread's CPU seconds since the last call."""
        with self._cpu_lock:
            seconds, self._cpu_seconds = self._cpu_seconds, 0.0
        return seconds

    def close(self) -> None:
        """Waits for every write handed over (blocking: call it from a thread)."""
        self._thread.shutdown(wait=True)
        for future in self._pending:
            if (error := future.exception()) is not None:
                logger.error("writing a trajectory dump failed: %r", error)

    def _write_lines(self, path: Path, records: Callable[[], list[dict[str, Any]]]) -> None:
        started = time.thread_time()
        try:
            lines = [
                json.dumps({**record, "tokens": token_pieces(self._tokenizer, record["token_ids"])})
                + "\n"
                for record in records()
            ]
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text("".join(lines))
            partial.replace(path)
        finally:
            seconds = time.thread_time() - started
            with self._cpu_lock:
                self._cpu_seconds += seconds
        logger.debug("%s: %d trajectories in %.3f s of CPU", path, len(lines), seconds)
