# The targets are the commands people type. Each one sets up its own venv from nothing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a bare "torch" pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2

.PHONY: help install demo test test-fast train train-ddp train-fsdp bench format lint typecheck check clean

help:
	@echo "make demo        train the default model with DDP on $(NPROC) processes and plot the loss"
	@echo "make test        run the whole test suite (real gloo processes on CPU)"
	@echo "make train-ddp   train configs/ddp.yaml;  make train-fsdp: configs/fsdp.yaml"
	@echo "make bench       loop-overhead benchmark (dtlab step vs a hand-written loop)"
	@echo "make check       lint + format check + type check"

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/dtlab train configs/demo.yaml --nproc $(NPROC)

train: install
	$(BIN)/dtlab train

train-ddp: install
	$(BIN)/dtlab train configs/ddp.yaml --nproc $(NPROC)

train-fsdp: install
	$(BIN)/dtlab train configs/fsdp.yaml --nproc $(NPROC)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python -m dtlab.bench.overhead
	$(BIN)/python -m dtlab.bench.checkpoint --preset small
	$(BIN)/dtlab bench --strategies single,ddp,fsdp,hsdp --nproc 1,2,4 --steps 8 --out bench-out \
		--set model.preset=tiny data.source=stdlib parallel.replicate=2

format: install
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: install
	$(BIN)/mypy

check: lint typecheck

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .mypy_cache .ruff_cache
