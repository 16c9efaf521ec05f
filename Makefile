# One-command setup: every target that needs Python first builds or refreshes .venv from
# pyproject.toml + constraints.txt (idempotent: a stamp file skips the install when nothing changed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-learning test-compose test-gpu lint format protos lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/setup_system.sh
	bash scripts/setup_system.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The main job on the CPU default: GRPO on the tiny calculator model through the four services.
# Each demo is a new run under runs/ (resume one with trainer.run_name=NAME --resume).
demo: $(STAMP)
	$(VENV)/bin/turnrl run --config examples/calculator/config.yaml \
	  trainer.run_name=calculator-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest

# The demo and the two CPU recipes for their configured steps: each must end within 0.05 of the
# held-out accuracy README states for it (tests/learning/).
test-learning: $(STAMP)
	$(PY) -m pytest -m learning tests/learning

# docker-compose.yml for real: a Docker engine (installed and started when missing; needs root),
# the image, the four services, a few training steps through them from this host.
test-compose: $(STAMP)
	bash tests/compose/compose_stack.sh

# The GPU tests (tests/gpu/): a CUDA device and SGLang (pip install '.[sglang]') needed.
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu tests/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Regenerate the committed stubs in turnrl/v1/ from protos/ (tests fail when they drift).
protos: $(STAMP)
	$(PY) -m turnrl.protogen

# Re-pin constraints.txt to what .venv holds now.
lock: $(STAMP)
	{ head -n 2 constraints.txt; $(PY) -m pip freeze --exclude-editable \
	  | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
