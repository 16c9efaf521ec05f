#!/usr/bin/env bash
# System packages turnrl needs, installed with apt when missing (run by `make setup`).
#   python3-venv: the project's .venv;  bubblewrap and prlimit (util-linux): the tool
#   service's Python sandbox.
set -euo pipefail

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "turnrl needs Python >= 3.11; python3 is $(python3 --version 2>&1)" >&2
  exit 1
fi

missing=()
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v prlimit >/dev/null || missing+=(util-linux)

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
