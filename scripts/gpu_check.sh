#!/usr/bin/env bash
# Every GPU check in one run of at most 10 minutes, with one report: the GPU tests that need no
# engine (FSDP on CUDA, packed micro-batches), then for SGLang and for vLLM, where its interpreter imports it, that
# engine's GPU tests and the rollout benchmark on it (`--smoke`). `make test-gpu` runs it here;
# on the lent GPU machine, from the repository root:
#
#   bash scripts/gpu_check.sh     # with .whl/ carried (scripts/gpu_wheels.sh), installed first
#
# Interpreters: TURNRL_PYTHON runs turnrl and its tests, TURNRL_SGLANG_PYTHON and
# TURNRL_VLLM_PYTHON launch the engines' servers; each defaults to python3. Wheels in .whl/
# are installed for TURNRL_PYTHON into a folder of their own, put on PYTHONPATH.
#
# The report is $OUT/gpu_report.md ($OUT: the device tool's output folder), else gpu_report.md
# here; every check's whole log goes beside it (gpu_report.log). A check's line reads passed,
# failed (its log's tail follows the list) or missing (its engine does not import). Exit
# status: 1 when a check failed, 0 otherwise; a missing engine is named, not a failure, since
# the lent machine can hold neither engine. Not run: tests/gpu/test_rollout_benchmark_gpu.py,
# the full-size benchmark, alone longer than 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${TURNRL_PYTHON:-python3}"
declare -A ENGINE_PYTHON=(
  [sglang]="${TURNRL_SGLANG_PYTHON:-python3}" [vllm]="${TURNRL_VLLM_PYTHON:-python3}"
)
declare -A ENGINE_NAME=([sglang]=SGLang [vllm]=vLLM)
TOTAL_SECONDS=570 # the checks' share of 10 minutes; the rest sets up and writes the report
MIN_CHECK_SECONDS=20
TAIL_LINES=40

report="${OUT:-$PWD}/gpu_report.md"
full_log="${report%.md}.log"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: >"$full_log"
lines=() details=() failures=0

# record NAME STATUS [LOG]: one line of the report; a failure's log tail goes below the list.
record() {
  lines+=("- $1: $2")
  if [[ "$2" == failed* ]]; then
    failures=$((failures + 1))
    if [ -n "${3:-}" ]; then
      details+=("### $1" '```' "$(tail -n "$TAIL_LINES" "$3")" '```')
    fi
  fi
}

# run_check NAME BUDGET_SECONDS COMMAND...: runs COMMAND under `timeout`, within what is left
# of TOTAL_SECONDS, its output appended to the full log.
run_check() {
  local name="$1" budget="$2" left limit log="$work/check.log" rc began
  shift 2
  left=$((TOTAL_SECONDS - SECONDS))
  limit=$((budget < left ? budget : left))
  if [ "$limit" -lt "$MIN_CHECK_SECONDS" ]; then
    record "$name" "failed: not started, ${left} s of the ${TOTAL_SECONDS} s budget left"
    return
  fi
  began=$SECONDS
  timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1
  rc=$?
  { echo "===== $name: $* (exit $rc)"; cat "$log"; } >>"$full_log"
  if [ "$rc" -eq 0 ]; then
    record "$name" "passed in $((SECONDS - began)) s ($(tail -n 1 "$log" | cut -c1-300))"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    record "$name" "failed: timed out after ${limit} s" "$log"
  else
    record "$name" "failed (exit $rc after $((SECONDS - began)) s)" "$log"
  fi
}

# Why `engine` cannot run here, or nothing: its interpreter does not import it.
engine_missing() {
  local engine="$1" python="${ENGINE_PYTHON[$1]}" log="$work/import.log"
  if ! timeout 300 "$python" -c "import $engine" >"$log" 2>&1; then
    echo "${python} cannot import ${engine} ($(tail -n 1 "$log"))"
  fi
}

# Every check, failed for one reason (setup broke, or there is no GPU).
fail_all() {
  record "engine-free GPU tests" "failed: $1" "${2:-}"
  for engine in sglang vllm; do
    record "${ENGINE_NAME[$engine]} GPU tests" "failed: $1"
    record "${ENGINE_NAME[$engine]} rollout benchmark" "failed: $1"
  done
}

run_all() {
  local probe="$work/probe.log" site="${TMPDIR:-/tmp}/turnrl-gpu-site" engine python reason
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' \
    >"$probe" 2>&1
  case $? in
    0) ;;
    3) fail_all "no CUDA device"; return ;;
    *) fail_all "${PYTHON} cannot import torch" "$probe"; return ;;
  esac
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if compgen -G ".whl/*.whl" >/dev/null; then
    rm -rf "$site"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" .whl/*.whl >"$probe" 2>&1; then
      fail_all "the wheels in .whl/ did not install" "$probe"
      return
    fi
    export PYTHONPATH="$site:$PYTHONPATH"
  fi
  if ! "$PYTHON" -c 'import pytest_asyncio, tests.conftest, tests.gpu.conftest' >"$probe" 2>&1; then
    fail_all "turnrl or its tests do not import (scripts/gpu_wheels.sh lists what to carry)" \
      "$probe"
    return
  fi
  run_check "engine-free GPU tests" 180 "$PYTHON" -m pytest -m gpu tests/gpu/test_fsdp_gpu.py \
    tests/gpu/test_packed_gpu.py
  for engine in sglang vllm; do
    python="${ENGINE_PYTHON[$engine]}"
    reason="$(engine_missing "$engine")"
    if [ -n "$reason" ]; then
      record "${ENGINE_NAME[$engine]} GPU tests" "missing: $reason"
      record "${ENGINE_NAME[$engine]} rollout benchmark" "missing: $reason"
      continue
    fi
    # -k: the engine's module, and its case of the tests every engine runs.
    run_check "${ENGINE_NAME[$engine]} GPU tests" 240 \
      env "TURNRL_${engine^^}_PYTHON=$python" "$PYTHON" -m pytest -m gpu -k "$engine" \
      "tests/gpu/test_${engine}_gpu.py" tests/gpu/test_weight_push_gpu.py
    run_check "${ENGINE_NAME[$engine]} rollout benchmark" 150 \
      "$PYTHON" benchmarks/rollout_async_vs_batch.py --smoke --engine "$engine" \
      --engine-python "$python"
  done
}

run_all
machine="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null \
  | paste -sd ';' -)"
{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS} s"
  echo
  echo "GPUs: ${machine:-none found by nvidia-smi}; turnrl's python: ${PYTHON};" \
    "sglang's: ${ENGINE_PYTHON[sglang]}; vllm's: ${ENGINE_PYTHON[vllm]}."
  echo
  printf '%s\n' "${lines[@]}"
  echo
  echo "${failures} of ${#lines[@]} checks failed; every check's log: $(basename "$full_log")."
  if [ "${#details[@]}" -gt 0 ]; then
    echo
    printf '%s\n' "${details[@]}"
  fi
} >"$report"
cat "$report"
[ "$failures" -eq 0 ]
