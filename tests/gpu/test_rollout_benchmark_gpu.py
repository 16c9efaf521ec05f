"""The rollout benchmark on a GPU engine: request-level rollout on a real SGLang server reaches
0.85 of its ideal bound (`benchmarks/rollout_async_vs_batch.py --engine sglang`; its figures go
to BENCHMARKS.md)."""

import json
import subprocess
import sys

import pytest

from turnrl.config import REPO_ROOT

pytestmark = pytest.mark.gpu

EFFICIENCY_TARGET = 0.85


def test_request_level_rollout_on_sglang_nears_its_bound(cuda):
    command = [sys.executable, "benchmarks/rollout_async_vs_batch.py", "--engine", "sglang"]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, check=False
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    print(finished.stdout)
    figures = json.loads(finished.stdout.strip().splitlines()[-1])
    # Not asserted: the same tokens in both modes. SGLang's bf16 kernels differ with the batch
    # a request shares, so greedy tokens may part ways; the tool-call counts say how much.
    assert figures["efficiency_vs_bound"] >= EFFICIENCY_TARGET, figures
