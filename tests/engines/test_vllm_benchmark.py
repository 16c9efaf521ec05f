"""`benchmarks/rollout_async_vs_batch.py --engine vllm` and `benchmarks/weight_push.py --engine
vllm` in their smoke modes: the rollouts on, and the pushes into, a vLLM CPU server launched
from vLLM's own environment ($TURNRL_VLLM_PYTHON), each ending with its headline figures.
(tests/benchmarks/test_smoke.py runs the hf engine's smokes in `make test`.) This file sorts before test_vllm_engine.py, whose
session-wide server starts only there: one server at a time on the two cores."""

import json
import os
import subprocess
import sys

import pytest

from turnrl.config import REPO_ROOT

pytestmark = pytest.mark.engines

BENCHMARKS = REPO_ROOT / "benchmarks"
# The server's start (60-80 s on two cores) and four short trajectories, three times over.
TIMEOUT_SECONDS = 540


def smoke_on_vllm(script: str, vllm_python: str, folder) -> dict:
    """Runs `benchmarks/script --smoke --engine vllm` in `folder`; its headline figures."""
    command = [
        *(sys.executable, str(BENCHMARKS / script), "--smoke"),
        *("--engine", "vllm", "--engine-python", vllm_python),
    ]
    # Without the asyncio debug mode the tests turn on, which the server would inherit.
    env = {**os.environ, "PYTHONASYNCIODEBUG": ""}
    done = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["engine"] == "vllm", headline
    return headline


@pytest.mark.timeout(TIMEOUT_SECONDS + 60)
def test_rollout_benchmark_smoke_on_vllm(vllm_python, tmp_path):
    headline = smoke_on_vllm("rollout_async_vs_batch.py", vllm_python, tmp_path)
    # Greedy: both modes, and the engine driven directly, sample the same tokens.
    assert headline["same_tokens_both_modes"], headline
    assert headline["direct_same_tokens"], headline
    assert headline["model_tokens_per_rollout"] > 0, headline
    assert headline["rollout_tokens_per_s"] > 0 and headline["service_cost"] > 0, headline


@pytest.mark.timeout(TIMEOUT_SECONDS + 60)
def test_weight_push_benchmark_smoke_on_vllm(vllm_python, tmp_path):
    headline = smoke_on_vllm("weight_push.py", vllm_python, tmp_path)
    # Every push reached the server's worker extension: a refused one raises before the JSON.
    assert headline["push_s"] > 0 and headline["prepacked_push_s"] > 0, headline
    assert headline["grpc_gib_s"] > 0, headline
