#!/usr/bin/env bash
# The browser `make test` loads turnrl's report page in (tests/test_run_report.py): Chromium from
# the distribution's packages, installed with apt when missing. `make demo` does not need it.
set -euo pipefail

command -v chromium >/dev/null && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system package: chromium; install it with: sudo apt-get install -y chromium" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
