"""Runs a test's worker script on two CPU ranks with torchrun, as the trainer service's ranks
run, and fails the test with the workers' output when they do not exit cleanly."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from turnrl.config import REPO_ROOT


def run_on_two_ranks(worker: Path, *args: object, timeout_seconds: float) -> None:
    """`torchrun --standalone --nproc-per-node 2 worker args...`, in a process group of its own
    that is killed whole if it outlives `timeout_seconds`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(worker), *map(str, args),
    ]  # fmt: skip
    # Workers import the tests' helpers from the checkout, which is not installed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, env=env, start_new_session=True, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_seconds)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output
