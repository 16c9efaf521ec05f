"""scripts/gpu_check.sh where no CUDA device is visible (this test hides any): every GPU check
is named in the report as failed for that reason, within seconds, and the script exits
non-zero. Not marked `gpu`: `make test` runs it, so the script's no-GPU path keeps working
on machines without one."""

import os
import subprocess
import sys
import time

from turnrl.config import REPO_ROOT

CHECKS = (
    "engine-free GPU tests",
    "SGLang GPU tests",
    "SGLang rollout benchmark",
    "vLLM GPU tests",
    "vLLM rollout benchmark",
)


def test_without_cuda_every_check_fails_by_name_in_seconds(tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "",
        "TURNRL_PYTHON": sys.executable,
    }
    started = time.monotonic()
    finished = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    seconds = time.monotonic() - started
    assert finished.returncode == 1, finished.stdout + finished.stderr
    report = (tmp_path / "gpu_report.md").read_text()
    checks = [line for line in report.splitlines() if line.startswith("- ")]
    assert checks == [f"- {check}: failed: no CUDA device" for check in CHECKS], report
    assert seconds < 60, seconds
