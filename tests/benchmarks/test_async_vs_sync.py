"""`benchmarks/async_vs_sync.py`'s `turnrl up`: its torch threads reach the services, and the
services stop however the benchmark ends."""

import argparse
from pathlib import Path

import pytest
from async_vs_sync import project_config, services

from turnrl_cli.up_table import up_rows

from ..conftest import pid_alive

# These start the rollout service on the demo's tiny model.
pytestmark = pytest.mark.usefixtures("tiny_model_dir")


def environment(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")


async def test_services_get_the_threads_and_stop_when_the_benchmark_fails(tmp_path):
    args = argparse.Namespace(
        task="demo", max_batch_size=8, steps=1, eval_prompts=4, prompts=2, samples=2
    )
    project = project_config(args, tmp_path / "runs", delayed=True)
    pids = []
    with pytest.raises(RuntimeError, match="a run failed"):
        async with services(project, tmp_path, threads=3) as rows:
            assert set(rows) == {"tool", "reward", "rollout", "trainer"}
            pids = [row.pid for row in rows.values()]
            for pid in pids:
                assert "OMP_NUM_THREADS=3" in environment(pid)
            raise RuntimeError("a run failed")
    assert not any(pid_alive(pid) for pid in pids)


def test_up_rows_reads_each_service_of_the_table():
    table = (
        "┃ service ┃ address         ┃ where    ┃\n"
        "│ tool    │ 127.0.0.1:40001 │ pid 4242 │\n"
        "│ rollout#1 │ 127.0.0.1:40002 │ pid 4243 │\n"
        "4 services SERVING; Ctrl-C stops them\n"
    )
    rows = up_rows(table)
    assert {name: (row.address, row.pid) for name, row in rows.items()} == {
        "tool": ("127.0.0.1:40001", 4242),
        "rollout#1": ("127.0.0.1:40002", 4243),
    }
