#!/usr/bin/env bash
# Downloads into .whl/ the wheels that turnrl's code and its GPU tests import and that the lent
# GPU machine's image lacks, or holds too old, for its Python 3.12 on x86_64 Linux; at the
# versions constraints.txt pins. That machine has no package registry: the wheels travel with
# the working tree (64 MiB a call, so this checks they stay under 50 MiB), and
# scripts/gpu_check.sh installs them there. Run it here, where pip reaches PyPI:
#
#   bash scripts/gpu_wheels.sh          # then carry .whl (git-ignored) to the GPU machine
#
# The list is what importing tests/gpu and benchmarks/rollout_async_vs_batch.py loads, less
# the packages the image holds (/work/.library/device/KINDS.md, read 2026-11). Three it holds
# are carried anyway: grpcio and protobuf, since the generated stubs in turnrl/v1 refuse
# versions older than theirs and the image's are not known, and transformers (5.17 there;
# pyproject asks for 5.24). SGLang and vLLM's CUDA build are gigabytes: they never travel.
set -euo pipefail
cd "$(dirname "$0")/.."

MAX_MIB=50
PACKAGES=(
  grpcio protobuf transformers
  grpcio-health-checking grpcio-reflection tenacity pytest-asyncio
  pydantic pydantic-core annotated-types typing-inspection
  # tool_svc: tool schemas (jsonschema), the MCP tool (mcp and what it imports), search.
  jsonschema jsonschema-specifications referencing rpds-py
  mcp mcp-types starlette sse-starlette uvicorn python-multipart opentelemetry-api
  cryptography cffi
  bm25s pystemmer
  # reward_svc's math scorer.
  math-verify latex2sympy2-extended antlr4-python3-runtime
  # tests/fixture_files.py.
  httpx2 httpcore2 truststore sniffio
)

# NAME==VERSION as constraints.txt pins NAME (names compared as PEP 503 normalizes them).
pinned() {
  local name="$1" line
  line="$(sed -E 's/#.*//' constraints.txt \
    | awk -v want="$name" -F'==' '{ n = tolower($1); gsub(/[-_.]+/, "-", n)
        w = tolower(want); gsub(/[-_.]+/, "-", w); if (n == w) print $1 "==" $2 }')"
  if [ -z "$line" ]; then
    echo "constraints.txt pins no version of '$name'" >&2
    return 1
  fi
  echo "$line"
}

requirements=()
for name in "${PACKAGES[@]}"; do
  requirements+=("$(pinned "$name")")
done

mkdir -p .whl
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
  manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${requirements[@]}"

# One version of each: two make the install on the GPU machine stop.
duplicates="$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)"
if [ -n "$duplicates" ]; then
  echo ".whl/ holds several versions of: $duplicates; delete the old ones" >&2
  exit 1
fi
total_bytes=$(du -cb .whl/*.whl | tail -n1 | cut -f1)
total_mib="$(awk -v bytes="$total_bytes" 'BEGIN { printf "%.1f", bytes / 1048576 }')"
echo "$(ls .whl/*.whl | wc -l) wheels, ${total_mib} MiB in .whl/"
if [ "$total_bytes" -ge $((MAX_MIB * 1048576)) ]; then
  echo ".whl/ holds ${total_mib} MiB, over the ${MAX_MIB} MiB that leave room for the tree" >&2
  exit 1
fi
