# The two commands of the README: `make demo` (the main job) and `make test` (the CPU suite + checks).
# Both create .venv first. CPU machines install a CPU build of torch before the project, so that
# pip never pulls a CUDA build; override TORCH on other machines (GPU users install genengine[sglang]
# or genengine[vllm], which pin the engines' torch).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# verl for tests/integrations/test_verl.py, without its requirements (see pyproject's dev extra for why and what it needs).
VERL_DEV ?= verl==0.9.1
# TransferQueue for verl's default (v1) trainer, also without its requirements (it asks for ray[default]).
TQ_DEV ?= TransferQueue==0.1.11
# Two workers (pytest-xdist), one test file each at a time: the CI machine has two cores, and most of the suite
# waits on subprocesses and process groups.
PYTEST_WORKERS ?= 2

.PHONY: setup demo test lint docs clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps "$(VERL_DEV)" "$(TQ_DEV)"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/genengine demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $(VENV)/site

test: lint docs
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache out
