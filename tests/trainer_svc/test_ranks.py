"""Trainer ranks started one by one with the env:// variables, as a launcher starts them on
several machines (no torchrun): each rank forwards only its share of a batch and every rank
gets the single process's results; rank 0 serves the trainer service and the others follow it
until it stops."""

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3ForCausalLM, Qwen3ForTokenClassification

from tests.trainer_svc.forward_worker import BATCHES, update_inputs
from tests.trainer_svc.fsdp_worker import SETTINGS, fixed_batch
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models
from turnrl import rpc
from turnrl.config import REPO_ROOT, ClientConfig

from ..conftest import EXAMPLE_CONFIG, free_port

RANKS = 2
TIMEOUT_SECONDS = 120


@contextlib.asynccontextmanager
async def launched_ranks(logs: Path, *args: str) -> AsyncIterator[list]:
    """`python -m ARGS` once per rank, each with the env:// variables a launcher sets (rank 0
    on this machine); yields the processes. Rank 0's stdout is piped, the rest of each rank's
    output goes to logs/rank{r}.log; ranks still running at the end are killed."""
    port = str(free_port())
    ranks = []
    for rank in range(RANKS):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(RANKS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        with (logs / f"rank{rank}.log").open("w") as log:
            stdout = asyncio.subprocess.PIPE if rank == 0 else log
            ranks.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, "-m", *args, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=log
                )
            )
    try:
        yield ranks
    finally:
        for process in ranks:
            if process.returncode is None:
                process.kill()
            await process.wait()


async def exit_codes(ranks: list) -> list[int]:
    async with asyncio.timeout(TIMEOUT_SECONDS):
        return await asyncio.gather(*(process.wait() for process in ranks))


def logs(folder: Path) -> str:
    return "\n".join((folder / f"rank{rank}.log").read_text()[-3000:] for rank in range(RANKS))


def rows_of(rows: list[int]) -> list[tuple[int, ...]]:
    """The tokens of `fixed_batch()`'s `rows`, as the forward's row recorder writes them."""
    batch = fixed_batch()
    lengths = batch.attention_mask.sum(1).tolist()
    return [tuple(batch.input_ids[row, : lengths[row]].tolist()) for row in rows]


def one_process_inputs(model_dirs: list[Path]) -> dict:
    policy_dir, reference_dir, critic_dir = model_dirs
    models = Models(
        policy=FsdpPolicy(policy_dir, SETTINGS),
        reference=FsdpPolicy(reference_dir, SETTINGS),
        critic=FsdpCritic(critic_dir, SETTINGS),
    )
    return {name: update_inputs(models, rows) for name, rows in BATCHES.items()}


async def test_each_rank_forwards_its_share_and_every_rank_gets_the_whole_batch(
    model_dir, tmp_path
):
    # A reference unlike the policy and a critic head that is not zero, so that each gathered
    # tensor has values of its own.
    torch.manual_seed(1)
    Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir)).save_pretrained(tmp_path / "ref")
    critic = Qwen3ForTokenClassification.from_pretrained(model_dir, num_labels=1)
    critic.save_pretrained(tmp_path / "critic")
    model_dirs = [model_dir, tmp_path / "ref", tmp_path / "critic"]
    args = ["tests.trainer_svc.forward_worker", *map(str, model_dirs), str(tmp_path)]
    async with launched_ranks(tmp_path, *args) as ranks:
        assert await exit_codes(ranks) == [0] * RANKS, logs(tmp_path)
    expected = await asyncio.to_thread(one_process_inputs, model_dirs)

    for rank in range(RANKS):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name, rows in BATCHES.items():
            got, want = results[name], expected[name]
            assert got["metrics"] == pytest.approx(want["metrics"], abs=1e-5), name
            assert want["metrics"]["kl_to_reference"] > 1e-3  # the reference differs
            tensors = sorted(set(want) - {"metrics"})
            assert set(got) - {"metrics", "seen"} == set(tensors)
            assert {"old_logprobs", "ref_logprobs", "old_values", "returns"} <= set(tensors)
            for tensor in tensors:  # the whole batch, rows in order
                torch.testing.assert_close(got[tensor], want[tensor], atol=1e-5, rtol=0)
            # Every forward ran this rank's rows only (with none of its own, a filler), some
            # twice where the other rank has more micro-batches (`FsdpModel._micro_batches`).
            share = set(rows_of(rows[rank::RANKS] or rows[:1]))
            seen = got["seen"]
            assert all(set(tokens) == share for tokens in seen.values()), (rank, name)
            if len(rows) > RANKS:  # one pass of the reference's and the critic's
                assert len(seen["reference"]) == len(seen["critic"]) < len(rows)


async def test_a_call_that_fails_on_one_rank_fails_on_every_rank_with_its_error(
    model_dir, tmp_path
):
    # The process group's timeout is 30 minutes: each failure ends its call within seconds.
    out_file = tmp_path / "results.json"
    args = ["tests.trainer_svc.rank_failure_worker", str(model_dir), str(out_file)]
    async with launched_ranks(tmp_path, *args) as ranks:
        assert await exit_codes(ranks) == [0] * RANKS, logs(tmp_path)
    results = json.loads(out_file.read_text())
    on_rank_1, on_rank_0 = results["failing on rank 1"], results["failing on rank 0"]
    assert on_rank_1["error"] == (
        "RankFailedError: trainer rank 1 failed: MemoryError: out of memory on rank 1's share"
    )
    assert on_rank_0["error"] == "MemoryError: out of memory on rank 0's share"
    assert on_rank_1["seconds"] < 30 and on_rank_0["seconds"] < 30
    # Rank 1 logged rank 0's failure as its call's; both went on to a step with new models.
    assert "RankFailedError: trainer rank 0 failed: MemoryError" in logs(tmp_path)
    assert math.isfinite(results["after"]["loss"])


async def test_ranks_started_by_a_launcher_serve_and_follow_until_rank_0_stops(tmp_path):
    args = ["trainer_svc", "--config", str(EXAMPLE_CONFIG), f"trainer.ranks={RANKS}"]
    async with launched_ranks(tmp_path, *args, "trainer.server.port=0") as ranks:
        async with asyncio.timeout(TIMEOUT_SECONDS):
            line = (await ranks[0].stdout.readline()).decode()  # its first line (no metrics)
        assert line.startswith("serving TrainerService on "), logs(tmp_path)
        address = line.split()[-1]
        await rpc.wait_until_serving(ClientConfig(address=address), timeout_seconds=60)
        assert ranks[1].returncode is None  # following
        ranks[0].send_signal(signal.SIGTERM)
        assert await exit_codes(ranks) == [0] * RANKS, logs(tmp_path)


async def test_a_launcher_must_start_as_many_ranks_as_trainer_ranks(tmp_path):
    async with launched_ranks(tmp_path, "trainer_svc", f"trainer.ranks={RANKS + 1}") as ranks:
        assert await exit_codes(ranks) == [2] * RANKS
    assert f"started as one of WORLD_SIZE={RANKS} ranks, but trainer.ranks is {RANKS + 1}" in (
        logs(tmp_path)
    )
