"""Every script in benchmarks/ runs in its smoke mode (`--smoke`: tiny sizes, seconds) and ends
with its headline figures as one JSON object, so that no benchmark stops running unnoticed."""

import json
import subprocess
import sys

import pytest

from turnrl.config import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
# Each script, and headline keys its last line must hold.
HEADLINE_KEYS = {
    "async_vs_sync": {"speedup_eta4", "efficiency_vs_bound", "push_stall_vs_raw"},
    "dumps": {"writer_cpu_fraction_max", "handoff_ms_max"},
    "gateway": {
        "batch1_ratio",
        "batch1_gateway_ms",
        "batch1_generate_ms",
        "concurrent_throughput_ratio",
        "sessions",
    },
    "lora": {"demo_push_bytes_ratio", "larger_push_bytes_ratio", "larger_peak_memory_ratio"},
    "reward_throughput": {"gsm8k_items_per_s", "math_items_per_s"},
    "rollout_async_vs_batch": {"speedup", "efficiency_vs_bound", "no_tool_wait_seconds"},
    "router_scale": {"even_scaling", "uneven_best_over_wall", "overhead_ms"},
    "soak": {"calculator_calls_per_s", "python_p99_ms", "reward_items_per_s"},
    "tool_rpc": {"calculator_p50_ms", "python_p50_ms"},
    "turn_credit": {
        "accuracy_end_outcome",
        "accuracy_end_turn",
        "steps_to_target_turn",
        "multi_call_rate_start_turn",
        "multi_call_rate_end_turn",
        "chain_share_end_turn",
    },
    "train_throughput": {"tokens_per_s_2rank_fp32", "s_per_step_2rank_fp32"},
    "trainer_memory": {
        "load_peak_ratio_before",
        "load_peak_ratio_after",
        "checkpoint_peak_ratio_rank0_before",
        "checkpoint_peak_ratio_rank0_after",
        "export_peak_ratio_rank0_after",
        "packed_speedup",
        "packed_peak_mib",
        "padded_peak_mib",
    },
    "vs_trl": {"ratio_single_call", "turnrl_single_s_per_step", "trl_single_s_per_step"},
    "weight_push": {"fraction_of_raw", "push_s", "raw_s"},
}
# Seconds on a quiet machine, minutes on a loaded one: async_vs_sync's two `turnrl up` and six
# runs took 90 s at load 4 on the 2 cores.
SMOKE_TIMEOUT_SECONDS = 540


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {
        path.stem
        for path in BENCHMARKS.glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }
    assert scripts == set(HEADLINE_KEYS)


@pytest.mark.timeout(SMOKE_TIMEOUT_SECONDS + 60)
@pytest.mark.parametrize("script", sorted(HEADLINE_KEYS))
def test_smoke_run_ends_with_its_headline_figures(script, tmp_path):
    command = [sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke"]
    # In a folder of its own: whatever a benchmark writes beside it stays out of the checkout.
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_SECONDS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    headline = json.loads(lines[-1])
    assert isinstance(headline, dict), lines[-1]
    assert HEADLINE_KEYS[script] <= set(headline), sorted(headline)
